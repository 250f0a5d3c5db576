"""CIFAR-10 and CIFAR-100 as datamodules: uint8 tensors in memory, whole-batch fetches, augmentation on the
training device (the in-memory datamodule, datamodules/in_memory.py; the shared base, datamodules/base.py,
does splits, sampling, loaders and the transform). Finding, decoding and caching CIFAR: data/readers/."""

from __future__ import annotations

from vitrain.data.datamodules.in_memory import InMemoryDataModule
from vitrain.data.readers.cifar import load_cifar
from vitrain.data.readers.cifar_spec import CIFAR10, CIFAR10_CLASSES, CIFAR100, CifarSpec, Decoded

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
# the training set's per-channel statistics, as CIFAR-10's above
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)
NATIVE_SIZE = 32


class CIFAR10DataModule(InMemoryDataModule):
    """CIFAR-10 from python batches, class folders or an archive of either; see configs/datamodule/cifar10.yaml."""

    dataset: CifarSpec = CIFAR10
    default_mean = CIFAR10_MEAN
    default_std = CIFAR10_STD
    default_img_size = NATIVE_SIZE

    def decode(self) -> Decoded:
        hp = self.hparams
        return load_cifar(hp.data_dir, hp.cache_dir, self.dataset, download=hp.download)

    def held_size(self) -> int:
        """CIFAR's images are 32x32: a photo is brought to that (shorter side, center crop) for prediction."""
        return NATIVE_SIZE


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
