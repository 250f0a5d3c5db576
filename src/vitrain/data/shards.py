"""Write an image-folder data set once as litdata shards, to a local folder or to S3:

    python -m vitrain.data.shards SRC DST        (make shards SRC=... DST=...)

SRC is a `train/<class>/` tree with `val/<class>/` and/or `test/<class>/` (the ImageNet layout) or a
.tar/.tar.gz/.zip of one; DST a folder or `s3://bucket/prefix`. Each split becomes a litdata dataset
(`DST/<split>/index.json` + `chunk-*.bin`) holding the files' encoded bytes as they are (JPEG, PNG, WebP:
no re-encoding, no decoded pixels) with the label and the sample's index; `DST/vitrain-shards.json` names
the classes, the splits and the format version. A validation split is carved from train when SRC has none.
Each split is written in a fixed random order (`--split-seed`), not class by class (`shuffled`).

S3 output is written to a local staging folder first and uploaded with vitrain's verified uploader (same
AWS credential chain and endpoint settings as the checkpoint upload); the metadata file goes up last, so a
half-finished upload is never mistaken for a data set.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

from vitrain.data.readers.cache import ARCHIVE_SUFFIXES, unpack_archive
from vitrain.data.readers.image_folders import (  # noqa: F401 (SPLITS, Source, IMAGE_SUFFIXES: the writer's API too)
    IMAGE_SUFFIXES,
    SPLITS,
    Source,
    carve_val,
    find_source,
    find_unreadable,
    scan,
    unreadable,
)
from vitrain.errors import DataError, UserError
from vitrain.utils.atomic import write_atomic

log = logging.getLogger(__name__)
logging.getLogger("litdata").setLevel(logging.WARNING)  # per-worker cache sizing notes at INFO

METADATA_FILE = "vitrain-shards.json"
FORMAT_NAME = "vitrain-shards"
# bump when what a sample holds or how splits are laid out changes; readers refuse other versions
FORMAT_VERSION = 1
DEFAULT_CHUNK_BYTES = "64MB"  # litdata's recommended chunk size for object storage


def read_sample(item: tuple[str, int, int]) -> dict[str, Any]:
    """One sample as stored: the file's bytes untouched, its label and its index within the split."""
    path, label, index = item
    return {"image": Path(path).read_bytes(), "label": label, "index": index}


#: how `write_shards` orders each split's samples (the metadata's `order`)
SHUFFLED = "shuffled"


def shuffled(files: list[tuple[str, int]], seed: int, split: str) -> list[tuple[str, int]]:
    """The split's files in a fixed random order, drawn from (seed, split).

    Why: a folder lists its images class by class, and litdata's training shuffle permutes whole chunks, then
    samples only within a window of each worker's stream: from chunks written in class order a batch held one
    to three classes of ten (the datamodule's training loader, 32 images of CIFAR-10). Written shuffled, every
    chunk, and any prefix of a split (`trainer.limit_test_batches`), is a random sample of it."""
    return random.Random(f"{seed}|{split}").sample(files, len(files))


def write_split(files: list[tuple[str, int]], out_dir: Path, chunk_bytes: str, workers: int) -> None:
    import litdata

    inputs = [(path, label, i) for i, (path, label) in enumerate(files)]
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore", UserWarning
        )  # "an item was larger than the chunk size" on tiny chunks
        litdata.optimize(
            fn=read_sample,
            inputs=inputs,
            output_dir=str(out_dir),
            chunk_bytes=chunk_bytes,
            num_workers=max(1, min(workers, len(inputs))),
            mode="overwrite",
            # fork: a worker starts in milliseconds (spawn re-imports torch: seconds per worker)
            start_method="fork",
            verbose=False,
        )


