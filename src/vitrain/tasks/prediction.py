"""The prediction task: classify image files with a trained checkpoint, each photo preprocessed as the
checkpoint's evaluation images were (its datamodule's `eval_decoder` and `device_transform`); one CSV row per
file. On several processes (`trainer=ddp`/`fsdp`, devices, nodes) each classifies its share of the files (the
evaluation sampler's: every file once) and global rank zero writes the rows of all, in the files' order."""

from __future__ import annotations

import csv
import io
import json
import logging
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf
from rich.table import Table

from vitrain.callbacks.progress import ProgressLog
from vitrain.checkpoints import CheckpointError
from vitrain.data.readers.image_folders import IMAGE_SUFFIXES, class_files, find_unreadable, warn_left_out
from vitrain.errors import DataError, UserError
from vitrain.tasks.build import RunObjects, build_trainer
from vitrain.tasks.evaluation import (
    CLASSES_SHOWN,
    checkpoint_model,
    preprocessing_of,
    print_per_class,
    print_table,
    print_titled,
    read_checkpoint,
)
from vitrain.utils.atomic import write_atomic
from vitrain.utils.provenance import code_version, software_versions
from vitrain.utils.run_files import EVAL_METRICS

log = logging.getLogger(__name__)

# loader workers when `num_workers` is null: the cores less one for the main process, at most this many
MAX_AUTO_WORKERS = 8


def image_paths(inputs: str | Sequence[str]) -> list[str]:
    """The image files named by `inputs` (folders searched with their sub-folders, hidden ones left out), in
    the order given, each folder's in path order, each file once. Other files in a folder are counted in a
    warning; a named file that is not an image is refused."""
    names = [inputs] if isinstance(inputs, str) else list(inputs)
    if not names:
        raise DataError("inputs=[] names no files: give a folder of images or image files")
    found: list[str] = []
    others: list[Path] = []
    for name in names:
        path = Path(str(name)).expanduser()
        if path.is_dir():
            images, rest = class_files(path)
            found += map(str, images)
            others += rest
        elif path.is_file():
            if path.suffix.lower() not in IMAGE_SUFFIXES:
                raise DataError(f"inputs: {path} is not a {'/'.join(IMAGE_SUFFIXES)} image")
            found.append(str(path))
        else:
            raise DataError(f"inputs: {path} does not exist")
    if rank_zero_only.rank == 0:  # every rank lists the files; one says what it left out
        warn_left_out(others)
    found = list(dict.fromkeys(found))
    if not found:
        raise DataError(f"inputs={inputs}: no {'/'.join(IMAGE_SUFFIXES)} images found")
    return found


def fetch_inputs(inputs: str | Sequence[str], cache_dir: Path) -> tuple[list[str], dict[str, str]]:
    """`inputs` with each s3:// object or prefix fetched into the cache (`S3Store.fetch`: verified, once per
    version of the objects), and a map from each fetched local path to its URI, for the CSV."""
    names = [inputs] if isinstance(inputs, str) else list(inputs)
    local, origin = [], {}
    for name in map(str, names):
        if not name.startswith("s3://"):
            local.append(name)
            continue
        from vitrain.s3.client import parse_s3_uri  # boto3 only when needed
        from vitrain.s3.store import S3Store

        fetched = str(S3Store().fetch(parse_s3_uri(name.rstrip("/")), cache_dir))
        local.append(fetched)
        origin[fetched] = name.rstrip("/")
    return local, origin


def shown_as(path: str, origin: dict[str, str]) -> str:
    """`path` as the user named it: the s3:// URI of a fetched file, else the path itself."""
    for local, uri in origin.items():
        if path == local:
            return uri
        if path.startswith(local + os.sep):
            return uri + "/" + Path(path).relative_to(local).as_posix()
    return path


def readable(paths: list[str], bad_images: str, workers: int) -> list[str]:
    """The files PIL can read (checked by `workers` processes); a bad one stops the run (named) or is skipped
    (`bad_images=skip`, logged). Every rank checks every file: the ranks then agree on the files and their
    positions, and all stop at once on a bad one, before any process group exists."""
    if bad_images not in ("stop", "skip"):
        raise DataError(f"bad_images={bad_images!r}: choose stop or skip")
    bad = find_unreadable(paths, workers)
    if not bad:
        return paths
    if bad_images == "stop":
        path, why = bad[0]
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise DataError(
            f"{path} is not a readable image ({why}){more}: remove or replace it, or set bad_images=skip"
        )
    for path, why in bad if rank_zero_only.rank == 0 else ():
        log.warning("skipping %s: not a readable image (%s)", path, why)
    dropped = {p for p, _ in bad}
    kept = [p for p in paths if p not in dropped]
    if not kept:
        raise DataError(f"none of the {len(paths)} files is a readable image")
    return kept


