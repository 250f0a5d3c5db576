"""CIFAR-10 and CIFAR-100 as datamodules: uint8 tensors in memory, whole-batch fetches, augmentation on the
training device (the shared base, vitrain/data/base.py, does splits, sampling, loaders and the transform)."""

from __future__ import annotations

from vitrain.data.augment import BatchTransform
from vitrain.data.base import ImageDataModule, Splits, check_ints
from vitrain.data.cifar_spec import CIFAR10, CIFAR10_CLASSES, CIFAR100, CifarSpec, Decoded
from vitrain.data.loaders import TensorImageDataset
from vitrain.data.sampling import split_indices
from vitrain.data.sources import load_cifar

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
# the training set's per-channel statistics, as CIFAR-10's above
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)
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
        return self.batch_transform(hp.crop_padding, hp.hflip, hp.auto_augment, hp.re_prob)

    def device_transform(self) -> BatchTransform | None:
        if not self.hparams.augment:
            return self.batch_transform(crop_padding=0, hflip=False)
        return self.transform


class CIFAR10DataModule(InMemoryDataModule):
    """CIFAR-10 from python batches, class folders or an archive of either; see configs/datamodule/cifar10.yaml."""

    dataset: CifarSpec = CIFAR10
    default_mean = CIFAR10_MEAN
    default_std = CIFAR10_STD
    default_img_size = NATIVE_SIZE

    def decode(self) -> Decoded:
        hp = self.hparams
        return load_cifar(hp.data_dir, hp.cache_dir, self.dataset, download=hp.download)


class CIFAR100DataModule(CIFAR10DataModule):
    """CIFAR-100's 100 fine classes, from torchvision's python format (`cifar-100-python/` train, test, meta),
    class folders or an archive of either; see configs/datamodule/cifar100.yaml."""

    dataset = CIFAR100
    default_mean = CIFAR100_MEAN
    default_std = CIFAR100_STD


__all__ = [
    "CIFAR10_CLASSES",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "CIFAR100_MEAN",
    "CIFAR100_STD",
    "CIFAR10DataModule",
    "CIFAR100DataModule",
    "InMemoryDataModule",
]
