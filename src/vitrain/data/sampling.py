"""Which process sees which sample, in which order: the split of data and batch across processes.

Everything here is a function of seeds and the epoch alone, never of global RNG state, so every rank and
every restart agrees: the same validation split, the same shuffled order, the same per-sample augmentation.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator

import numpy as np
import torch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch import Tensor
from torch.utils.data import Dataset, DistributedSampler, Sampler, SequentialSampler

from vitrain.errors import DataError


class EpochTaggedSampler(DistributedSampler):
    """DistributedSampler that yields `(epoch, index)`: a dataset that augments per sample seeds its random ops
    from (seed, epoch, index), so an image gets the same augmentation whatever the rank, the worker or a
    resume, and worker processes need no seeding of their own (`sample_seed`)."""

    def __iter__(self) -> Iterator[tuple[int, int]]:  # type: ignore[override]
        epoch = self.epoch
        return ((epoch, i) for i in super().__iter__())


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for one sample of one epoch (hash, not a sum: (1, 2) and (2, 1) must differ)."""
    digest = hashlib.blake2b(f"{seed}|{epoch}|{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def seed_sample(seed: int) -> None:
    """Seed every RNG a per-sample transform may draw from (timm uses `random`, torchvision uses torch's CPU
    generator). Called once per image in the loader workers, so `torch.default_generator` directly:
    `torch.manual_seed` also queues a lazy seed for every accelerator and records the call's stack trace to
    do it, ~0.2 ms an image here, 5-10 % of a 224 px decode-and-transform."""
    random.seed(seed)
    torch.default_generator.manual_seed(seed)
    np.random.seed(seed % 2**32)


def per_process_batch(batch_size: int, world_size: int, name: str = "batch_size") -> int:
    """The global batch split across processes; refuse sizes that would silently change the global batch."""
    if batch_size < 1:
        raise DataError(f"datamodule.{name}={batch_size} must be at least 1")
    if batch_size % world_size:
        raise DataError(
            f"datamodule.{name}={batch_size} does not divide across {world_size} processes "
            f"(trainer.devices x trainer.num_nodes): use a multiple of {world_size}"
        )
    return batch_size // world_size


def make_sampler(
    dataset: Dataset, *, train: bool, num_replicas: int, rank: int, seed: int, tag_epoch: bool = False
) -> Sampler:
    """Train: shuffled, equal shards (each sample at most once per epoch over all ranks; the last
    `len % world` samples of a shuffled order wait for another epoch). Eval: every sample exactly once over
    all ranks, no padding; ranks may then differ by one batch, which is safe because the model syncs its
    metrics only at epoch end.

    Training always uses a DistributedSampler, also on one process: its order is a function of (seed, epoch)
    alone, so a run resumed at an epoch boundary sees exactly the batches the uninterrupted run saw.
    """
    if train:
        cls = EpochTaggedSampler if tag_epoch else DistributedSampler
        return cls(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
    if num_replicas > 1:
        return UnrepeatedDistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)
    return SequentialSampler(dataset)


def split_indices(n: int, val_size: int | float, seed: int) -> tuple[Tensor, Tensor]:
    """(train, val) indices from a private generator, so every rank and every restart carves the same split.
    `val_size` is a count, or a fraction of `n` when below 1."""
    count = round(val_size * n) if isinstance(val_size, float) and val_size < 1 else int(val_size)
    if not 0 < count < n:
        raise DataError(
            f"datamodule.val_size={val_size} must be between 1 and {n - 1} images "
            f"(the training set has {n} images)"
        )
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return perm[count:], perm[:count]
