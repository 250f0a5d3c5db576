"""The training loader that resumes (in memory and from disk), and in-memory data: a dataset of tensors
that hands out whole batches.

A batch is a tensor slice, not a list of samples to collate, which is what makes in-memory training fast;
and the order is a function of (seed, epoch), so a resumed loader need only skip what was trained on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from vitrain.data.sampling import batch_seed
from vitrain.errors import DataError


class Seeded(NamedTuple):
    """An in-memory training batch's uint8 images with the seed of their random augmentation
    (`sampling.batch_seed`): what the training loader hands on in place of the images, so that the batch is
    augmented alike wherever and whenever that happens (on the training thread, by a thread ahead of it,
    after a resume). Lightning moves it to the device as it moves a tuple."""

    x: Tensor
    seed: int


class ResumableLoader(DataLoader):
    """The training loader of the shared base (in memory and from disk): a resumed epoch continues with the
    next batch the interrupted run had not trained on, from the trainer's restored counters alone.

    The order is a function of (seed, epoch) (`sampling.TrainSampler`) and a sample's augmentation of (seed,
    epoch, index), so a loader needs no state of its own: when the first batch of a pass is asked for, the
    sampler starts past the `batches_done()` batches the restored loop has completed (no sample of them is
    read). Everything happens at that first batch, not at `iter()`: Lightning creates the iterator (when the
    model asks for `estimated_stepping_batches`) before it restores its loop counters and sets the epoch, and
    a worker-process iterator sends indices to its workers as soon as it exists.
    """

    def __init__(
        self,
        *args: Any,
        batches_done: Callable[[], int],
        ahead: Callable[[Iterator], Iterator] | None = None,
        seed_batches: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._batches_done = batches_done
        #: wraps each pass's batches (decoded or augmented ahead of the training thread, data/decode_ahead.py)
        self.ahead = ahead
        #: hand on (Seeded(images, seed), labels): the seed a function of (seed, epoch, rank, batch index)
        self.seed_batches = seed_batches

    def __iter__(self) -> Iterator:
        sampler = self.sampler
        # ours (sampling.TrainSampler) knows (seed, epoch, rank); one Lightning puts in its place does not
        # (`trainer.overfit_batches`): its batches go on plain, augmented on the training thread from the
        # global generators, as those of the loader workers are
        seeded = self.seed_batches and all(hasattr(sampler, a) for a in ("seed", "epoch", "rank"))

        def batches() -> Iterator:
            done = self._batches_done()
            if done:
                sampler.start_at(done * self.batch_size)
            if not seeded:
                yield from DataLoader.__iter__(self)
                return
            # read at the first batch: the restored epoch by now
            seed, epoch, rank = sampler.seed, sampler.epoch, sampler.rank
            for index, (x, y) in enumerate(DataLoader.__iter__(self), start=done):
                yield Seeded(x, batch_seed(seed, epoch, rank, index)), y

        if self.ahead is None or (self.seed_batches and not seeded):
            return batches()
        return self.ahead(batches())


class TensorImageDataset(Dataset):
    """Images and labels held as tensors; `__getitems__` lets the DataLoader slice a whole batch at once.

    On a GPU (`to`) a batch is sliced there: no host copy, pinning or host-to-device copy per step, which the
    training thread otherwise does for every batch (`num_workers=0`), as a hand-written loop with its data on
    the GPU does. Only the batch's indices travel, from pinned memory behind the host's back."""

    def __init__(self, x: Tensor, y: Tensor) -> None:
        self.x, self.y = x, y
        self._copies: dict[torch.device, TensorImageDataset] = {}

    def __len__(self) -> int:
        return len(self.y)

    @property
    def nbytes(self) -> int:
        return self.x.nbytes + self.y.nbytes

    def copied_to(self, device: torch.device) -> bool:
        """Whether `to(device)` has made its copy already."""
        return device in self._copies

    def to(self, device: torch.device) -> TensorImageDataset:
        """This dataset with its tensors on `device` (copied once; later calls return the same copy)."""
        if self.x.device == device:
            return self
        if device not in self._copies:
            self._copies[device] = TensorImageDataset(self.x.to(device), self.y.to(device))
        return self._copies[device]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_copies": {}}  # loader workers get the host tensors only

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i], self.y[i]

    def __getitems__(self, indices: list[int]) -> tuple[Tensor, Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        if self.x.device.type == "cuda":
            idx = idx.pin_memory().to(self.x.device, non_blocking=True)
        # index_select: ~5x faster than x[idx] advanced indexing for a batch of rows on the CPU
        return self.x.index_select(0, idx), self.y.index_select(0, idx)


def passthrough_collate(batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """`__getitems__` already returns a collated batch (module-level so worker processes can pickle it)."""
    return batch


class FileImages(Dataset):
    """Image files to classify (src/predict.py), in the order given: `(image, position)` samples, each image
    as `decode` makes it (path -> uint8 [3,H,W]: the datamodule's `eval_decoder`, the evaluation images' form
    before the device's resize and normalisation)."""

    def __init__(self, paths: list[str], decode: Callable[[str], Tensor]) -> None:
        self.paths, self.decode = paths, decode

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        try:
            return self.decode(self.paths[i]), i
        except DataError:
            raise
        except Exception as e:  # the decoders raise many types; the prediction task checked the files first
            raise DataError(f"cannot decode {self.paths[i]} ({type(e).__name__}: {e})") from None
