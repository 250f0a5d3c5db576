"""Find CIFAR-10 or CIFAR-100 on disk (torchvision's python pickles, class folders or an archive of either),
decode it once into a uint8 tensor file in the cache, and load that file on every later run.

The two data sets differ only in file names and pickle keys (`CifarSpec`); everything else is shared."""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import shutil
import socket
import tarfile
import tempfile
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torchvision.io import ImageReadMode, decode_image

from vitrain.errors import DataError
from vitrain.utils.atomic import write_atomic

log = logging.getLogger(__name__)

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
IMAGE_SHAPE = (3, 32, 32)
# bump when the decoded file's content changes, so old caches are not mistaken for new ones
CACHE_FORMAT = 1
DOWNLOAD_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class CifarSpec:
    """What tells one CIFAR data set's python format from another's (torchvision's `CIFAR10`/`CIFAR100`)."""

    name: str  # in messages
    key: str  # cache sub-folder
    batches_dir: str  # the folder the official archive unpacks to
    train_files: tuple[str, ...]
    test_file: str
    meta_file: str
    label_key: bytes  # labels in a batch file
    names_key: bytes  # class names in the meta file
    archive: str  # the official archive's name, for messages
    torchvision_class: str  # in torchvision.datasets, for download=true
    #: class names when the meta file is absent (None: the meta file is required)
    classes: tuple[str, ...] | None = None

    @property
    def layout_hint(self) -> str:
        return (
            f"point datamodule.data_dir at a {self.batches_dir} folder, a train/<class>/ + test/<class>/ "
            "folder tree or a .tar.gz of either, or set datamodule.download=true"
        )


CIFAR10 = CifarSpec(
    name="CIFAR-10",
    key="cifar10",
    batches_dir="cifar-10-batches-py",
    train_files=tuple(f"data_batch_{i}" for i in range(1, 6)),
    test_file="test_batch",
    meta_file="batches.meta",
    label_key=b"labels",
    names_key=b"label_names",
    archive="cifar-10-python.tar.gz",
    torchvision_class="CIFAR10",
    classes=CIFAR10_CLASSES,
)
# the 100 fine classes (the 20 coarse superclasses are not used); torchvision's CIFAR100 reads the same keys
CIFAR100 = CifarSpec(
    name="CIFAR-100",
    key="cifar100",
    batches_dir="cifar-100-python",
    train_files=("train",),
    test_file="test",
    meta_file="meta",
    label_key=b"fine_labels",
    names_key=b"fine_label_names",
    archive="cifar-100-python.tar.gz",
    torchvision_class="CIFAR100",
)


@dataclass(frozen=True)
class Layout:
    """Where the data sits: `kind` is "batches" (official python pickles) or "folders" (train/<class>/...)."""

    kind: str
    root: Path


@dataclass(frozen=True)
class Decoded:
    """The whole data set as uint8 [N,3,32,32] images and int64 labels."""

    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor
    classes: list[str]


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
    if _is_archive(src):
        if not src.is_file():
            raise DataError(f"{spec.name} archive {src} not found: {spec.layout_hint}")
        key = _digest(f"archive|{src}|{_stat_key(src)}")
        cached = _load_cached(cache / f"decoded-{key}.pt")
        if cached is not None:
            return cached
        layout = find_layout(unpack_archive(src, cache / "unpacked"), spec)
        if layout is None:
            raise DataError(f"archive {src} holds no {spec.name} layout: {spec.layout_hint}")
        return _decode_and_cache(layout, cache / f"decoded-{key}.pt", spec, decode_workers)

    layout = find_layout(src, spec) if src.is_dir() else None
    if layout is None and src.is_dir():
        archives = [p for p in sorted(src.iterdir()) if _is_archive(p) and p.is_file()]
        if len(archives) == 1:
            return load_cifar(archives[0], cache_dir, spec, download=False, decode_workers=decode_workers)
    if layout is None and download:
        download_cifar(src, spec)
        layout = find_layout(src, spec)
    if layout is None:
        what = "not found at" if not src.exists() else "layout not recognised in"
        raise DataError(f"{spec.name} {what} {src}: {spec.layout_hint}")
    files = _source_files(layout, spec)
    listing = "\n".join(f"{p.relative_to(layout.root)}|{_stat_key(p)}" for p in files)
    key = _digest(f"{layout.kind}|{layout.root}|{listing}")
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


