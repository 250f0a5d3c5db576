"""Your own images: a `train/<class>/` tree with `val/<class>/` and/or `test/<class>/` (the ImageNet layout),
or a .tar/.tar.gz/.zip of one, read from disk per sample.

DataLoader worker processes open, decode (JPEG, PNG, WebP, BMP, GIF, TIFF; any mode converted to RGB) and
transform each image with timm's transforms from the model's data config, each image's random draws seeded
from (seed, epoch, index). Splits, samplers, the per-process batch, exact evaluation and the resumable
training loader (a resumed epoch continues from the trainer's restored counters: bitwise the uninterrupted
run, with any number of workers) come from the shared base, vitrain/data/datamodules/base.py.

Unreadable files are found before training, by PIL reading each file's header and structure without
decoding every pixel (`verify_images`); `bad_images: stop` then names them in one error, `skip` leaves them
out with a warning that counts them. A worker never meets a bad file in the middle of an epoch unless the
check was turned off; then the decode error still names the file.

`in_memory` (auto | true | false) instead decodes a data set that fits a memory budget once into uint8
tensors at a fixed size, trained on like CIFAR-10: tensor slices, augmented on the device (vitrain/data/
in_memory.py decides and decodes; the base holds the in-memory loaders and batch transform).

`decode_device=cuda` (from disk) moves the training decode to the GPU, for when the CPU cores cannot decode
as fast as the GPU trains: workers read each file's bytes and draw its crop and flip from (seed, epoch,
index) and the size in its header (`EncodedFileDataset`); the training process decodes the batch with
nvJPEG and crops, flips and normalises it there (`on_before_batch_transfer`, vitrain/data/gpu_decode.py).
Validation and test keep the workers' timm eval transforms.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

from vitrain.data.augment import BatchTransform, flip_probability
from vitrain.data.datamodules.base import ImageDataModule, Splits, check_ints, check_padding
from vitrain.data.datamodules.in_memory import device_augmentation, tensor_splits
from vitrain.data.decode_ahead import check_depth
from vitrain.data.gpu_decode import (
    GpuDecoder,
    check_augment,
    check_decode_device,
    collate_encoded,
    encoded_sample,
    gpu_decode_device,
)
from vitrain.data.loaders import TensorImageDataset
from vitrain.data.readers import decode as in_memory
from vitrain.data.readers.cache import is_archive, unpack_archive
from vitrain.data.readers.image_folders import Source, carve_val, find_source, find_unreadable, scan
from vitrain.data.sampling import sample_seed, seeded_sample
from vitrain.data.transforms import check_color_jitter, decode_for
from vitrain.errors import DataError

log = logging.getLogger(__name__)


class ImageFileDataset(Dataset):
    """(path, label) pairs decoded on access. Training indices arrive as `(epoch, index)` from the base's
    TrainSampler: the sample's random transform is seeded from (seed, epoch, index), so it is the same
    whatever the rank, the worker or a resume."""

    def __init__(self, files: list[tuple[str, int]], transform: Any, seed: int) -> None:
        self.files, self.transform, self.seed = files, transform, seed

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[Tensor, int]:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        path, label = self.files[index]
        try:
            image = decode_for(self.transform, Path(path).read_bytes())
        except Exception as e:  # the decoders raise many types; only reachable with verify_images=false
            raise DataError(
                f"cannot decode {path} ({type(e).__name__}: {e}): remove or replace it "
                "(datamodule.verify_images=true finds such files before training)"
            ) from None
        with seeded_sample(sample_seed(self.seed, epoch, index)):
            return self.transform(image), label


class EncodedFileDataset(ImageFileDataset):
    """Training files for the GPU decoder (`decode_device=cuda`): a sample is the file's bytes with the crop
    box and flip drawn for it from (seed, epoch, index), the image's size read from its header (no pixel
    decoded here), so each crop is the same whatever the rank, the worker or a resume, as on the CPU path."""

    def __init__(self, files: list[tuple[str, int]], seed: int, hflip: float) -> None:
        super().__init__(files, None, seed)
        self.hflip = hflip

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[tuple[Tensor, tuple[int, ...], bool], int]:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        path, label = self.files[index]
        seed = sample_seed(self.seed, epoch, index)
        try:
            sample = encoded_sample(Path(path).read_bytes(), seed, self.hflip, index)
        except Exception as e:  # only reachable with verify_images=false
            raise DataError(
                f"cannot read {path} ({type(e).__name__}: {e}): remove or replace it "
                "(datamodule.verify_images=true finds such files before training)"
            ) from None
        return sample, label

    collate = staticmethod(collate_encoded)


class ImageFolderDataModule(ImageDataModule):
    """A class-folder tree or an archive of one; see configs/datamodule/image_folder.yaml."""

    def __init__(
        self,
        *args: Any,
        auto_augment: str | None = None,
        re_prob: float = 0.0,
        hflip: float = 0.5,
        color_jitter: float | list[float] | None = None,
        verify_images: bool = True,
        bad_images: str = "stop",
        in_memory: bool | str = "auto",
        in_memory_budget_gb: float | None = None,
        in_memory_size: int | None = None,
        crop_padding: int | None = None,
        decode_device: str = "cpu",
        decode_ahead: int = 2,
        **kwargs: Any,
    ) -> None:
        if bad_images not in ("stop", "skip"):
            raise DataError(f"datamodule.bad_images={bad_images!r}: choose stop or skip")
        if in_memory not in (True, False, "auto"):
            raise DataError(f"datamodule.in_memory={in_memory!r}: choose auto, true or false")
        if in_memory_budget_gb is not None and (
            isinstance(in_memory_budget_gb, bool)
            or not isinstance(in_memory_budget_gb, int | float)
            or in_memory_budget_gb < 0
        ):
            raise DataError(
                f"datamodule.in_memory_budget_gb={in_memory_budget_gb!r} must be a number of GB, at least 0 "
                "(null: a quarter of the memory available)"
            )
        check_decode_device(decode_device)
        check_depth(decode_ahead)
        flip_probability(hflip)
        check_color_jitter(color_jitter, decode_device)
        if decode_device == "cuda":
            check_augment(auto_augment, re_prob)
        check_ints(in_memory_size=in_memory_size, crop_padding=crop_padding)
        check_padding(crop_padding)
        if in_memory_size is not None and in_memory_size < 1:
            raise DataError(f"datamodule.in_memory_size={in_memory_size} must be at least 1 (null: img_size)")
        super().__init__(*args, **kwargs)
        self._source: Source | None = None
        self.skipped: list[tuple[str, str]] = []
        self._plan: in_memory.MemoryPlan | None = None

    # --- the files --------------------------------------------------------------------------------

    def root(self) -> Path:
        """The folder holding `train/`: data_dir itself, or the archive unpacked once into the cache."""
        hp = self.hparams
        path = Path(str(hp.data_dir)).expanduser()
        if not path.exists():
            raise DataError(
                f"datamodule.data_dir={path} does not exist: give a train/<class>/ folder or an archive"
            )
        if path.is_file():
            if not is_archive(path):
                raise DataError(
                    f"datamodule.data_dir={path} is a file but not a .tar/.tar.gz/.tgz/.zip archive"
                )
            path = unpack_archive(path, Path(str(hp.cache_dir)).expanduser() / "unpacked")
        return find_source(path)

    @property
    def source(self) -> Source:
        """Classes and files per split (a folder listing: cheap, called before the model is built)."""
        if self._source is None:
            self._source = scan(self.root())
        return self._source

    def find_classes(self) -> list[str]:
        return list(self.source.classes)

    def _usable(self, split: str, files: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """The files PIL can read; bad ones stop the run (named) or are skipped (counted)."""
        if not self.hparams.verify_images:
            return files
        workers = max(1, len(os.sched_getaffinity(0)))
        bad = find_unreadable([p for p, _ in files], workers)
        if not bad:
            return files
        if self.hparams.bad_images == "stop":
            path, why = bad[0]
            more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
            raise DataError(
                f"{path} is not a readable image ({why}){more} in {split}/: remove or replace it, or set "
                "datamodule.bad_images=skip"
            )
        self.skipped.extend(bad)
        log.warning(
            "skipping %d unreadable file(s) in %s/ (datamodule.bad_images=skip), first: %s (%s)",
            len(bad),
            split,
            *bad[0],
        )
        dropped = {p for p, _ in bad}
        kept = [f for f in files if f[0] not in dropped]
        if not kept:
            raise DataError(f"no readable images left in {split}/ after skipping {len(bad)} bad file(s)")
        return kept

    # --- transforms -------------------------------------------------------------------------------

    def build_transform(self, train: bool) -> Any:
        """timm's per-sample transform from the model's data config: RandomResizedCrop + flip (+ an
        auto-augment string, random erasing) for training; resize + center crop with crop_pct for eval."""
        return self.worker_transform(train)

    @staticmethod
    def keep(dataset: Dataset, indices: Sequence[int]) -> Dataset:
        """The files at `indices` (the samplers hand this dataset `(epoch, index)` keys, which Subset cannot
        map)."""
        if isinstance(dataset, TensorImageDataset):
            return ImageDataModule.keep(dataset, indices)
        kept = copy.copy(dataset)
        kept.files = [dataset.files[i] for i in indices]
        return kept

    # --- GPU decode -------------------------------------------------------------------------------

    def decode_on(self) -> torch.device | None:
        """The device that decodes training images from disk (this process's GPU), or None: loader workers
        decode. Tests replace it to run the GPU path with the decoder on the CPU."""
        return gpu_decode_device(self.hparams.decode_device, self.trainer)

    def undecodable(self, index: int, reason: str) -> DataError:
        return DataError(
            f"cannot decode {self.train_set.files[index][0]} ({reason}): remove or replace it "
            "(datamodule.verify_images=true finds such files before training)"
        )

    # --- in memory --------------------------------------------------------------------------------

    @property
    def memory_size(self) -> int:
        """Side of the stored square images: `in_memory_size`, else the model's input size."""
        return int(self.hparams.in_memory_size or self.img_size)

    def memory_plan(self) -> in_memory.MemoryPlan:
        """In memory or from disk, decided once from the file list (nothing decoded yet) and logged in one
        line. Global rank 0 decides for every rank (first called in setup, where all ranks are): the memory
        available differs between processes and moments, and ranks must not disagree."""
        if self._plan is None:
            hp = self.hparams
            n = sum(len(files) for files in self.source.splits.values())  # a carved val/ is inside train's
            budget = in_memory.budget_bytes(hp.in_memory_budget_gb)
            plan: in_memory.MemoryPlan | None = None
            refusal: str | None = None
            try:
                plan = in_memory.plan(hp.in_memory, n, self.memory_size, budget, self.local_processes())
                if plan.in_memory and hp.in_memory == "auto" and (why := self._batch_path_cannot()):
                    plan = in_memory.MemoryPlan(
                        False, f"streaming from disk (datamodule.in_memory=auto): {why}"
                    )
            except DataError as e:
                refusal = str(e)
            world, rank = self._world()
            if world > 1:
                plan, refusal = self.trainer.strategy.broadcast((plan, refusal), src=0)
            if refusal is not None:
                raise DataError(refusal)
            self._plan = plan
            if rank == 0:
                log.info("image folder: %s", plan.reason)
        return self._plan

    def state_dict(self) -> dict[str, Any]:
        # and whether the images were held in memory (decided in setup): src/predict.py then decodes a photo as
        # these were
        return {**super().state_dict(), "in_memory": None if self._plan is None else self._plan.in_memory}

    def carves_val(self) -> bool:
        return "val" not in self.source.splits

    def follow_checkpoint(self, state: dict[str, Any]) -> None:
        if state.get("in_memory") is not None and self._plan is None:
            held = bool(state["in_memory"])
            self._plan = in_memory.MemoryPlan(held, "in memory" if held else "from disk")

    def held_size(self) -> int | None:
        return self.memory_size if self.memory_plan().in_memory else None

    def _batch_padding(self) -> int:
        # CIFAR-10's 4 px at 32 px: an eighth of the side
        hp = self.hparams
        return hp.crop_padding if hp.crop_padding is not None else self.memory_size // 8

    def _batch_path_cannot(self) -> str | None:
        """Why the in-memory batch augmentation cannot run this config (None: it can). `auto` then keeps
        timm's per-sample transforms in loader workers, e.g. for timm-only RandAugment options (`inc1`)."""
        hp = self.hparams
        if hp.color_jitter is not None:
            return "datamodule.color_jitter runs in loader workers, not on in-memory batches"
        try:
            self.batch_transform(self._batch_padding(), hp.hflip, hp.auto_augment, hp.re_prob)
        except DataError as e:
            return f"{e} in memory, timm's per-sample transforms take it"
        return None

    def num_workers(self) -> int:
        # in memory a batch is one tensor slice: worker processes would only copy it
        return 0 if self.memory_plan().in_memory else super().num_workers()

    def device_transform(self) -> BatchTransform | None:
        if not self.memory_plan().in_memory:
            return self.worker_batches_transform()
        hp = self.hparams
        if hp.color_jitter is not None:
            raise DataError(
                "datamodule.color_jitter runs in the loader workers, on PIL images, not on in-memory batches: "
                "set datamodule.in_memory=auto or false to decode from disk, or color_jitter=null"
            )
        return device_augmentation(self, self._batch_padding(), hp.hflip, hp.auto_augment, hp.re_prob)

    def memory_splits(self, splits: dict[str, list[tuple[str, int]]]) -> Splits:
        self.device_transform()  # a bad auto_augment or re_prob is refused before decoding
        resample = self.resample()
        workers = max(1, len(os.sched_getaffinity(0)))

        def load() -> dict:
            return in_memory.load_or_decode(
                splits, self.memory_size, resample, self.hparams.cache_dir, workers
            )

        if self._world()[0] == 1:
            data = load()
        elif self.trainer.local_rank == 0:
            # each node's first process decodes into the cache while the node's others wait, then load it
            # (should its decode fail, the others reach the same error by decoding themselves)
            try:
                data = load()
            finally:
                self.trainer.strategy.barrier("image_folder_in_memory")
        else:
            self.trainer.strategy.barrier("image_folder_in_memory")
            data = load()
        return tensor_splits(data)

    def load_splits(self) -> Splits:
        hp, splits = self.hparams, self.source.splits
        memory = self.memory_plan().in_memory  # in_memory=true that cannot fit stops here, before any read
        train_files = splits["train"]
        if "val" in splits:
            val_files = splits["val"]
        else:
            train_files, val_files = carve_val(train_files, hp.val_size, hp.split_seed, hp.val_split)
        train_files = self._usable("train", train_files)
        val_files = self._usable("val", val_files)
        if "test" in splits:
            test_files = self._usable("test", splits["test"])
        else:
            log.info("the image folder has no test/: testing on the validation split")
            test_files, self.test_is_val = val_files, True
        if memory:
            if hp.decode_device == "cuda":
                log.info("datamodule.decode_device=cuda does not apply: the images are decoded into memory")
            return self.memory_splits({"train": train_files, "val": val_files, "test": test_files})
        eval_t, seed = self.build_transform(train=False), hp.shuffle_seed
        return Splits(
            train=self._train_files(train_files),
            val=ImageFileDataset(val_files, eval_t, seed),
            test=ImageFileDataset(test_files, eval_t, seed),
        )

    def _train_files(self, files: list[tuple[str, int]]) -> Dataset:
        """Decoded and augmented by the workers (timm's transform), or, on the GPU, read as bytes with each
        image's crop and flip for the decoder."""
        hp = self.hparams
        device = self.decode_on()
        if device is None:
            return ImageFileDataset(files, self.build_transform(train=True), hp.shuffle_seed)
        # the crops and flips come with the batches, drawn by the workers (EncodedFileDataset)
        self._gpu_decoder = GpuDecoder(
            self.img_size, self.mean, self.std, device=device, auto_augment=hp.auto_augment,
            re_prob=hp.re_prob,
        )  # fmt: skip
        return EncodedFileDataset(files, hp.shuffle_seed, flip_probability(hp.hflip))
