"""What every datamodule shares: splits, class names, the model's input spec, the loaders, and batches
augmented on the device for in-memory data.

A subclass says where its classes and images come from (`find_classes`, `load_splits`); the base turns the
datasets into loaders. The trainer runs with `use_distributed_sampler=false`: the samplers the base takes
from `sampling` are the only ones, so evaluation stays exact (no padding) and training order is a function
of (seed, epoch).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch.utils.data import DataLoader, Dataset

from vitrain.data.augment import BatchTransform, flip_probability
from vitrain.data.decode_ahead import DecodedAhead, decode_ahead
from vitrain.data.gpu_decode import EncodedBatch, GpuDecoder, crop_batch, decode_batch
from vitrain.data.loaders import (
    FileImages,
    ResumableLoader,
    Seeded,
    TensorImageDataset,
    passthrough_collate,
)
from vitrain.data.readers.decode import decode_square
from vitrain.data.sampling import VAL_SPLITS, make_sampler, partial_pass_note, per_process_batch
from vitrain.data.transforms import decode_file, on_tensors, timm_transform
from vitrain.errors import DataError
from vitrain.utils.config import plain

log = logging.getLogger(__name__)


@dataclass
class Splits:
    """The three datasets a subclass hands the base; any Dataset with a length."""

    train: Dataset
    val: Dataset
    test: Dataset


def on_device_choice(value: bool | str, nbytes: int, free: int, total: int, workers: int) -> bool:
    """Whether in-memory data of `nbytes` is held on a GPU with `free` of `total` bytes (`data_on_device`
    true or auto; see `ImageDataModule.data_device`). `auto` keeps a tenth of the GPU at most, so the model's
    own memory is not squeezed, and respects loader workers the config asks for (they cannot take GPU
    tensors); `true` refuses in one line what cannot be done."""
    if value == "auto":
        return workers == 0 and nbytes <= min(total // 10, free // 2)
    if workers:
        raise DataError(
            f"datamodule.data_on_device=true with datamodule.num_workers={workers}: loader workers cannot "
            "slice GPU tensors; set num_workers=0 (batches of in-memory data are slices: workers rarely help)"
        )
    if nbytes > free // 2:
        raise DataError(
            f"datamodule.data_on_device=true: the in-memory images take {nbytes / 2**30:.1f} GB, more than half "
            f"of the GPU's {free / 2**30:.1f} GB free; set it to auto or false"
        )
    return True


def check_padding(crop_padding: int | None) -> None:
    """`datamodule.crop_padding`: the zero padding around an in-memory image before its random crop."""
    if crop_padding is not None and crop_padding < 0:
        raise DataError(f"datamodule.crop_padding={crop_padding} must be at least 0 (0: no shifted crops)")


def check_channels(name: str, values: object, positive: bool = False) -> None:
    """`datamodule.mean` / `std`: null (the model's) or one number per RGB channel."""
    if values is None:
        return
    numbers = (
        isinstance(values, Sequence)
        and not isinstance(values, str)
        and len(values) == 3
        and all(
            isinstance(v, int | float) and not isinstance(v, bool) and (v > 0 or not positive) for v in values
        )
    )
    if not numbers:
        above = ", each above 0" if positive else ""
        raise DataError(
            f"datamodule.{name}={values!r}: use null (the model's) or 3 numbers, one per RGB channel{above}"
        )


#: `num_workers: null`'s ceiling. A worker decodes, crops and flips ~2,000 photo-sized JPEGs a second as
#: tensors, ~700 with RandAugment (one EPYC core, docs/benchmarks.md 2b), and one H100 trains ViT-B/32 on
#: 10-12k images a second: up to 16 workers per GPU can be busy (8, the ceiling before, fed ~6k with
#: RandAugment); beyond that the loaders' memory grows for little.
MAX_AUTO_WORKERS = 16


def check_ints(**values: object) -> None:
    """Hydra passes `datamodule.batch_size=abc` through as a string: catch it here, by name."""
    for name, value in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise DataError(f"datamodule.{name}={value!r} must be a whole number")


# methods that decide a training sample's random draws: one defined outside vitrain (datasets or a transform
# of your own) may draw from a generator that the per-sample seeding does not cover
SAMPLE_HOOKS = (
    "load_splits",
    "build_transform",
    "batch_transform",
    "device_transform",
    "on_before_batch_transfer",
    "on_after_batch_transfer",
)


def defined_outside_vitrain(cls: type, name: str) -> bool:
    """Whether the `name` that `cls` uses comes from a class of neither vitrain nor Lightning (whose hooks
    do nothing)."""
    owner = next((k for k in cls.__mro__ if name in vars(k)), None)
    return owner is not None and not owner.__module__.startswith(("vitrain.", "lightning."))


def floats(values: Sequence[float] | None) -> tuple[float, ...] | None:
    return None if values is None else tuple(float(v) for v in values)


def _labels(dataset: Dataset | None) -> Any:
    """A dataset's labels where they are at hand: in-memory tensors, the image-folder datasets' (path, label)
    pairs; None for others (streamed shards)."""
    if isinstance(dataset, TensorImageDataset):
        return dataset.y
    files = getattr(dataset, "files", None)
    return [label for _, label in files] if files is not None else None


#: the largest class this many times the smallest in train/: said at set-up and in the report
IMBALANCE_WARNING = 10


def warn_imbalance(counts: dict[str, int] | None, rank: int) -> None:
    """One warning (rank zero) when the training classes are very unequal: accuracy then mostly measures
    the large classes, and an engineer reading val/acc1 should know."""
    if not counts or rank != 0:
        return
    small, large = min(counts, key=counts.get), max(counts, key=counts.get)
    if counts[small] and counts[large] >= IMBALANCE_WARNING * counts[small]:
        log.warning(
            "the training classes are imbalanced: %s has %d images, %s %d (%.0fx); accuracy mostly reflects "
            "the large classes: src/eval.py prints the accuracy of each class",
            large, counts[large], small, counts[small], counts[large] / counts[small],
        )  # fmt: skip


class ImageDataModule(LightningDataModule):
    """Base of every datamodule. Subclasses implement `find_classes` (cheap: called before the model is built,
    which takes its head size from it) and `load_splits`, and may override the defaults below."""

    #: normalisation when neither the config nor pretrained weights give one
    default_mean: tuple[float, ...] = tuple(IMAGENET_DEFAULT_MEAN)
    default_std: tuple[float, ...] = tuple(IMAGENET_DEFAULT_STD)
    #: input size when neither the config nor the model give one
    default_img_size: int = 224

    def __init__(
        self,
        data_dir: str,
        cache_dir: str,
        batch_size: int = 128,
        eval_batch_size: int | None = None,
        val_size: int | float = 5000,
        split_seed: int = 0,
        val_split: str = "stratified",
        shuffle_seed: int = 0,
        num_workers: int | None = 0,
        pin_memory: bool | str = "auto",
        data_on_device: bool | str = "auto",
        augment_ahead: int = 0,
        drop_last: bool = True,
        img_size: int | None = None,
        mean: list[float] | None = None,
        std: list[float] | None = None,
        train_subset: int | None = None,
        test_subset: int | None = None,
    ) -> None:
        super().__init__()
        check_ints(
            batch_size=batch_size,
            split_seed=split_seed,
            shuffle_seed=shuffle_seed,
            num_workers=num_workers,
            eval_batch_size=eval_batch_size,
            img_size=img_size,
            train_subset=train_subset,
            test_subset=test_subset,
        )
        if (
            isinstance(val_size, bool)
            or not isinstance(val_size, int | float)
            or val_size <= 0
            or (val_size >= 1 and val_size != int(val_size))
        ):
            raise DataError(
                f"datamodule.val_size={val_size!r} must be a count of images (at least 1) or a fraction between 0 "
                "and 1"
            )
        if val_split not in VAL_SPLITS:
            raise DataError(f"datamodule.val_split={val_split!r} must be one of {', '.join(VAL_SPLITS)}")
        if img_size is not None and img_size < 1:
            raise DataError(
                f"datamodule.img_size={img_size} must be at least 1 (null: the model's input size)"
            )
        check_channels("mean", mean)
        check_channels("std", std, positive=True)
        if isinstance(augment_ahead, bool) or not isinstance(augment_ahead, int) or augment_ahead < 0:
            raise DataError(
                f"datamodule.augment_ahead={augment_ahead!r} must be a whole number of batches, at least 0 "
                "(0: the training thread augments each batch)"
            )
        # collects the subclass's own arguments too (Lightning walks the __init__ frames)
        self.save_hyperparameters()
        # plain lists, not ListConfigs: checkpoints store these, and torch.load(weights_only=True) reads them
        self.save_hyperparameters(plain(dict(self.hparams)))
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None
        self._classes: list[str] | None = None
        self._spec: dict[str, Any] = {}
        self._batch = self._eval_batch = batch_size
        #: (path, why) of files left out as unreadable; the run report counts them (`data_facts`)
        self.skipped: list[tuple[str, str]] = []
        # the data has no test split and test/ metrics are on the validation images (the report says so)
        self.test_is_val = False
        # `decode_device=cuda` (image folders from disk, streaming shards): decodes encoded training batches
        self._gpu_decoder: GpuDecoder | None = None
        #: image files to classify, batch size and loader workers (src/predict.py: `predict_files`)
        self._predict: tuple[FileImages, int, int] | None = None

    # --- classes ----------------------------------------------------------------------------------

    def find_classes(self) -> list[str]:
        """Class names in label order, found cheaply (a folder listing, a metadata file)."""
        raise NotImplementedError

    def load_splits(self) -> Splits:
        """Train, val and test datasets with labels in `self.classes` order."""
        raise NotImplementedError

    @property
    def classes(self) -> list[str]:
        if self._classes is None:
            self._classes = list(self.find_classes())
            if not self._classes:
                raise DataError(f"no classes found in {self.hparams.data_dir}")
        return self._classes

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    # --- input spec -------------------------------------------------------------------------------

    def set_input_spec(
        self,
        img_size: int | None = None,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        **data_config: Any,
    ) -> None:
        """The model's input size, normalisation and any other timm data-config keys (interpolation,
        crop_pct); values given in the datamodule config take precedence."""
        self._spec = {**data_config, "img_size": img_size, "mean": floats(mean), "std": floats(std)}

    @property
    def img_size(self) -> int:
        return int(self.hparams.img_size or self._spec.get("img_size") or self.default_img_size)

    @property
    def mean(self) -> tuple[float, ...]:
        return floats(self.hparams.mean) or self._spec.get("mean") or self.default_mean

    @property
    def std(self) -> tuple[float, ...]:
        return floats(self.hparams.std) or self._spec.get("std") or self.default_std

    def resample(self) -> int:
        """PIL's filter for images resized once, before they are held in memory: the model's interpolation
        (timm's data config), else bilinear."""
        from timm.data.transforms import str_to_pil_interp

        return str_to_pil_interp(self._spec.get("interpolation") or "bilinear")

    def device_transform(self) -> BatchTransform | None:
        """Augmentation applied to whole batches on the device, for in-memory uint8 data (None: the
        datasets hand out model-ready tensors)."""
        return None

    def worker_transform(self, train: bool) -> Any:
        """timm's per-sample transform for the datamodules whose loader workers decode (image folders,
        streaming shards), from the model's data config and the datamodule's augmentation options; uint8
        out, finished on the device by `worker_batches_transform`; on uint8 tensors unless an op needs PIL
        images (`on_tensors`)."""
        hp = self.hparams
        transform = timm_transform(
            train,
            self.img_size,
            self.mean,
            self.std,
            self._spec,
            hp.get("auto_augment"),
            flip_probability(hp.get("hflip", 0.5)),
            hp.get("color_jitter"),
        )
        return on_tensors(transform) or transform

    def worker_batches_transform(self) -> BatchTransform:
        """What the device does to the uint8 batches of `worker_transform`: normalise, and erase while
        training (`re_prob`, timm's pixel mode batched); the workers cropped, flipped and augmented each
        sample already."""
        return BatchTransform(
            self.img_size,
            self.mean,
            self.std,
            crop_padding=0,
            hflip=False,
            re_prob=float(self.hparams.get("re_prob", 0.0)),
        )

    def batch_transform(
        self,
        crop_padding: int = 4,
        hflip: bool | float = True,
        auto_augment: str | None = None,
        re_prob: float = 0.0,
    ) -> BatchTransform:
        """The on-device transform of in-memory uint8 batches (random crop of the padded image, flip,
        auto-augment, then resize to the model's input, normalise, random erasing)."""
        return BatchTransform(
            self.img_size,
            self.mean,
            self.std,
            crop_padding=crop_padding,
            hflip=hflip,
            auto_augment=auto_augment,
            re_prob=float(re_prob),
        )

    # --- data -------------------------------------------------------------------------------------

    #: a mid-epoch resume on another number of processes: what the rest of the epoch is (`split_change`)
    REST_OF_EPOCH_ON_OTHER_WORLD = "the rest of the epoch is the images it had left, once each"

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the data: how the training batches were split and how the validation
        split was carved (`resume_caveat`)."""
        hp = self.hparams
        return {"batch_size": int(hp.batch_size), "world_size": self._world()[0], "val_split": hp.val_split}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._saved_split = dict(state_dict)

    def resume_caveat(self) -> str | None:
        """Why a resumed run may not continue bitwise like the uninterrupted one (None: it does); callbacks/
        resume.py logs it when a run resumes. vitrain's own data is exact: the order is a function of (seed,
        epoch), a per-sample transform's draws of (seed, epoch, index), an in-memory batch's on-device
        augmentation of (seed, epoch, rank, batch), and that of worker batches draws from the global
        generators the checkpoint restores; as long as the batches are split as they were (`split_change`)."""
        own = [name for name in SAMPLE_HOOKS if defined_outside_vitrain(type(self), name)]
        caveats = [self.split_change(), self.carve_change()]
        if own:
            caveats.append(
                f"{type(self).__name__} defines {', '.join(own)} itself: the data order resumes exactly, its "
                "augmentation only if each random draw comes from Python's `random` or numpy's or torch's "
                "global generator (seeded per sample); a generator of its own (numpy.random.default_rng, "
                "random.Random) draws other augmentations after a resume (docs/reliability.md)"
            )
        return "; ".join(c for c in caveats if c) or None

    def split_change(self) -> str | None:
        """How this run splits the training batches otherwise than the checkpoint it resumes (None: as it).

        Another process count with the same global batch: the rest of a stopped epoch is still the images
        it had left, once each (each rank's share of the epoch's order, `TrainSampler`, starts past the same
        images), but each rank's augmentation stream and the gradients' summation order differ. Another
        global batch in the middle of an epoch: the restored loop counts the batches done in the old size,
        so the rest of that epoch skips or repeats images."""
        saved = getattr(self, "_saved_split", None)
        now = self.state_dict()
        g, w = (saved or {}).get("batch_size"), (saved or {}).get("world_size")
        if not saved or (g, w) == (now["batch_size"], now["world_size"]):
            return None
        if g != now["batch_size"] and self._resume_offset():
            return (
                f"the checkpoint stopped in the middle of an epoch with datamodule.batch_size={g}, this run has "
                f"{now['batch_size']}: the rest of that epoch is not the images it had left (some skipped or "
                f"seen twice); resume with datamodule.batch_size={g} for the epoch to end exactly"
            )
        if g != now["batch_size"]:
            return f"another global batch size than the checkpoint's ({now['batch_size']}, saved with {g})"
        return (
            f"the checkpoint was saved by {w} process(es), this run has {now['world_size']}: "
            f"{self.REST_OF_EPOCH_ON_OTHER_WORLD}, but each process's augmentation draws and the gradients' "
            "summation order differ"
        )

    def carve_change(self) -> str | None:
        """How this run carves its validation split otherwise than the checkpoint it resumes (None: as it,
        or nothing is carved). A checkpoint written before 2026-12-01 carved a random sample."""
        saved = getattr(self, "_saved_split", None)
        if not saved or not self.carves_val():
            return None
        was = saved.get("val_split", "random")
        if was == self.hparams.val_split:
            return None
        return (
            f"the checkpoint's run carved its validation split by datamodule.val_split={was}, this run by "
            f"{self.hparams.val_split}: other images train and validate from here on (the best checkpoint is "
            f"then chosen on two splits); resume with datamodule.val_split={was} to continue as it did"
        )

    def carves_val(self) -> bool:
        """Whether the validation split is carved from train (`val_size`, `val_split`)."""
        return True

    def split_sizes(self) -> dict[str, int | None]:
        """Images per split after `setup` (None: not loaded)."""
        sets = {"train": self.train_set, "val": self.val_set, "test": self.test_set}
        return {name: None if ds is None else len(ds) for name, ds in sets.items()}

    def data_facts(self, examples: int = 5) -> dict[str, Any]:
        """What the run report says about the data (run_stats.json `data`): classes, images per split, and
        the files left out as unreadable, counted, with the first few named."""
        return {
            "datamodule": type(self).__name__,
            "data_dir": str(self.hparams.data_dir),
            "num_classes": len(self._classes) if self._classes else None,
            "images": self.split_sizes(),
            "skipped_files": len(self.skipped),
            "skipped_examples": [{"path": p, "why": why} for p, why in self.skipped[:examples]],
            "test_is_val": self.test_is_val,
            "train_class_images": self.class_images("train"),
        }

    def class_images(self, split: str = "train") -> dict[str, int] | None:
        """Images of each class in `split` (class -> count, label order), where the labels are at hand (in
        memory, file lists); None for streamed shards or before `setup`."""
        dataset = {"train": self.train_set, "val": self.val_set, "test": self.test_set}[split]
        labels = _labels(dataset) if dataset is not None else None
        if labels is None:
            return None
        counts = torch.bincount(torch.as_tensor(labels, dtype=torch.long), minlength=len(self.classes))
        return dict(zip(self.classes, counts.tolist(), strict=True))

    def split_batches(self, world_size: int) -> tuple[int, int]:
        """(train, eval) batch per process; a size that does not divide by `world_size` is a DataError.
        vitrain.tasks.training asks before fitting, so a bad size stops before the other ranks start."""
        hp = self.hparams
        batch = per_process_batch(hp.batch_size, world_size, "batch_size")
        if hp.eval_batch_size is None:
            return batch, batch
        return batch, per_process_batch(hp.eval_batch_size, world_size, "eval_batch_size")

    def setup(self, stage: str | None = None) -> None:
        if stage == "predict":  # files of the user's (`predict_files`): the data's splits are not read
            return
        hp, world = self.hparams, self._world()[0]
        self._batch, self._eval_batch = self.split_batches(world)
        if self.train_set is None:
            self.classes  # noqa: B018 - found before the splits load (in memory: from the same decode)
            splits = self.load_splits()
            self.train_set, self.val_set, self.test_set = splits.train, splits.val, splits.test
            for key in ("train_subset", "test_subset"):
                if hp.get(key) is not None and hp[key] < 1:
                    raise DataError(f"datamodule.{key}={hp[key]} must be at least 1 (or null for all)")
            # a fixed random sample each, not the first images: a folder's train/ and any test split are stored
            # sorted by class (their first images are all of one class)
            if hp.train_subset is not None:
                n = len(self.train_set)
                self.train_set = self.keep(self.train_set, self._sample(n, min(hp.train_subset, n)))
            if hp.get("test_subset") is not None and hp.test_subset < len(self.test_set):
                self.test_set = self.keep(self.test_set, self._sample(len(self.test_set), hp.test_subset))
            warn_imbalance(self.class_images("train"), self._world()[1])  # once: fit's set-up, not test's
        smallest = min(len(self.val_set), len(self.test_set))
        if smallest < world:
            raise DataError(
                f"the smallest evaluation split has {smallest} images, fewer than the {world} processes: "
                "raise datamodule.val_size or use fewer devices"
            )

    def _sample(self, n: int, k: int) -> list[int]:
        """`k` of `n` indices, ascending, by `split_seed`: the same sample every run and on every rank."""
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.hparams.split_seed))
        return perm[:k].sort().values.tolist()

    @staticmethod
    def keep(dataset: Dataset, indices: Sequence[int]) -> Dataset:
        """The samples at `indices`, in that order (`train_subset`, `test_subset`: a fixed random sample)."""
        if isinstance(dataset, TensorImageDataset):
            idx = torch.as_tensor(list(indices), dtype=torch.long)
            return TensorImageDataset(dataset.x[idx], dataset.y[idx])
        return torch.utils.data.Subset(dataset, list(indices))

    def _world(self) -> tuple[int, int]:
        if self.trainer is None:
            return 1, 0
        return self.trainer.world_size, self.trainer.global_rank

    def _epoch(self) -> int:
        """The epoch the fit loop is in. Read when a training pass starts: the loaders may be requested before
        Lightning restores the epoch from a checkpoint."""
        if self.trainer is None:
            return 0
        return self.trainer.fit_loop.epoch_progress.current.processed

    def num_workers(self) -> int:
        """Loader worker processes per training process; null = this process's share of the node's cores,
        less one for itself, at most MAX_AUTO_WORKERS."""
        n = self.hparams.num_workers
        if n is not None:
            return n
        return max(1, min(MAX_AUTO_WORKERS, len(os.sched_getaffinity(0)) // self.local_processes() - 1))

    def local_processes(self) -> int:
        """Training processes on this node (they share its cores and memory)."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or (
            self.trainer.num_devices if self.trainer else 1
        )
        return max(1, local)

    def _loader(self, dataset: Dataset | None, train: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("call setup() before asking for a dataloader")
        hp = self.hparams
        world, rank = self._world()
        in_memory = isinstance(dataset, TensorImageDataset)
        held_on = self.data_device(dataset) if in_memory else None
        if held_on is not None:
            dataset = dataset.to(held_on)
        sampler = make_sampler(
            dataset, train=train, num_replicas=world, rank=rank, seed=hp.shuffle_seed, tag_epoch=not in_memory
        )
        workers = 0 if held_on is not None else self.num_workers()
        # training: a ResumableLoader, which continues a resumed epoch from the trainer's restored counters
        # (epoch, batches completed) when its first batch is asked for; no loader state is needed
        extra: dict[str, Any] = {}
        loader_cls: type[DataLoader] = DataLoader
        if train:
            loader_cls = ResumableLoader
            ahead = self.augmenter_ahead() if in_memory else self.decoder_ahead()
            extra = {"batches_done": self._resume_offset, "ahead": ahead, "seed_batches": in_memory}
        return loader_cls(
            dataset,
            batch_size=self._batch if train else self._eval_batch,
            sampler=sampler,
            drop_last=train and hp.drop_last,
            num_workers=workers,
            pin_memory=self.pin_memory() and held_on is None,
            persistent_workers=workers > 0,
            collate_fn=passthrough_collate if in_memory else getattr(dataset, "collate", None),
            # a private generator: creating the iterator draws a seed, which must not shift the global RNG
            # that drop-path and worker batches' augmentation use (an exact resume restores it, see
            # callbacks/resume.py)
            generator=torch.Generator().manual_seed(hp.shuffle_seed),
            **extra,
        )

    def pin_memory(self) -> bool:
        """`pin_memory`, with `auto` = on when the trainer's device is a GPU: a batch copied from pageable
        memory makes the host wait until the GPU has run everything queued before it (one stall per step, the
        next step's kernels launched late); from pinned memory the copy runs behind the host's back."""
        value = self.hparams.pin_memory
        if value == "auto":
            device = self.trainer.strategy.root_device if self.trainer is not None else None
            return device is not None and device.type == "cuda"
        if not isinstance(value, bool):
            raise DataError(f"datamodule.pin_memory={value!r} must be true, false or auto")
        return value

    def data_device(self, dataset: TensorImageDataset) -> torch.device | None:
        """The GPU that holds in-memory `dataset` (`data_on_device`), or None: host memory. `auto`: the
        trainer's GPU when the data takes at most a tenth of its memory and the config asks for no loader
        workers; `true`: the trainer's GPU, or a one-line refusal (no GPU, workers asked for, too big)."""
        value = self.hparams.get("data_on_device", "auto")
        if value not in ("auto", True, False):
            raise DataError(f"datamodule.data_on_device={value!r} must be true, false or auto")
        device = self.trainer.strategy.root_device if self.trainer is not None else None
        if value is False or device is None or (value == "auto" and device.type != "cuda"):
            return None
        if device.type != "cuda":
            raise DataError(
                f"datamodule.data_on_device=true needs a GPU to train on; this run trains on {device.type}: "
                "set it to auto or false"
            )
        if dataset.copied_to(device):  # decided before (a loader made again): the copy is there
            return device
        free, total = torch.cuda.mem_get_info(device)
        held = on_device_choice(value, dataset.nbytes, free, total, self.num_workers())
        if held:
            log.info("in-memory data: %.0f MB of images held on %s", dataset.nbytes / 2**20, device)
        return device if held else None

    def _resume_offset(self) -> int:
        """Batches of the current epoch a restored (mid-epoch) checkpoint has already trained on."""
        if self.trainer is None or not self.trainer.fit_loop.restarting:
            return 0
        return self.trainer.fit_loop.epoch_loop.batch_progress.current.completed

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        self._note_partial_pass("val", self.val_set)
        return self._loader(self.val_set, train=False)

    def test_dataloader(self) -> DataLoader:
        self._note_partial_pass("test", self.test_set)
        return self._loader(self.test_set, train=False)

    # --- prediction (src/predict.py) --------------------------------------------------------------------

    def held_size(self) -> int | None:
        """Side of the square uint8 images this data holds in memory, which the device resizes to the model's
        input; None: decoded from files or shards at the model's input size (timm's evaluation transform)."""
        return None

    def eval_decoder(self) -> Callable[[str], torch.Tensor]:
        """An image file in the form the evaluation splits hand their images to the device (uint8 [3,H,W]),
        for src/predict.py: a photo is then resized and normalised by `device_transform` as the test images
        were. Held in memory: decoded as the held images were (shorter side to `held_size`, center crop);
        else the loader workers' evaluation transform (timm's resize and center crop)."""
        size = self.held_size()
        if size is None:
            return partial(decode_file, self.worker_transform(train=False))
        return partial(decode_square, size=size, resample=self.resample())

    def timm_data_config(self) -> tuple[dict[str, Any], str | None]:
        """timm's data config of the evaluation preprocessing (`timm.data.create_transform(**config)`), for a
        model exported to timm (src/export.py), and what it cannot say (None: nothing). From files or shards
        it is the transform evaluation runs; held in memory, a photo's shorter side resized to the input size
        and a center crop, which is evaluation's when the images are held at the input size."""
        from timm.data import DEFAULT_CROP_PCT

        size, held = self.img_size, self.held_size()
        config = {
            "input_size": (3, size, size),
            "interpolation": self._spec.get("interpolation") or "bilinear",
            "mean": tuple(self.mean),
            "std": tuple(self.std),
            "crop_pct": 1.0 if held is not None else (self._spec.get("crop_pct") or DEFAULT_CROP_PCT),
            "crop_mode": "center",
        }
        caveat = None
        if held is not None and held != size:
            caveat = (
                f"the model learnt from images held at {held}x{held} px and resized to {size} px on the device; "
                f"timm's transform from the exported config resizes a photo straight to {size} px"
                f"{' (sharper than the training images)' if held < size else ''}: src/predict.py preprocesses "
                "as the training did"
            )
        return config, caveat

    def follow_checkpoint(self, state: dict[str, Any]) -> None:
        """Take what the training run's `state_dict` recorded about how it held its images (none here)."""

    def predict_files(self, paths: Sequence[str], batch_size: int, num_workers: int) -> None:
        """The files `predict_dataloader` hands out (decoded by `eval_decoder`), in this order; `batch_size`
        per process."""
        self._predict = (FileImages(list(paths), self.eval_decoder()), batch_size, num_workers)

    def predict_dataloader(self) -> DataLoader:
        if self._predict is None:
            raise RuntimeError("call predict_files() before asking for the predict dataloader")
        dataset, batch_size, workers = self._predict
        world, rank = self._world()  # several processes: each its share, every file once (the eval sampler)
        sampler = make_sampler(dataset, train=False, num_replicas=world, rank=rank, seed=0)
        return DataLoader(
            dataset, batch_size=batch_size, sampler=sampler, num_workers=workers, pin_memory=self.pin_memory()
        )

    def _note_partial_pass(self, split: str, dataset: Dataset | None) -> None:
        """Warn, on rank zero, when the trainer's limit scores a prefix of a class-sorted split
        (`sampling.partial_pass_note`)."""
        trainer = self.trainer
        if trainer is None or dataset is None or trainer.global_rank != 0:
            return
        labels = _labels(dataset)
        limit = getattr(trainer, f"limit_{split}_batches", None)
        note = partial_pass_note(split, labels, limit, self._eval_batch, trainer.world_size)
        if note:
            log.warning(note)

    def decoder_ahead(self) -> Callable[[Iterator], Iterator] | None:
        """GPU decode in a trainer: the training loader's wrapper that decodes `decode_ahead` batches ahead in a
        thread (vitrain/data/decode_ahead.py); None: the training thread decodes, in `on_before_batch_transfer`."""
        depth = self.hparams.get("decode_ahead", 0)
        decoder = self._gpu_decoder
        if decoder is None or self.trainer is None or not depth:
            return None
        crops = partial(crop_batch, decoder, undecodable=self.undecodable)
        return partial(decode_ahead, decode=crops, device=decoder.device, depth=depth)

    def augmenter_ahead(self) -> Callable[[Iterator], Iterator] | None:
        """In-memory training: the loader's wrapper that slices and augments `augment_ahead` batches ahead of
        the training thread, in a thread of its own on a CUDA stream of its own (vitrain/data/decode_ahead.py);
        None (the default, 0): the training thread augments each batch (`on_after_batch_transfer`). Off by
        default: on a CPU a thread doing that work saved a host-bound training step at most a seventh of what
        it costs inline, and in one run of three cost more (docs/benchmarks.md section 2: the GIL); on a GPU,
        not measured yet."""
        depth = self.hparams.get("augment_ahead", 0)
        transform = self.device_transform()
        if self.trainer is None or not depth or transform is None:
            return None
        device = self.trainer.strategy.root_device

        def augment(batch: Seeded) -> torch.Tensor:  # host-held images go to the device first (`to`: no-op)
            return transform(batch.x.to(device, non_blocking=True), train=True, seed=batch.seed)

        return partial(decode_ahead, decode=augment, device=device, depth=depth, name="augment-ahead")

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """A training batch a thread prepared (`DecodedAhead`): taken on the current stream; in-memory, it is
        model input already (`augment_ahead`), decoded on the GPU (`decode_device=cuda`) it gets its random
        augmentation and normalisation here, on the training thread, as inline. An encoded training batch
        from the loader workers becomes augmented model input on the GPU here, cropped and flipped as the
        workers drew it."""
        x, y = batch
        if isinstance(x, DecodedAhead):
            x = x.wait(*([y] if isinstance(y, torch.Tensor) else []))
            return (self._gpu_decoder.finish(x, train=True) if self._gpu_decoder is not None else x), y
        if isinstance(x, EncodedBatch) and self._gpu_decoder is not None:
            return decode_batch(self._gpu_decoder, x, self.undecodable), y
        return batch

    def undecodable(self, index: int, reason: str) -> DataError:
        """The error for training sample `index` whose pixels the GPU decoder cannot decode; subclasses name
        the file or the shards, and the remedy."""
        return DataError(f"cannot decode training sample {index} ({reason})")

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """uint8 batches (in memory, or from the loader workers): augment (training only), resize and
        normalise on the device the batch is on; an in-memory training batch (`Seeded`) with generators
        seeded by its own seed. A float batch (decoded on the GPU, or augmented ahead) is model input already."""
        x, y = batch
        seed = None
        if isinstance(x, Seeded):
            x, seed = x
        if not isinstance(x, torch.Tensor) or x.dtype != torch.uint8:
            return self.as_model_input(x), y
        transform = self.device_transform()
        if transform is None:
            return x, y
        train = seed is not None or (self.trainer is not None and self.trainer.training)
        return self.as_model_input(transform(x, train=train, seed=seed)), y

    def as_model_input(self, x: Any) -> Any:
        """Images in the dtype the precision computes in: Lightning converts a batch (`convert_input`) before
        its transfer, when ours is still uint8, so under a `*-true` precision (bf16-true, 16-true, 64-true:
        the weights in that dtype) the float images made here would meet weights of another dtype."""
        plugin = getattr(self.trainer, "precision_plugin", None)
        return plugin.convert_input(x) if plugin is not None else x
