"""Tiny CIFAR-10-like datasets in both on-disk layouts, for tests.

Every image is one flat colour that encodes its label and index, so a test can check that decoding,
labelling and splitting kept each image with its label: red = label_value(label), green = index % 251.
"""

from __future__ import annotations

import pickle
import random
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision.io import encode_jpeg, encode_png

CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def label_value(label: int) -> int:
    """Red channel of every image of `label` (far apart so JPEG rounding cannot blur two labels together)."""
    return 10 + 24 * label


def label_of(images: torch.Tensor) -> torch.Tensor:
    """Recover labels from a uint8 [N,3,H,W] batch made here."""
    red = images[:, 0].float().mean(dim=(1, 2))
    return ((red - 10) / 24).round().long()


def pattern_image(label: int, index: int, size: int = 32, channels: int = 3) -> torch.Tensor:
    """A flat uint8 [channels,size,size] image."""
    img = torch.empty(channels, size, size, dtype=torch.uint8)
    colour = (label_value(label), index % 251, 128, 255)
    for c in range(channels):
        img[c] = colour[c]
    return img


def make_class_folders(
    root: Path,
    n_per_class_train: int,
    n_per_class_test: int,
    ext: str = "png",
    classes: Sequence[str] = CLASSES,
    size: int = 32,
) -> Path:
    """Write root/{train,test}/<class>/NNNN.<ext> and return root."""
    root = Path(root)
    for split, n in (("train", n_per_class_train), ("test", n_per_class_test)):
        for label, cls in enumerate(classes):
            d = root / split / cls
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                img = pattern_image(label, i, size=size)
                data = encode_png(img) if ext == "png" else encode_jpeg(img, quality=95)
                (d / f"{i:04d}.{ext}").write_bytes(data.numpy().tobytes())
    return root


def make_python_batches(
    root: Path, n_per_batch: int = 20, n_test: int = 20, classes: Sequence[str] = CLASSES
) -> Path:
    """Write root/cifar-10-batches-py in the official pickle format (5 train batches, test_batch, batches.meta)."""
    out = Path(root) / "cifar-10-batches-py"
    out.mkdir(parents=True, exist_ok=True)

    def batch(n: int, offset: int) -> dict:
        labels = [(offset + i) % len(classes) for i in range(n)]
        data = torch.stack([pattern_image(y, offset + i) for i, y in enumerate(labels)]).reshape(n, -1)
        return {b"batch_label": b"synthetic", b"labels": labels, b"data": data.numpy().astype(np.uint8)}

    for b in range(5):
        _pickle(out / f"data_batch_{b + 1}", batch(n_per_batch, b * n_per_batch))
    _pickle(out / "test_batch", batch(n_test, 0))
    _pickle(out / "batches.meta", {b"label_names": [c.encode() for c in classes], b"num_vis": 3072})
    return out


def make_targz(src_dir: Path, out_path: Path, arcname: str | None = None) -> Path:
    """Pack src_dir as out_path (gzip) with its content under `arcname` ("." for the archive's top level)."""
    out_path = Path(out_path)
    with tarfile.open(out_path, "w:gz") as tf:
        tf.add(src_dir, arcname=arcname if arcname is not None else Path(src_dir).name)
    return out_path


def _pickle(path: Path, obj: dict) -> None:
    with path.open("wb") as f:
        pickle.dump(obj, f, protocol=2)


@dataclass(frozen=True)
class PhotoFolder:
    """What `make_photo_folder` wrote: the tree, its classes in label order and the counts a run should see."""

    root: Path
    classes: tuple[str, ...]
    n_train: int  # readable training images (the corrupt file not counted)
    n_val: int
    corrupt: Path


