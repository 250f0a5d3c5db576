"""In-memory data: a dataset of tensors that hands out whole batches, and the loader that resumes it.

A batch is a tensor slice, not a list of samples to collate, which is what makes in-memory training fast;
and the order is a function of (seed, epoch), so a resumed loader need only skip what was trained on.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset


class ResumableLoader(DataLoader):
    """In-memory data: a DataLoader that skips the batches a mid-epoch checkpoint had already trained on.

    The training order is a function of (seed, epoch) alone and a batch is a tensor slice, so skipping the
    batches the restored loop has completed continues exactly where the interrupted run stopped (bitwise,
    tests/test_resume.py). Worker-process loaders use torchdata's StatefulDataLoader instead.
    """

    def __init__(self, *args: Any, batches_done: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._batches_done = batches_done

    def __iter__(self) -> Iterator:
        iterator = super().__iter__()

        def batches() -> Iterator:
            # decided at the first batch: Lightning creates the iterator before it restores its loop counters
            for _ in range(self._batches_done()):
                next(iterator, None)
            yield from iterator

        return batches()


class TensorImageDataset(Dataset):
    """Images and labels held as tensors; `__getitems__` lets the DataLoader slice a whole batch at once."""

    def __init__(self, x: Tensor, y: Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i], self.y[i]

    def __getitems__(self, indices: list[int]) -> tuple[Tensor, Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        # index_select: ~5x faster than x[idx] advanced indexing for a batch of rows on the CPU
        return self.x.index_select(0, idx), self.y.index_select(0, idx)


def passthrough_collate(batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """`__getitems__` already returns a collated batch (module-level so worker processes can pickle it)."""
    return batch
