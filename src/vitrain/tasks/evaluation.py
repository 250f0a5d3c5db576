"""The evaluation task: rebuild model and data from a checkpoint's saved config, then test."""

import json
import logging
import os
from pathlib import Path
from typing import Any

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from vitrain import checkpoints
from vitrain.callbacks.progress import ProgressLog
from vitrain.checkpoints import CheckpointError, state_dict_mismatch
from vitrain.errors import DataError, ModelError, UserError
from vitrain.models.classifier import check_classes
from vitrain.models.timm_net import input_spec
from vitrain.tasks.build import RunObjects, build_trainer
from vitrain.tasks.cli import EVAL_ADDED_ENV, closest_key
from vitrain.tasks.runs import resolve_checkpoint
from vitrain.utils.atomic import write_atomic
from vitrain.utils.config import instantiate_dict, print_run_config
from vitrain.utils.provenance import code_version, software_versions
from vitrain.utils.run_files import EVAL_METRICS

log = logging.getLogger(__name__)


def _command_line_overrides(prefixes: tuple[str, ...]) -> list[str]:
    """`datamodule.x=...` / `model.x=...` overrides the user typed, to apply over the saved config."""
    if not HydraConfig.initialized():
        return []
    return [o for o in HydraConfig.get().overrides.task if o.lstrip("+~").startswith(prefixes)]


def saved_config(checkpoint: dict[str, Any], path: Path) -> DictConfig:
    """The training run's model and datamodule config, with the evaluator's overrides on top."""
    run_config = checkpoint.get("run_config")
    if not run_config:
        raise CheckpointError(f"{path} has no saved run config: it was not written by src/train.py")
    # classes that moved since the checkpoint was written are found where they live now
    saved = checkpoints.current_targets(
        {"model": run_config["model"], "datamodule": run_config["datamodule"]}
    )
    data = saved["datamodule"]
    if (
        str(data.get("_target_", "")).startswith("vitrain.")
        and "val_size" in data
        and "val_split" not in data
    ):
        # written before the stratified carve: the validation images are those its run carved, at random
        data["val_split"] = "random"
    cfg = OmegaConf.create(saved)
    overrides = [o.lstrip("+") for o in _command_line_overrides(("model.", "datamodule."))]
    check_against_checkpoint(cfg, overrides, path)
    cfg.merge_with_dotlist(overrides)
    # the weights come from the checkpoint: never download or read pretrained weights again
    cfg.model.net.pretrained = False
    cfg.model.weights_file = None
    return cfg


def check_against_checkpoint(cfg: DictConfig, overrides: list[str], path: Path) -> None:
    """Each `model.*` / `datamodule.*` override must name a key of the checkpoint's config (unless typed with
    `+`), and the model is the checkpoint's: another `model.net.model_name` is refused, not evaluated."""
    added = set(filter(None, os.environ.get(EVAL_ADDED_ENV, "").split(",")))
    for override in overrides:
        key, _, value = override.partition("=")
        if key in added:
            continue
        if OmegaConf.select(cfg, key, default=_ABSENT) is _ABSENT:
            target = OmegaConf.select(cfg, key.split(".")[0] + "._target_") or "its config"
            raise UserError(
                f"unknown config key {key} for this checkpoint's {key.split('.')[0]} ({target})"
                f"{closest_key(key, cfg)}; to add a key use +{key}=..."
            )
        if key == "model.net.model_name" and value != str(cfg.model.net.model_name):
            raise ModelError(
                f"model.net.model_name={value}: {path} is a {cfg.model.net.model_name}; eval.py evaluates the "
                "checkpoint's model (leave model.net.model_name out)"
            )


_ABSENT = object()


def print_table(metrics: dict[str, float], title: str) -> None:
    table = Table()
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in sorted(metrics.items()):
        table.add_row(name, f"{value:.4f}")
    print_titled(title, table)


#: classes shown on the console at most: more (ImageNet's 1000) show the worst and best half of this each
CLASSES_SHOWN = 30