def write_shards(
    src: str | os.PathLike,
    dst: str,
    val_size: int | float = 0.05,
    split_seed: int = 0,
    chunk_bytes: str = DEFAULT_CHUNK_BYTES,
    workers: int | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Write SRC as shards at DST (a folder or s3://bucket/prefix); returns the metadata written."""
    from vitrain.s3.client import is_s3_uri, parse_s3_uri
    from vitrain.s3.store import S3Store

    remote = is_s3_uri(dst)
    store = S3Store() if remote else None
    if remote:
        target = parse_s3_uri(dst)
        store.preflight(target)  # credentials and bucket, in seconds, before any work
    source_path = Path(src).expanduser().absolute()
    if not source_path.exists():
        raise DataError(
            f"{source_path} does not exist: give an image folder (train/<class>/...) or an archive of one"
        )
    cache = Path(cache_dir or os.environ.get("VITRAIN_CACHE") or "~/.cache/vitrain").expanduser()
    if source_path.is_file() and source_path.name.lower().endswith(ARCHIVE_SUFFIXES):
        source_path = unpack_archive(source_path, cache / "unpacked")
    source = scan(find_source(source_path))
    splits = dict(source.splits)

    workers = workers or max(1, (os.cpu_count() or 1))
    bad = find_unreadable([p for files in splits.values() for p, _ in files], workers)
    if bad:
        for path, why in bad[:20]:
            log.warning("skipping %s (%s)", path, why)
        log.warning("skipped %d unreadable file(s) of %d", len(bad), sum(map(len, splits.values())))
        skip = {p for p, _ in bad}
        splits = {k: [f for f in v if f[0] not in skip] for k, v in splits.items()}
    if "val" not in splits:
        splits["train"], splits["val"] = carve_val(splits["train"], val_size, split_seed, key="--val-size")
        log.info(
            "no val/ in %s: carved %d validation images from train (seed %d)",
            src,
            len(splits["val"]),
            split_seed,
        )

    metadata = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "classes": source.classes,
        "splits": {k: len(v) for k, v in splits.items()},
        "skipped": [p for p, _ in bad],
        "source": str(src),
        "order": SHUFFLED,
        "split_seed": split_seed,
    }
    if remote:
        stage = Path(tempfile.mkdtemp(prefix="shards-", dir=_mkdir(cache / "staging")))
    else:
        stage = Path(dst).expanduser().absolute()
        stage.mkdir(parents=True, exist_ok=True)
        (stage / METADATA_FILE).unlink(missing_ok=True)  # a rewrite in progress is not a data set
    try:
        for split, files in splits.items():
            log.info("writing %s: %d images", split, len(files))
            write_split(shuffled(files, split_seed, split), stage / split, chunk_bytes, workers)
        if remote:
            for split in splits:
                store.upload_tree(stage / split, target.child(split))
            meta_file = stage / METADATA_FILE
            meta_file.write_text(json.dumps(metadata, indent=1))
            store.upload_file(meta_file, target.child(METADATA_FILE))
        else:
            write_atomic(stage / METADATA_FILE, json.dumps(metadata, indent=1))
    finally:
        if remote:
            shutil.rmtree(stage, ignore_errors=True)
    log.info("wrote %s to %s", metadata["splits"], dst)
    return metadata


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vitrain.data.shards", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("src", help="train/<class>/ (+ val/ or test/) folder, or a .tar/.tar.gz/.zip of one")
    parser.add_argument("dst", help="output folder or s3://bucket/prefix")
    parser.add_argument(
        "--val-size",
        type=float,
        default=0.05,
        help="carved from train when SRC has no val/: a count, or a fraction below 1",
    )
    parser.add_argument("--split-seed", type=int, default=0)
    parser.add_argument("--chunk-bytes", default=DEFAULT_CHUNK_BYTES)
    parser.add_argument("--workers", type=int, default=None, help="writer processes (default: all cores)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    val_size = int(args.val_size) if args.val_size >= 1 else args.val_size
    try:
        write_shards(args.src, args.dst, val_size, args.split_seed, args.chunk_bytes, args.workers)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