def _positive(cfg: DictConfig, key: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{key}={value}: must be a positive whole number")
    return value


def predict(cfg: DictConfig) -> tuple[dict[str, float], RunObjects]:
    """Classify `cfg.inputs` with `cfg.ckpt_path`; writes the CSV (`cfg.output`, else predictions.csv in the
    run dir) and prints how many images went to each class."""
    top_k, batch_size = _positive(cfg, "top_k"), _positive(cfg, "batch_size")
    given = OmegaConf.to_container(cfg.inputs) if OmegaConf.is_config(cfg.inputs) else cfg.inputs
    inputs, origin = fetch_inputs(given, Path(cfg.paths.cache_dir).expanduser() / "s3")
    inputs = inputs[0] if isinstance(given, str) else inputs
    listed = image_paths(inputs)
    path, checkpoint, run_cfg = read_checkpoint(cfg, {"ckpt_path": str(cfg.ckpt_path), "inputs": given})
    classes = checkpoint.get("class_names")
    if not classes:
        raise CheckpointError(f"{path} names no classes: it was not written by src/train.py")
    model = checkpoint_model(checkpoint, path, run_cfg, list(classes), str(cfg.ckpt_path))
    model.predict_top_k = top_k
    datamodule = preprocessing_of(checkpoint, run_cfg, model)
    trainer = build_trainer(cfg, [ProgressLog()], loggers=False, float8=bool(model.hparams.get("float8")))
    # the cores of this machine, shared by the processes the run starts on it
    cores = max(1, len(os.sched_getaffinity(0)) // trainer.num_devices)
    paths = readable(listed, cfg.bad_images, cores)
    if len(paths) < trainer.world_size:  # each process takes at least one file (the evaluation sampler)
        raise DataError(
            f"{len(paths)} image(s) for {trainer.world_size} processes: classify them with at most "
            f"{len(paths)} (trainer.devices, trainer.num_nodes)"
        )
    workers = cfg.get("num_workers")
    if workers is None:
        share = -(-len(paths) // trainer.world_size)
        workers = max(0, min(MAX_AUTO_WORKERS, cores - 1, share // batch_size))
    datamodule.predict_files(paths, batch_size, workers)

    batches = trainer.predict(model, datamodule=datamodule, return_predictions=True)
    objects = RunObjects(cfg, datamodule, model, [], [], trainer, checkpoint_path=path)
    metrics = {"images": float(len(paths))}
    rows = gathered(batches, trainer.world_size)
    if not trainer.is_global_zero:
        return metrics, objects
    positions, probabilities, indices = rows
    order = positions.argsort()
    if not torch.equal(positions[order], torch.arange(len(paths))):
        raise RuntimeError(f"the processes classified {len(positions)} files of {len(paths)}, not each once")
    probabilities, indices = probabilities[order], indices[order]
    labels = folder_labels(inputs, paths, list(classes))
    out = Path(str(cfg.output)) if cfg.get("output") else Path(cfg.paths.output_dir) / "predictions.csv"
    files = [shown_as(p, origin) for p in paths]
    write_predictions(out, files, list(classes), probabilities.tolist(), indices.tolist(), labels)
    counts = Counter(classes[row[0]] for row in indices.tolist())
    print_counts(counts, f"{len(paths)} images classified by {cfg.ckpt_path}")
    log.info(f"Predictions written to {out}")
    # the run's summary (a sweep's row: vitrain.reporting.sweep), with the accuracy of labelled files
    summary: dict[str, Any] = {
        "ckpt_path": str(cfg.ckpt_path),
        "inputs": str(cfg.inputs),
        "images": len(paths),
    }
    if labels is not None:
        metrics.update(score(cfg, list(classes), indices, labels, objects))
        summary |= {k: v for k, v in metrics.items() if k != "images"}
        summary |= {"per_class_acc": objects.per_class_acc, "per_class_images": objects.per_class_images}
    written = Path(cfg.paths.output_dir) / EVAL_METRICS
    provenance = {"code": code_version(), "software": software_versions()}  # what produced these numbers
    write_atomic(written, json.dumps({**summary, "predictions": str(out), **provenance}, indent=2))
    log.info(f"{'Metrics of the labelled files' if labels is not None else 'Summary'} written to {written}")
    return metrics, objects


def gathered(batches: list, world_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions, probabilities, classes) of the files every process classified (`predict_step`'s batches),
    on every process; a process with no rows (an empty share) adds none."""
    mine = [torch.cat(parts) for parts in zip(*batches, strict=True)] if batches else None
    everyone = [mine]
    if world_size > 1:
        # a list of tensors per rank, of different lengths: torch's object gather (Lightning's `all_gather`
        # takes tensors of one shape)
        everyone = [None] * world_size
        dist.all_gather_object(everyone, mine)
    parts = [rows for rows in everyone if rows is not None]
    return tuple(torch.cat(column) for column in zip(*parts, strict=True))  # type: ignore[return-value]


def folder_labels(inputs: str | Sequence[str], paths: list[str], classes: list[str]) -> list[int] | None:
    """The label of every file when `inputs` is one folder of class folders named as the checkpoint's classes
    (a labelled set: `new_photos/<class>/...`): the class of its first folder under `inputs`. None when any
    sub-folder is not a class name or a file lies outside them: the files are not all labelled."""
    if not isinstance(inputs, str) or not Path(inputs).expanduser().is_dir():
        return None
    root = Path(inputs).expanduser()
    folders = {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")}
    if not folders or not folders <= set(classes):
        return None
    index = {name: i for i, name in enumerate(classes)}
    parts = [Path(path).relative_to(root).parts for path in paths]
    if any(len(p) < 2 for p in parts):
        return None
    return [index[p[0]] for p in parts]


def score(
    cfg: DictConfig, classes: list[str], indices: torch.Tensor, labels: list[int], objects: RunObjects
) -> dict[str, float]:
    """Accuracy of files labelled by their class folders (top-1, and top-5 for 5 classes or more unless
    top_k < 5), and per class (in `objects`), printed as eval.py prints them."""
    truth = torch.tensor(labels)
    hits = (indices[:, 0] == truth).float()
    metrics = {"acc1": hits.mean().item()}
    if len(classes) >= 5 and indices.shape[1] >= 5:  # as the model's own metrics: of 5 classes or more
        metrics["acc5"] = (indices[:, :5] == truth[:, None]).any(1).float().mean().item()
    images = torch.bincount(truth, minlength=len(classes))
    correct = torch.bincount(truth, weights=hits, minlength=len(classes))
    present = [i for i in range(len(classes)) if images[i] > 0]
    objects.per_class_acc = {classes[i]: (correct[i] / images[i]).item() for i in present}
    objects.per_class_images = {classes[i]: int(images[i]) for i in present}
    title = f"{len(labels)} files labelled by their class folders"
    print_table(metrics, f"{title}: accuracy of {cfg.ckpt_path}")
    print_per_class(objects.per_class_acc, objects.per_class_images, f"{title}: accuracy per class")
    return metrics


def write_predictions(
    out: Path,
    paths: list[str],
    classes: list[str],
    probabilities: list[list[float]],
    indices: list[list[int]],
    labels: list[int] | None = None,
) -> None:
    """One row per file: `file, class, probability` of the most probable class, then `class_2,
    probability_2`, ... for the next ones, and `label` (the class folder) for labelled files; written whole
    or not at all (`write_atomic`)."""
    header = ["file", "class", "probability"]
    for rank in range(2, len(indices[0]) + 1):
        header += [f"class_{rank}", f"probability_{rank}"]
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow([*header, *(["label"] if labels is not None else [])])
    for n, (file, probs, idx) in enumerate(zip(paths, probabilities, indices, strict=True)):
        ranked = (x for i, p in zip(idx, probs, strict=True) for x in (classes[i], f"{p:.6f}"))
        writer.writerow([file, *ranked, *([classes[labels[n]]] if labels is not None else [])])
    write_atomic(out, text.getvalue())


def print_counts(counts: Counter, title: str) -> None:
    """Images per predicted class, most first; of many classes the first CLASSES_SHOWN (the CSV has all)."""
    table = Table()
    table.add_column("class")
    table.add_column("images", justify="right")
    for name, n in counts.most_common(CLASSES_SHOWN):
        table.add_row(name, str(n))
    if len(counts) > CLASSES_SHOWN:
        rest = counts.most_common()[CLASSES_SHOWN:]
        table.add_row(f"... {len(rest)} more classes", str(sum(n for _, n in rest)))
    print_titled(title, table)