def print_per_class(accuracy: dict[str, float], images: dict[str, int], title: str) -> None:
    """Every class in label order; of many classes the worst and the best (metrics.json has all)."""
    table = Table()
    table.add_column("class")
    table.add_column("accuracy", justify="right")
    table.add_column("images", justify="right")

    def row(name: str) -> tuple[str, str, str]:
        return name, f"{accuracy[name]:.4f}", str(images[name])

    rows = [row(name) for name in accuracy]
    if len(rows) > CLASSES_SHOWN:
        ranked = sorted(accuracy, key=lambda name: (accuracy[name], name))
        half = CLASSES_SHOWN // 2
        title += f": the {half} worst and the {half} best of {len(rows)} (metrics.json has every class)"
        rows = [*map(row, ranked[:half]), ("...", "", ""), *map(row, ranked[-half:])]
    for cells in rows:
        table.add_row(*cells)
    print_titled(title, table)


def print_titled(title: str, table: Table) -> None:
    """The title on a line of its own: as a Table title Rich wraps it to the table's width, which cut the
    checkpoint's path into 22-character pieces that could not be copied."""
    console = Console()
    console.print(title, soft_wrap=True, highlight=False, markup=False)
    console.print(table)


def read_checkpoint(cfg: DictConfig, task_keys: dict[str, Any]) -> tuple[Path, dict[str, Any], DictConfig]:
    """(local path, contents, model and datamodule config with the overrides) of `cfg.ckpt_path`; the config
    tree printed (extras.print_config) is what runs: `task_keys`, the checkpoint's model and data, the
    trainer (if any)."""
    path = resolve_checkpoint(str(cfg.ckpt_path), cfg.paths.cache_dir)
    checkpoint = checkpoints.load(path)
    run_cfg = saved_config(checkpoint, path)
    if (cfg.get("extras") or {}).get("print_config"):
        shown = OmegaConf.create({**task_keys, **OmegaConf.to_container(run_cfg)})
        if "trainer" in cfg:  # src/export.py runs none
            shown.trainer = OmegaConf.to_container(cfg.trainer, resolve=True)
        print_run_config(shown, Path(cfg.paths.output_dir) / "config_tree.log")
    return path, checkpoint, run_cfg


def checkpoint_model(
    checkpoint: dict[str, Any], path: Path, run_cfg: DictConfig, classes: list[str], shown_as: str
) -> L.LightningModule:
    """The checkpoint's model with its weights, for data of `classes` (`shown_as`: the checkpoint as the
    user gave it)."""
    model: L.LightningModule = hydra.utils.instantiate(run_cfg.model)
    if int(model.net.num_classes) != len(classes):
        raise CheckpointError(
            f"{shown_as} has a {model.net.num_classes}-class head, the data has {len(classes)} classes: "
            "evaluate it on the data it was trained on"
        )
    try:
        model.load_state_dict(checkpoint["state_dict"])
    except RuntimeError as err:
        detail = state_dict_mismatch(err)
        if detail is None:
            raise
        raise CheckpointError(f"{path} does not fit model {run_cfg.model.net.model_name}: {detail}") from err
    model.input_spec = {**model.input_spec, **trained_normalisation(checkpoint, model)}
    return model


def trained_normalisation(checkpoint: dict[str, Any], model: L.LightningModule) -> dict[str, Any]:
    """The `mean` and `std` the run's images were normalised with. The network is built here without its
    pretrained weights (`saved_config`), so its input spec would leave them to the data set's own statistics
    (CIFAR's), where training took the pretrained weights' (timm's config: 0.5 for most ViTs). A checkpoint
    records them; for one written before it did, they are derived as training derived them."""
    saved = checkpoint.get("normalisation")
    if isinstance(saved, dict) and saved.get("mean") and saved.get("std"):
        return {"mean": tuple(saved["mean"]), "std": tuple(saved["std"])}
    trained = (checkpoint.get("run_config") or {}).get("model") or {}
    started_from_weights = bool((trained.get("net") or {}).get("pretrained") or trained.get("weights_file"))
    spec = input_spec(model.net, started_from_weights, model.hparams.net.get("img_size"))
    return {"mean": spec["mean"], "std": spec["std"]}


def preprocessing_of(checkpoint: dict[str, Any], run_cfg: DictConfig, model: L.LightningModule) -> Any:
    """The checkpoint's datamodule for its evaluation preprocessing only (src/predict.py, src/export.py):
    the model's input spec, and how the training run held its images; its data is not read."""
    datamodule = hydra.utils.instantiate(run_cfg.datamodule)
    datamodule.set_input_spec(**model.input_spec)
    trained = checkpoint.get(type(datamodule).__qualname__)
    if isinstance(trained, dict):
        datamodule.follow_checkpoint(trained)
    return datamodule


