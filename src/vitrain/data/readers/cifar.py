"""Find CIFAR-10 or CIFAR-100 on disk (torchvision's python pickles, class folders or an archive of either),
decode it once into a uint8 tensor file in the cache, and load that file on every later run.

Decoding is slow and the same every run, so it happens once per source; the readers of each layout are
`cifar_pickles` and `cifar_folders`, the data sets' specs are in `cifar_spec`."""

from __future__ import annotations

import logging
import os
import shutil
import socket
from pathlib import Path

import torch

from vitrain.data.readers.cache import CACHE_FORMAT, digest, is_archive, stat_key, unpack_archive
from vitrain.data.readers.cifar_folders import decode_folders, folder_files
from vitrain.data.readers.cifar_pickles import decode_batches
from vitrain.data.readers.cifar_spec import CIFAR10, CifarSpec, Decoded, Layout
from vitrain.errors import DataError
from vitrain.utils.atomic import write_atomic

log = logging.getLogger(__name__)

DOWNLOAD_TIMEOUT_S = 60.0


def load_cifar10(
    data_dir: str | os.PathLike,
    cache_dir: str | os.PathLike,
    download: bool = False,
    decode_workers: int | None = None,
) -> Decoded:
    """CIFAR-10 (see `load_cifar`)."""
    return load_cifar(data_dir, cache_dir, CIFAR10, download=download, decode_workers=decode_workers)


def load_cifar(
    data_dir: str | os.PathLike,
    cache_dir: str | os.PathLike,
    spec: CifarSpec,
    download: bool = False,
    decode_workers: int | None = None,
) -> Decoded:
    """Return the data set from the decoded cache, filling the cache (download, unpack, decode) on a miss."""
    src = Path(data_dir).expanduser().absolute()
    cache = Path(cache_dir).expanduser().absolute() / spec.key
    if is_archive(src):
        if not src.is_file():
            raise DataError(f"{spec.name} archive {src} not found: {spec.layout_hint}")
        key = digest(f"archive|{src}|{stat_key(src)}")
        cached = _load_cached(cache / f"decoded-{key}.pt")
        if cached is not None:
            return cached
        layout = find_layout(unpack_archive(src, cache / "unpacked"), spec)
        if layout is None:
            raise DataError(f"archive {src} holds no {spec.name} layout: {spec.layout_hint}")
        return _decode_and_cache(layout, cache / f"decoded-{key}.pt", spec, decode_workers)

    layout = find_layout(src, spec) if src.is_dir() else None
    if layout is None and src.is_dir():
        archives = [p for p in sorted(src.iterdir()) if is_archive(p) and p.is_file()]
        if len(archives) == 1:
            return load_cifar(archives[0], cache_dir, spec, download=False, decode_workers=decode_workers)
    if layout is None and download:
        download_cifar(src, spec)
        layout = find_layout(src, spec)
    if layout is None:
        empty = src.is_dir() and not any(src.iterdir())
        what = "not found at" if not src.exists() or empty else "layout not recognised in"
        raise DataError(f"{spec.name} {what} {src}: {spec.layout_hint}")
    files = _source_files(layout, spec)
    listing = "\n".join(f"{p.relative_to(layout.root)}|{stat_key(p)}" for p in files)
    key = digest(f"{layout.kind}|{layout.root}|{listing}")
    cached = _load_cached(cache / f"decoded-{key}.pt")
    if cached is not None:
        return cached
    return _decode_and_cache(layout, cache / f"decoded-{key}.pt", spec, decode_workers)


def find_layout(root: Path, spec: CifarSpec = CIFAR10) -> Layout | None:
    """Detect the layout in `root`, in a `cifar-10-batches-py` (`cifar-100-python`) child, or in its only
    sub-folder (an unpacked archive). Batch files are files; class-folder splits are folders (CIFAR-100's
    `train` and `test` are both)."""
    for depth in range(2):
        if any((root / name).is_file() for name in (*spec.train_files, spec.test_file)):
            return Layout("batches", root)
        if (root / spec.batches_dir).is_dir():
            return Layout("batches", root / spec.batches_dir)
        if (root / "train").is_dir() or (root / "test").is_dir():
            return Layout("folders", root)
        subdirs = (
            [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")] if depth == 0 else []
        )
        if len(subdirs) != 1:
            return None
        root = subdirs[0]
    return None


def download_cifar(root: Path, spec: CifarSpec = CIFAR10) -> None:
    """Fetch the official python batches with torchvision; a network failure becomes a DataError."""
    import torchvision.datasets

    log.info("downloading %s into %s", spec.name, root)
    made = not root.exists()  # a failed download leaves no folder behind that it created
    old_timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)  # torchvision's urlopen has no timeout of its own
    try:
        getattr(torchvision.datasets, spec.torchvision_class)(str(root), train=True, download=True)
    except Exception as e:
        why = " ".join(f"{type(e).__name__}: {e}".split())  # one line, whatever urllib put in it
        if made:
            shutil.rmtree(root, ignore_errors=True)
        raise DataError(
            f"downloading {spec.name} into {root} failed ({why}): without internet, copy "
            f"{spec.archive} or an unpacked {spec.batches_dir} folder there (or point datamodule.data_dir "
            "at a local copy) and set datamodule.download=false"
        ) from e
    finally:
        socket.setdefaulttimeout(old_timeout)


def decode_layout(layout: Layout, decode_workers: int | None = None, spec: CifarSpec = CIFAR10) -> Decoded:
    """Decode a found layout into memory (no cache involved)."""
    if layout.kind == "batches":
        return decode_batches(layout.root, spec)
    return decode_folders(layout.root, decode_workers, spec)


# --- cache ----------------------------------------------------------------------------------------


def _source_files(layout: Layout, spec: CifarSpec) -> list[Path]:
    if layout.kind == "batches":
        names = (*spec.train_files, spec.test_file, spec.meta_file)
        return [p for p in (layout.root / n for n in names) if p.exists()]
    return [p for split in folder_files(layout.root, spec).values() for group in split for p in group]


def _decode_and_cache(layout: Layout, target: Path, spec: CifarSpec, decode_workers: int | None) -> Decoded:
    log.info("decoding %s from %s into %s (first run only)", spec.name, layout.root, target)
    data = decode_layout(layout, decode_workers, spec)
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(target, lambda f: torch.save({**data.__dict__, "format": CACHE_FORMAT}, f))
    return data


def _load_cached(path: Path) -> Decoded | None:
    if not path.is_file():
        return None
    try:
        d = torch.load(path, map_location="cpu", weights_only=True)
        if d.get("format") != CACHE_FORMAT:
            return None
        return Decoded(d["train_x"], d["train_y"], d["test_x"], d["test_y"], list(d["classes"]))
    except Exception as e:  # a damaged cache is rebuilt, not fatal
        log.warning("ignoring unreadable cache file %s (%s)", path, e)
        return None