def make_photo_folder(
    root: Path, seed: int, n_train: int = 4, n_val: int = 1, min_classes: int = 3, max_classes: int = 17
) -> PhotoFolder:
    """An ImageNet-layout tree, root/{train,val}/<wnid>/, with a class count drawn from
    [min_classes, max_classes] by `seed`: JPEGs of random sizes (24..72 px a side), plus in train a grayscale
    JPEG, an RGBA PNG and one corrupt file (a JPEG header and nothing else)."""
    rng = random.Random(seed)
    count = rng.randint(min_classes, max_classes)
    # ImageNet-like folder names (n + 8 digits); sorted, since labels follow the sorted folder names
    classes = tuple(sorted({f"n{rng.randrange(10**8):08d}" for _ in range(count * 2)})[:count])
    root = Path(root)
    for split, n in (("train", n_train), ("val", n_val)):
        for label, cls in enumerate(classes):
            d = root / split / cls
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                h, w = rng.randint(24, 72), rng.randint(24, 72)
                # a flat colour per class (up to 17: pattern_image's label colours stop at 10)
                img = torch.tensor([15 * label, (37 * i) % 256, (53 * label) % 256], dtype=torch.uint8)
                img = img.view(3, 1, 1).expand(3, h, w).contiguous()
                (d / f"{i:03d}.JPEG").write_bytes(encode_jpeg(img, quality=90).numpy().tobytes())
    train = root / "train"
    gray = pattern_image(0, 200, size=40)[:1]
    (train / classes[0] / "gray.jpg").write_bytes(encode_jpeg(gray).numpy().tobytes())
    rgba = pattern_image(1, 201, size=36, channels=4).permute(1, 2, 0).contiguous().numpy()
    Image.fromarray(rgba, mode="RGBA").save(train / classes[1] / "rgba.png")
    corrupt = train / classes[2] / "corrupt.jpg"
    corrupt.write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    return PhotoFolder(root, classes, count * n_train + 2, count * n_val, corrupt)


CIFAR100_NAMES = tuple(f"fine{i:03d}" for i in range(100))  # sorted, as CIFAR-100's own names are


def cifar100_image(label: int, index: int) -> torch.Tensor:
    """A flat uint8 [3,32,32] image: red = 20 + 2 * label (0..99 stay apart), green = index % 251."""
    img = torch.empty(3, 32, 32, dtype=torch.uint8)
    for c, v in enumerate((20 + 2 * label, index % 251, 128)):
        img[c] = v
    return img


def make_cifar100_python(root: Path, n_train_per_class: int = 2, n_test_per_class: int = 1) -> Path:
    """Write root/cifar-100-python as torchvision reads it: `train` and `test` pickles with b'data' and
    b'fine_labels' (+ b'coarse_labels'), and `meta` with b'fine_label_names'. Labels interleave classes."""
    out = Path(root) / "cifar-100-python"
    out.mkdir(parents=True, exist_ok=True)
    for name, per_class in (("train", n_train_per_class), ("test", n_test_per_class)):
        labels = [i % 100 for i in range(100 * per_class)]
        data = torch.stack([cifar100_image(y, i) for i, y in enumerate(labels)]).reshape(len(labels), -1)
        _pickle(
            out / name,
            {
                b"filenames": [f"{i}.png".encode() for i in range(len(labels))],
                b"batch_label": name.encode(),
                b"fine_labels": labels,
                b"coarse_labels": [y // 5 for y in labels],
                b"data": data.numpy().astype(np.uint8),
            },
        )
    _pickle(
        out / "meta",
        {
            b"fine_label_names": [n.encode() for n in CIFAR100_NAMES],
            b"coarse_label_names": [f"coarse{i:02d}".encode() for i in range(20)],
        },
    )
    return out


def make_noise_folder(
    root: Path, seed: int, classes: Sequence[str] = ("ant", "bee", "cat"), n_train: int = 8, n_val: int = 2
) -> Path:
    """root/{train,val}/<class>/ of random-noise images of mixed sizes (20..48 px a side; PNG and JPEG in
    turn): unlike flat colours, every random crop, flip, auto-augment op and erasure changes the pixels, so a
    test sees an augmentation that differs."""
    rng = np.random.default_rng(seed)
    root = Path(root)
    for split, n in (("train", n_train), ("val", n_val)):
        for cls in classes:
            d = root / split / cls
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                h, w = (int(v) for v in rng.integers(20, 49, 2))
                img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
                img.save(d / f"{i:03d}.{('png', 'jpg')[i % 2]}")
    return root