def evaluate(cfg: DictConfig) -> tuple[dict[str, float], RunObjects]:
    """Evaluate `cfg.ckpt_path` on `cfg.split` (test or val); writes metrics.json in the run dir."""
    if cfg.split not in ("test", "val"):
        raise CheckpointError(f"split={cfg.split} is not one of test, val")
    path, checkpoint, run_cfg = read_checkpoint(cfg, {"ckpt_path": str(cfg.ckpt_path), "split": cfg.split})
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)

    # the data first: a checkpoint trained on other classes is refused before its weights are read
    try:
        datamodule: L.LightningDataModule = hydra.utils.instantiate(run_cfg.datamodule)
        classes = list(datamodule.classes)
    except DataError as err:
        raise DataError(elsewhere_hint(str(err), run_cfg.datamodule.get("data_dir"))) from None
    check_classes(checkpoint.get("class_names"), classes, str(cfg.ckpt_path))
    model = checkpoint_model(checkpoint, path, run_cfg, classes, str(cfg.ckpt_path))
    datamodule.set_input_spec(**model.input_spec)
    per_class_acc = model.track_per_class_accuracy()

    callbacks = instantiate_dict(cfg.get("callbacks"))
    if not any(isinstance(c, ProgressLog) for c in callbacks):  # lines in eval.log too, not only a bar
        callbacks.append(ProgressLog())
    trainer = build_trainer(cfg, callbacks, loggers=False, float8=bool(model.hparams.get("float8")))
    objects = RunObjects(cfg, datamodule, model, callbacks, [], trainer, checkpoint_path=path)
    run = trainer.test if cfg.split == "test" else trainer.validate
    run(model=model, datamodule=datamodule, verbose=False)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    objects.per_class_acc = dict(zip(classes, per_class_acc.compute().tolist(), strict=True))
    # images of each class evaluated (true positives + false negatives: the class's support), over all ranks:
    # compute() syncs the counts for its result only and puts back this rank's own
    with per_class_acc.sync_context():
        support = (per_class_acc.tp + per_class_acc.fn).tolist()
    objects.per_class_images = dict(zip(classes, (int(n) for n in support), strict=True))

    if trainer.is_global_zero:
        # split=test of data without a test split (an image folder or shards without test/) is the val images
        images_of = "val" if cfg.split == "test" and getattr(datamodule, "test_is_val", False) else cfg.split
        write_metrics(cfg, metrics, objects.per_class_acc, objects.per_class_images, images_of)
    return metrics, objects


def elsewhere_hint(problem: str, data_dir: Any) -> str:
    """A data error where the checkpoint's own `datamodule.data_dir` is not on this machine (the run's
    machine, a folder since moved): the problem, and that their place here is to be given."""
    if not data_dir or str(data_dir).startswith("s3://") or Path(str(data_dir)).expanduser().exists():
        return problem
    if _command_line_overrides(("datamodule.data_dir",)):
        return problem
    return (
        f"{problem} (the checkpoint's run read its data from {data_dir}: give their place on this machine with "
        "datamodule.data_dir=...)"
    )


def write_metrics(
    cfg: DictConfig,
    metrics: dict[str, float],
    per_class: dict[str, float],
    images: dict[str, int],
    images_of: str,
) -> Path:
    """The tables on the console, and metrics.json in the run dir. `images_of`: the split whose images were
    evaluated (`val` for split=test of data without a test split)."""
    split = (
        cfg.split if images_of == cfg.split else f"{cfg.split} (the {images_of} images: no {cfg.split} split)"
    )
    print_table(metrics, f"{split} metrics of {cfg.ckpt_path}")
    print_per_class(per_class, images, f"{split} accuracy per class")
    out = Path(cfg.paths.output_dir) / EVAL_METRICS  # whole or not at all: a sweep's summary reads it
    write_atomic(
        out,
        json.dumps(
            {
                "ckpt_path": str(cfg.ckpt_path),
                "split": cfg.split,
                "images_of_split": images_of,
                **metrics,
                "per_class_acc": per_class,
                "per_class_images": images,
                # what produced these numbers
                "code": code_version(),
                "software": software_versions(),
            },
            indent=2,
        ),
    )
    log.info(f"Metrics written to {out}")
    return out
