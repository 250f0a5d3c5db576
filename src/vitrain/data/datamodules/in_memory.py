"""The in-memory datamodule: a data set decoded once into uint8 [N,3,H,W] tensors, batches as tensor slices
augmented on the training device. CIFAR-10/100 (datamodules/cifar.py) are its subclasses; an image folder
held in memory (`datamodule.in_memory`) takes the same loaders and device transform from the base."""

from __future__ import annotations

from vitrain.data.augment import BatchTransform
from vitrain.data.datamodules.base import ImageDataModule, Splits, check_ints
from vitrain.data.loaders import TensorImageDataset
from vitrain.data.readers.cifar_spec import Decoded
from vitrain.data.sampling import split_indices


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
