"""Which process sees which sample, in which order: the split of data and batch across processes.

Everything here is a function of seeds and the epoch alone, never of global RNG state, so every rank and
every restart agrees: the same validation split, the same shuffled order, the same per-sample augmentation.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch import Tensor
from torch.utils.data import Dataset, DistributedSampler, Sampler, SequentialSampler, get_worker_info

from vitrain.errors import DataError


class TrainSampler(DistributedSampler):
    """The training order: a DistributedSampler (shuffled by (seed, epoch), equal shards) that reads its epoch
    and where to start when the first index is asked for, not when `iter()` is called (Lightning creates the
    loader's iterator before it restores the epoch from a checkpoint), and can start a pass part-way
    (`start_at`): a resumed epoch skips the indices already trained on without reading a sample.

    `tag_epoch`: yield `(epoch, index)`, for a dataset that augments per sample and seeds its random ops from
    (seed, epoch, index) (`sample_seed`), so an image gets the same augmentation whatever the rank, the
    worker or a resume, and worker processes need no seeding of their own."""

    def __init__(self, *args: Any, tag_epoch: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tag_epoch = tag_epoch
        self._start = 0

    def start_at(self, position: int) -> None:
        """The next pass begins at this process's `position`-th index of the epoch (once)."""
        self._start = position

    def __iter__(self) -> Iterator[int | tuple[int, int]]:  # type: ignore[override]
        epoch, start = self.epoch, self._start
        self._start = 0
        indices = itertools.islice(super().__iter__(), start, None)
        if self.tag_epoch:
            yield from ((epoch, i) for i in indices)
        else:
            yield from indices


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for one sample of one epoch (hash, not a sum: (1, 2) and (2, 1) must differ)."""
    digest = hashlib.blake2b(f"{seed}|{epoch}|{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def batch_seed(seed: int, epoch: int, rank: int, batch: int) -> int:
    """A 63-bit seed for one process's `batch`-th training batch of an epoch, which seeds that batch's
    on-device augmentation (`augment.BatchTransform`): the batch is then the same inline, prepared ahead by a
    thread (`datamodule.augment_ahead`) or after a resume, whatever else draws from the global generators."""
    digest = hashlib.blake2b(f"{seed}|{epoch}|batch {rank}:{batch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@contextmanager
def seeded_sample(seed: int) -> Iterator[None]:
    """Seed every RNG a per-sample transform may draw from (timm uses `random`, torchvision uses torch's CPU
    generator, some transforms numpy's global one) for one sample's transform.

    In a loader worker these generators are the worker's own and are left as seeded. In the training process
    (num_workers=0) the caller's states are put back afterwards: otherwise every sample would re-seed the
    generators that drop-path and on-device augmentation draw from, and a run's training randomness would
    depend on num_workers. So 0 and N workers train alike, bitwise.

    `torch.default_generator` directly: `torch.manual_seed` also queues a lazy seed for every accelerator
    and records the call's stack trace to do it, ~0.2 ms an image here, 5-10 % of a 224 px
    decode-and-transform (saving and restoring the three states costs ~20 us)."""
    saved = None
    if get_worker_info() is None:
        saved = random.getstate(), torch.default_generator.get_state(), np.random.get_state()
    random.seed(seed)
    torch.default_generator.manual_seed(seed)
    np.random.seed(seed % 2**32)
    try:
        yield
    finally:
        if saved is not None:
            random.setstate(saved[0])
            torch.default_generator.set_state(saved[1])
            np.random.set_state(saved[2])


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

    Training always uses a DistributedSampler (`TrainSampler`), also on one process: its order is a function
    of (seed, epoch) alone, so a resumed run sees exactly the batches the uninterrupted run saw, at an epoch
    boundary or, starting past the batches already trained on, in the middle of one.
    """
    if train:
        return TrainSampler(
            dataset,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=True,
            seed=seed,
            drop_last=True,
            tag_epoch=tag_epoch,
        )
    if num_replicas > 1:
        return UnrepeatedDistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)
    return SequentialSampler(dataset)


#: how a validation split is carved from train (`datamodule.val_split`): each class in proportion, or a random
#: sample of all images (the carve of checkpoints written before 2026-12-01, which eval.py then repeats)
VAL_SPLITS = ("stratified", "random")


def split_indices(
    labels: Sequence[int] | Tensor, val_size: int | float, seed: int, method: str = "stratified"
) -> tuple[Tensor, Tensor]:
    """(train, val) indices carved by `method`; the validation indices in a random order (a prefix of them,
    `trainer.limit_val_batches`, is a fair sample)."""
    if method == "random":
        return _random_carve(len(labels), val_size, seed, "datamodule.val_size")
    train, val = stratified_split(labels, val_size, seed)
    order = torch.randperm(len(val), generator=torch.Generator().manual_seed(seed))
    return torch.tensor(train, dtype=torch.long), torch.tensor(val, dtype=torch.long)[order]


def carve(
    labels: Sequence[int], val_size: int | float, seed: int, method: str, key: str
) -> tuple[list[int], list[int]]:
    """(train, val) indices, each ascending, carved by `method` (`VAL_SPLITS`)."""
    if method == "random":
        train, val = _random_carve(len(labels), val_size, seed, key)
        return sorted(train.tolist()), sorted(val.tolist())
    return stratified_split(labels, val_size, seed, key)


def _random_carve(n: int, val_size: int | float, seed: int, key: str) -> tuple[Tensor, Tensor]:
    """(train, val) as carved before 2026-12-01: the tail and the head of a seeded permutation."""
    count = _val_count(val_size, n, n - 1, key)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return perm[count:], perm[:count]


def _val_count(
    val_size: int | float, n: int, room: int, key: str = "datamodule.val_size", detail: str = ""
) -> int:
    """The images `val_size` asks for (a fraction of `n` when below 1, rounded, and one image where that is
    none: the folder default of 5 % of a few photos; scikit-learn's `train_test_split` rounds a fraction up),
    at least 1 and at most `room`."""
    fraction = isinstance(val_size, float) and 0 < val_size < 1
    count = max(1, round(val_size * n)) if fraction else int(val_size)
    if not 0 < count <= room:
        raise DataError(
            f"{key}={val_size} must be between 1 and {room} images (the training set has {n} images{detail})"
        )
    return count


def stratified_split(
    labels: Sequence[int] | Tensor, val_size: int | float, seed: int, key: str = "datamodule.val_size"
) -> tuple[list[int], list[int]]:
    """(train, val) indices, each ascending: `val_size` images (a count, or a fraction of all when below 1)
    for validation, every class in proportion to its images (largest remainders), each keeping at least one
    for training; which of a class's images, by a private generator: every rank and every restart carves
    the same split. A random carve instead leaves a small class of a photo folder without validation images
    at 5 % (a class of 20: one time in three), and its accuracy unmeasured. `key`: the setting, for errors."""
    values = labels.tolist() if isinstance(labels, Tensor) else [int(v) for v in labels]
    n = len(values)
    by_class: dict[int, list[int]] = {}
    for index, label in enumerate(values):
        by_class.setdefault(label, []).append(index)
    detail = f" in {len(by_class)} classes, each keeping one for training"
    count = _val_count(val_size, n, n - len(by_class), key, detail)
    classes = sorted(by_class)
    quota = {c: count * len(by_class[c]) / n for c in classes}
    taken = {c: min(math.floor(quota[c]), len(by_class[c]) - 1) for c in classes}
    # the images left to place go to the classes with the largest remainders (ties: the smaller label), then,
    # past the classes at their cap, to those with room, in order (`_val_count` saw that there is enough)
    left = count - sum(taken.values())
    for c in sorted(classes, key=lambda c: (taken[c] - quota[c], c)):
        if left and taken[c] < len(by_class[c]) - 1:
            taken[c], left = taken[c] + 1, left - 1
    for c in classes:
        more = min(left, len(by_class[c]) - 1 - taken[c])
        taken[c], left = taken[c] + more, left - more
    generator = torch.Generator().manual_seed(seed)
    val: list[int] = []
    for c in classes:
        members = by_class[c]
        picked = torch.randperm(len(members), generator=generator)[: taken[c]].tolist()
        val.extend(members[i] for i in picked)
    chosen = set(val)
    return [i for i in range(n) if i not in chosen], sorted(val)


def partial_pass_note(
    split: str, labels: Sequence[int] | Tensor | None, limit: int | float | None, batch: int, world: int
) -> str | None:
    """One line when `trainer.limit_<split>_batches` scores a prefix of an evaluation split that holds fewer
    classes than the split: Lightning takes the first batches, and evaluation visits a split in its stored
    order (a test split, or a folder's val/, sorted by class), so `limit_test_batches=2` of CIFAR scores 64
    airplanes. None when the whole split is scored, the split is not sorted by class, the prefix has every
    class, or the labels are unknown."""
    if labels is None or limit is None or batch < 1:
        return None
    n, world = len(labels), max(world, 1)
    if isinstance(limit, float):  # Lightning: that fraction of each process's batches, rounded down
        per_process = math.ceil(n / world)
        limit_batches = n if limit >= 1.0 else int(limit * math.ceil(per_process / batch))
    else:
        limit_batches = int(limit)
    scored = min(n, limit_batches * batch * world)
    if scored >= n or scored <= 0:
        return None
    values = labels.tolist() if isinstance(labels, Tensor) else list(labels)
    if any(a > b for a, b in itertools.pairwise(values)):
        return None  # not sorted by class (a carved validation split is in random order): a fair sample
    seen, every = len(set(values[:scored])), len(set(values))
    if seen >= every:
        return None
    return (
        f"trainer.limit_{split}_batches={limit} scores the first {scored} of the {n} {split} images, which hold "
        f"{seen} of its {every} classes (the split is stored sorted by class): its {split} figures are not the "
        "split's; leave the limit null for the whole split"
    )
