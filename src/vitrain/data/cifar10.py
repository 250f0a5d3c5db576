"""CIFAR-10 as a datamodule: uint8 tensors in memory, whole-batch fetches, augmentation on the training
device (the shared base, vitrain/data/base.py, does splits, sampling and loaders)."""

from __future__ import annotations

from vitrain.data.augment import BatchTransform
from vitrain.data.base import ImageDataModule, Splits, TensorImageDataset, check_ints, split_indices
from vitrain.data.sources import CIFAR10_CLASSES, Decoded, load_cifar10

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
NATIVE_SIZE = 32


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
        train_idx, val_idx = split_indices(len(data.train_y), self.hparams.val_size, self.hparams.split_seed)
        return Splits(
            train=TensorImageDataset(data.train_x[train_idx], data.train_y[train_idx]),
            val=TensorImageDataset(data.train_x[val_idx], data.train_y[val_idx]),
            test=TensorImageDataset(data.test_x, data.test_y),
        )

    @property
    def transform(self) -> BatchTransform:
        hp = self.hparams
        return BatchTransform(
            self.img_size,
            self.mean,
            self.std,
            crop_padding=hp.crop_padding,
            hflip=hp.hflip,
            auto_augment=hp.auto_augment,
            re_prob=float(hp.re_prob),
        )

    def device_transform(self) -> BatchTransform | None:
        if not self.hparams.augment:
            return BatchTransform(self.img_size, self.mean, self.std, crop_padding=0, hflip=False)
        return self.transform


class CIFAR10DataModule(InMemoryDataModule):
    """CIFAR-10 from python batches, class folders or an archive of either; see configs/datamodule/cifar10.yaml."""

    default_mean = CIFAR10_MEAN
    default_std = CIFAR10_STD
    default_img_size = NATIVE_SIZE

    def decode(self) -> Decoded:
        hp = self.hparams
        return load_cifar10(hp.data_dir, hp.cache_dir, download=hp.download)


__all__ = ["CIFAR10_CLASSES", "CIFAR10_MEAN", "CIFAR10_STD", "CIFAR10DataModule", "InMemoryDataModule"]
