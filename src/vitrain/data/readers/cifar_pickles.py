"""Decode CIFAR in torchvision's python format (pickled batch files), checking every file it reads.

The official download and most copies come in this layout; a damaged or foreign file becomes a DataError
that says which file and what to do, not a pickle traceback.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from vitrain.data.readers.cifar_spec import IMAGE_SHAPE, CifarSpec, Decoded
from vitrain.errors import DataError


def decode_batches(root: Path, spec: CifarSpec) -> Decoded:
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
