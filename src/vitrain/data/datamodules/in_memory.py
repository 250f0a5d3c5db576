"""The in-memory path: a data set decoded once into uint8 [N,3,H,W] tensors (`tensor_splits`), batches as
tensor slices (the base's loaders), augmented on the training device (`device_augmentation`). CIFAR-10/100
(datamodules/cifar.py) are `InMemoryDataModule`s; an image folder held in memory (`datamodule.in_memory`,
datamodules/image_folder.py) takes the same two functions, its decode and memory plan being its own."""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from vitrain.data.augment import BatchTransform, flip_probability
from vitrain.data.datamodules.base import ImageDataModule, Splits, check_ints, check_padding
from vitrain.data.loaders import TensorImageDataset
from vitrain.data.readers.cifar_spec import Decoded
from vitrain.data.sampling import split_indices


def tensor_splits(data: Mapping[str, tuple[Tensor, Tensor]]) -> Splits:
    """Decoded (images uint8 [N,3,H,W], labels) per split as datasets whose batches are tensor slices."""
    return Splits(*(TensorImageDataset(*data[name]) for name in ("train", "val", "test")))


def device_augmentation(
    datamodule: ImageDataModule,
    crop_padding: int,
    hflip: bool | float,
    auto_augment: str | None,
    re_prob: float,
    augment: bool = True,
) -> BatchTransform:
    """The on-device transform of in-memory batches: random crop of the padded image, flip, auto-augment,
    random erasing (training only), then resize and normalise; `augment=false` resizes and normalises only."""
    if not augment:
        return datamodule.batch_transform(crop_padding=0, hflip=False)
    return datamodule.batch_transform(crop_padding, hflip, auto_augment, re_prob)


class InMemoryDataModule(ImageDataModule):
    """A data set decoded once into uint8 [N,3,H,W] tensors: batches are slices, augmented on the device
    (random crop from a zero-padded image, flip), then resized and normalised there."""

    def __init__(
        self,
        *args,
        augment: bool = True,
        crop_padding: int = 4,
        hflip: bool = True,
        auto_augment: str | None = None,
        re_prob: float = 0.0,
        download: bool = False,
        **kwargs,
    ) -> None:
        check_ints(crop_padding=crop_padding)
        check_padding(crop_padding)
        flip_probability(hflip)
        super().__init__(*args, **kwargs)
        self._decoded: Decoded | None = None

    def decode(self) -> Decoded:
        """The whole data set (from the decode cache after the first run)."""
        raise NotImplementedError

    def _data(self) -> Decoded:
        if self._decoded is None:
            self._decoded = self.decode()
        return self._decoded

    def prepare_data(self) -> None:
        """Download / unpack / decode into the cache; Lightning runs this on one process per node."""
        self._data()

    def find_classes(self) -> list[str]:
        return list(self._data().classes)

    def load_splits(self) -> Splits:
        data = self._data()
        self._decoded = None  # the splits below hold what is needed
        hp = self.hparams
        train_idx, val_idx = split_indices(data.train_y, hp.val_size, hp.split_seed, hp.val_split)
        return tensor_splits(
            {
                "train": (data.train_x[train_idx], data.train_y[train_idx]),
                "val": (data.train_x[val_idx], data.train_y[val_idx]),
                "test": (data.test_x, data.test_y),
            }
        )

    def device_transform(self) -> BatchTransform | None:
        hp = self.hparams
        return device_augmentation(self, hp.crop_padding, hp.hflip, hp.auto_augment, hp.re_prob, hp.augment)
