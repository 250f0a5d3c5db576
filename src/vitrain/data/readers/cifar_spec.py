"""What CIFAR-10 and CIFAR-100 are: the spec that tells one's files from the other's, and the decoded form.

The two data sets differ only in file names and pickle keys (`CifarSpec`); the readers of each layout and
the loader with its cache share everything else, so they share these types.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
IMAGE_SHAPE = (3, 32, 32)


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
            "folder tree or a .tar.gz/.zip of either, or set datamodule.download=true"
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
