"""Decode CIFAR laid out as class folders of 32x32 images (train/<class>/, test/<class>/).

For data sets exported or assembled as image files: the tree is checked for matching, non-empty classes
first, then every image is decoded into one preallocated tensor.
"""

from __future__ import annotations

import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor
from torchvision.io import ImageReadMode, decode_image

from vitrain.data.readers.cifar_spec import IMAGE_SHAPE, CifarSpec, Decoded
from vitrain.data.transforms import to_uint8
from vitrain.errors import DataError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


def _class_dirs(split_dir: Path) -> list[str]:
    return sorted(p.name for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith("."))


def folder_files(root: Path, spec: CifarSpec) -> dict[str, list[list[Path]]]:
    """Image files per split and class, checked for a complete, non-empty tree."""
    for split in ("train", "test"):
        if not (root / split).is_dir():
            raise DataError(
                f"{root / split} is missing: a class-folder {spec.name} needs both train/<class>/ and test/<class>/"
            )
    classes = _class_dirs(root / "train")
    if not classes:
        raise DataError(
            f"{root / 'train'} has no class folders: put the images in train/<class>/ and test/<class>/"
        )
    test_classes = _class_dirs(root / "test")
    for cls in sorted(set(classes) ^ set(test_classes)):
        have, lack = ("train", "test") if cls in classes else ("test", "train")
        raise DataError(
            f"class folder {root / lack / cls} is missing ({have}/{cls} exists): train and test need the same classes"
        )
    out: dict[str, list[list[Path]]] = {}
    for split in ("train", "test"):
        out[split] = []
        for cls in classes:
            d = root / split / cls
            files = sorted(
                p for p in d.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith(".")
            )
            if not files:
                raise DataError(
                    f"{d} holds no {'/'.join(IMAGE_SUFFIXES)} images: add them or remove the folder"
                )
            out[split].append(files)
    return out


def decode_folders(root: Path, decode_workers: int | None, spec: CifarSpec) -> Decoded:
    files = folder_files(root, spec)
    splits = {}
    for split, per_class in files.items():
        paths = [p for group in per_class for p in group]
        labels = torch.cat([torch.full((len(g),), i, dtype=torch.int64) for i, g in enumerate(per_class)])
        splits[split] = (_decode_images(paths, decode_workers, spec), labels)
    return Decoded(*splits["train"], *splits["test"], classes=_class_dirs(root / "train"))


def _decode_images(paths: list[Path], workers: int | None, spec: CifarSpec) -> Tensor:
    """Decode into one preallocated tensor; threads overlap file reads (decoding itself is GIL-bound C calls)."""
    out = torch.empty((len(paths), *IMAGE_SHAPE), dtype=torch.uint8)

    def work(span: range) -> None:
        for i in span:
            out[i] = _decode_one(paths[i], spec)

    workers = workers or min(4, os.cpu_count() or 1)
    step = max(256, -(-len(paths) // (workers * 8)))
    with warnings.catch_warnings():
        # torchvision 0.29 deprecates its io decoders in favour of torchcodec, which is not a dependency here
        warnings.simplefilter("ignore", DeprecationWarning)
        with ThreadPoolExecutor(workers) as pool:
            for fut in [
                pool.submit(work, range(i, min(i + step, len(paths)))) for i in range(0, len(paths), step)
            ]:
                fut.result()
    return out


def _decode_one(path: Path, spec: CifarSpec) -> Tensor:
    try:
        with path.open("rb") as f:
            raw = f.read()
        img = decode_image(torch.frombuffer(bytearray(raw), dtype=torch.uint8), mode=ImageReadMode.UNCHANGED)
        img = to_uint8(img)  # a 16-bit PNG
    except (RuntimeError, ValueError, OSError) as e:
        raise DataError(
            f"cannot decode image {path} ({e}): the file is corrupted, replace or delete it"
        ) from e
    if tuple(img.shape) != IMAGE_SHAPE:
        shape = "x".join(map(str, img.shape))
        raise DataError(
            f"image {path} has shape {shape} (CxHxW), {spec.name} needs 3x32x32 RGB: convert or remove it"
        )
    return img