def unpack_archive(archive: Path, unpack_root: Path) -> Path:
    """Unpack once into a folder keyed by the archive's path, size and mtime; a half-done unpack never counts."""
    key = _digest(f"{archive}|{_stat_key(archive)}")
    name = archive.name
    for suffix in ARCHIVE_SUFFIXES:
        name = name.removesuffix(suffix)
    target = unpack_root / f"{name}-{key}"
    if target.is_dir():
        return target
    unpack_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=unpack_root))
    log.info("unpacking %s into %s (first run only)", archive, target)
    try:
        with tarfile.open(archive) as tf:
            tf.extractall(tmp, filter="data")
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(
            f"cannot unpack {archive} ({type(e).__name__}: {str(e).splitlines()[0].rstrip(':')}): "
            "the archive is truncated or corrupted, copy or download it again"
        ) from e
    try:
        tmp.rename(target)
    except OSError:  # another process finished the same unpack first
        shutil.rmtree(tmp, ignore_errors=True)
        if not target.is_dir():
            raise
    return target


def download_cifar(root: Path, spec: CifarSpec = CIFAR10) -> None:
    """Fetch the official python batches with torchvision; a network failure becomes a DataError."""
    import torchvision.datasets

    log.info("downloading %s into %s", spec.name, root)
    old_timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)  # torchvision's urlopen has no timeout of its own
    try:
        getattr(torchvision.datasets, spec.torchvision_class)(str(root), train=True, download=True)
    except Exception as e:
        why = " ".join(f"{type(e).__name__}: {e}".split())  # one line, whatever urllib put in it
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
        return _decode_batches(layout.root, spec)
    return _decode_folders(layout.root, decode_workers, spec)


# --- python batches -------------------------------------------------------------------------------


def _decode_batches(root: Path, spec: CifarSpec) -> Decoded:
    meta_path = root / spec.meta_file
    if meta_path.is_file():
        names = _unpickle(meta_path, spec).get(spec.names_key)
        if not isinstance(names, list) or not names:
            raise DataError(
                f"{meta_path} has no {spec.names_key.decode()}: copy or download the {spec.batches_dir} folder again"
            )
        classes = [n.decode() if isinstance(n, bytes) else str(n) for n in names]
    elif spec.classes is not None:
        classes = list(spec.classes)
    else:
        raise DataError(
            f"{meta_path} is missing (it holds the class names): copy the complete {spec.batches_dir} folder"
        )
    parts = [_read_batch(root / name, len(classes), spec) for name in spec.train_files]
    test_x, test_y = _read_batch(root / spec.test_file, len(classes), spec)
    return Decoded(
        train_x=torch.cat([x for x, _ in parts]),
        train_y=torch.cat([y for _, y in parts]),
        test_x=test_x,
        test_y=test_y,
        classes=classes,
    )


def _read_batch(path: Path, num_classes: int, spec: CifarSpec) -> tuple[Tensor, Tensor]:
    if not path.is_file():
        raise DataError(
            f"{spec.name} batch file {path} is missing: copy or download the complete {spec.batches_dir} folder"
        )
    batch = _unpickle(path, spec)
    data, labels = batch.get(b"data"), batch.get(spec.label_key)
    n = len(labels) if isinstance(labels, list) else -1
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.shape != (n, 3 * 32 * 32):
        raise DataError(
            f"{path} is not a {spec.name} batch (want b'data' uint8 [N,3072] and N {spec.label_key!r}): "
            "copy or download it again"
        )
    y = torch.tensor(labels, dtype=torch.int64)
    if n and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise DataError(f"{path} has labels outside 0..{num_classes - 1}: copy or download it again")
    return torch.from_numpy(np.ascontiguousarray(data)).view(n, *IMAGE_SHAPE).clone(), y


def _unpickle(path: Path, spec: CifarSpec) -> dict:
    try:
        with path.open("rb") as f:
            obj = pickle.load(f, encoding="bytes")
    except Exception as e:
        raise DataError(
            f"cannot read {path} ({type(e).__name__}: {e}): the file is corrupted, copy or download it again"
        ) from e
    if not isinstance(obj, dict):
        raise DataError(f"{path} does not hold a {spec.name} dict: copy or download it again")
    return obj


# --- class folders --------------------------------------------------------------------------------


def _class_dirs(split_dir: Path) -> list[str]:
    return sorted(p.name for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith("."))


def _folder_files(root: Path, spec: CifarSpec) -> dict[str, list[list[Path]]]:
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


def _decode_folders(root: Path, decode_workers: int | None, spec: CifarSpec) -> Decoded:
    files = _folder_files(root, spec)
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


# --- cache ----------------------------------------------------------------------------------------


def _source_files(layout: Layout, spec: CifarSpec) -> list[Path]:
    if layout.kind == "batches":
        names = (*spec.train_files, spec.test_file, spec.meta_file)
        return [p for p in (layout.root / n for n in names) if p.exists()]
    return [p for split in _folder_files(layout.root, spec).values() for group in split for p in group]


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


def _is_archive(path: Path) -> bool:
    return path.name.lower().endswith(ARCHIVE_SUFFIXES)


def _stat_key(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size}|{st.st_mtime_ns}"


def _digest(text: str) -> str:
    return hashlib.sha256(f"v{CACHE_FORMAT}|{text}".encode()).hexdigest()[:16]
