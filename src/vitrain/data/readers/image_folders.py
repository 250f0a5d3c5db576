"""An image-folder tree (`train/<class>/`, with `val/<class>/` and/or `test/<class>/`: the ImageNet layout):
finding it, listing its files per split with labels, carving a validation split, and finding unreadable
files. Read by the image-folder datamodule and by the shard writer (vitrain/data/shards.py) alike."""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vitrain.data.sampling import carve
from vitrain.errors import DataError

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
# what the decoders read (vitrain.data.transforms.decode_tensor: torchvision's, PIL's for BMP, TIFF, PPM/PGM);
# torchvision's ImageFolder takes the same formats
IMAGE_SUFFIXES = (
    ".jpg",
    ".jpeg",
    ".png",
    ".webp",
    ".bmp",
    ".gif",
    ".tif",
    ".tiff",
    ".ppm",
    ".pgm",
)


@dataclass(frozen=True)
class Source:
    """Image files per split, each with its label index into `classes`."""

    classes: list[str]
    splits: dict[str, list[tuple[str, int]]]


def find_source(root: Path) -> Path:
    """The folder holding `train/`: `root` itself or its only sub-folder (an unpacked archive)."""
    for candidate in (root, *([p for p in root.iterdir() if p.is_dir()] if root.is_dir() else [])):
        if (candidate / "train").is_dir():
            return candidate
    raise DataError(
        f"{root} has no train/<class>/ folder: give a train/<class>/ tree (with val/ or test/) or an archive of one"
    )


def scan(root: Path) -> Source:
    """Classes from train/, files of every split present; refuse empty classes and class sets that differ."""
    classes = sorted(p.name for p in (root / "train").iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise DataError(f"{root / 'train'} has no class folders: put the images in train/<class>/")
    splits: dict[str, list[tuple[str, int]]] = {}
    for split in SPLITS:
        d = root / split
        if not d.is_dir():
            continue
        found = sorted(p.name for p in d.iterdir() if p.is_dir() and not p.name.startswith("."))
        if split != "train" and found != classes:
            extra, missing = sorted(set(found) - set(classes)), sorted(set(classes) - set(found))
            raise DataError(
                f"{d} has other classes than train/ (extra: {extra or 'none'}, missing: {missing or 'none'}): "
                "every split needs the same class folders"
            )
        files: list[tuple[str, int]] = []
        others: list[Path] = []
        for label, cls in enumerate(classes):
            images, rest = class_files(d / cls)
            if not images:
                raise DataError(
                    f"{d / cls} holds no {'/'.join(IMAGE_SUFFIXES)} images: add some or remove the folder"
                )
            files.extend((str(p), label) for p in images)
            others += rest
        warn_left_out(others, f"{d}: ")
        splits[split] = files
    return Source(classes, splits)


def warn_left_out(others: list[Path], where: str = "") -> None:
    """One warning for the files a folder walk left out as not images, counted by suffix."""
    if not others:
        return
    kinds = Counter(p.suffix.lower() or "no suffix" for p in others)
    log.warning(
        "%sleft out %d file(s) that are not %s images (%s), e.g. %s: convert the images among them to add them",
        where, len(others), "/".join(IMAGE_SUFFIXES), ", ".join(f"{k}: {n}" for k, n in kinds.most_common()),
        others[0],
    )  # fmt: skip


def class_files(folder: Path) -> tuple[list[Path], list[Path]]:
    """The images in a class folder and its sub-folders (torchvision's ImageFolder reads those too: photos
    sorted into albums), in path order; and the other files, left out (hidden files and folders: neither)."""
    images: list[Path] = []
    others: list[Path] = []
    for top, dirs, names in os.walk(folder, followlinks=True):
        dirs[:] = [name for name in dirs if not name.startswith(".")]
        for name in names:
            if not name.startswith("."):
                path = Path(top) / name
                (images if path.suffix.lower() in IMAGE_SUFFIXES else others).append(path)
    return sorted(images), sorted(others)


def carve_val(
    files: list[tuple[str, int]],
    val_size: int | float,
    seed: int,
    method: str = "stratified",
    key: str = "datamodule.val_size",
) -> tuple[list, list]:
    """(train, val) from one list of (path, label), in its order, by `method` (vitrain.data.sampling.carve:
    every class in proportion by default), the same split every time (the shards written, the folder read)."""
    train, val = carve([label for _, label in files], val_size, seed, method, key)
    return [files[i] for i in train], [files[i] for i in val]


def wide_pixels(img: Any) -> str | None:
    """Why a PIL image of 32-bit pixels is not used, or None. PIL's `convert("RGB")` clips them at 255 (a
    float image in [0, 1] trained as a black one): float pixels have no 8-bit scale; integer ones (a 16-bit
    PGM opens as mode I) are read as 16-bit when they fit in 16 bits (decoded here to see), else refused."""
    if img.mode == "F":
        return "32-bit float pixels (PIL mode F) have no 8-bit scale: save the image with 8 or 16 bits per channel"
    if img.mode == "I":
        low, high = img.getextrema()
        if low < 0 or high > 65535:
            return (
                f"32-bit integer pixels (PIL mode I) from {low} to {high} have no 8-bit scale: save the image "
                "with 8 or 16 bits per channel"
            )
    return None


def unreadable(path: str) -> str | None:
    """Why `path` is not a usable image (truncated, not an image, 32-bit pixels), or None; checked by PIL
    without decoding every pixel, so writing ImageNet stays I/O bound.

    PIL's verify reads a JPEG's headers only, so a JPEG cut short passes it: one without its end-of-image
    marker near the end is decoded at 1/8 scale (libjpeg's DCT scaling), which fails on a truncated file and
    passes a whole one with bytes after the marker. Only such files pay for a decode."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            jpeg, wide = img.format == "JPEG", img.mode in ("I", "F")
            img.verify()
        if wide:  # only such files pay for a decode
            with Image.open(path) as img:
                why = wide_pixels(img)
            if why:
                return why
        if jpeg and not _ends_jpeg(path):
            with Image.open(path) as img:
                img.draft(img.mode, (1, 1))
                img.load()
    except Exception as e:  # PIL raises many types for bad files
        return f"{type(e).__name__}: {e}"
    return None


def _ends_jpeg(path: str, tail: int = 1024) -> bool:
    """The JPEG end-of-image marker in the file's last `tail` bytes (scan data cannot contain it: a 0xFF
    there is always followed by 0x00 or a restart marker)."""
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - tail))
        return b"\xff\xd9" in f.read()


def find_unreadable(paths: list[str], workers: int) -> list[tuple[str, str]]:
    """(path, why) of every file that is not a usable image, checked by `workers` processes."""
    import multiprocessing

    if workers <= 1 or len(paths) < 1000:
        reasons = [unreadable(p) for p in paths]
    else:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            reasons = pool.map(unreadable, paths, chunksize=256)
    return [(p, why) for p, why in zip(paths, reasons, strict=True) if why]
