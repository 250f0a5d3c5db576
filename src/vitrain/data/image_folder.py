"""Your own images: a `train/<class>/` tree with `val/<class>/` and/or `test/<class>/` (the ImageNet layout),
or a .tar/.tar.gz of one, read from disk per sample.

DataLoader worker processes open, decode (JPEG, PNG, WebP; any mode converted to RGB) and transform each
image with timm's transforms from the model's data config. Splits, samplers, the per-process batch, exact
evaluation and the resumable training loader (torchdata's StatefulDataLoader, whose state Lightning keeps
in every checkpoint) come from the shared base, vitrain/data/base.py.

Unreadable files are found before training, by PIL reading each file's header and structure without
decoding every pixel (`verify_images`); `bad_images: stop` then names them in one error, `skip` leaves them
out with a warning that counts them. A worker never meets a bad file in the middle of an epoch unless the
check was turned off; then the decode error still names the file.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset

from vitrain.data.base import ImageDataModule, Splits, sample_seed, seed_sample
from vitrain.data.shards import Source, carve_val, find_source, find_unreadable, scan
from vitrain.data.sources import unpack_archive
from vitrain.data.transforms import timm_transform
from vitrain.errors import DataError

log = logging.getLogger(__name__)


class ImageFileDataset(Dataset):
    """(path, label) pairs decoded on access. Training indices arrive as `(epoch, index)` from the base's
    EpochTaggedSampler: the sample's random transform is seeded from (seed, epoch, index), so it is the same
    whatever the rank, the worker or a resume."""

    def __init__(self, files: list[tuple[str, int]], transform: Any, seed: int) -> None:
        self.files, self.transform, self.seed = files, transform, seed

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[Tensor, int]:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        path, label = self.files[index]
        try:
            with Image.open(path) as img:
                image = img.convert("RGB")  # grayscale, palette, RGBA, CMYK; decodes the pixels
        except Exception as e:  # PIL raises many types; only reachable with verify_images=false
            raise DataError(
                f"cannot decode {path} ({type(e).__name__}: {e}): remove or replace it "
                "(datamodule.verify_images=true finds such files before training)"
            ) from None
        seed_sample(sample_seed(self.seed, epoch, index))
        return self.transform(image), label


class ImageFolderDataModule(ImageDataModule):
    """A class-folder tree or an archive of one; see configs/datamodule/image_folder.yaml."""

    def __init__(
        self,
        *args: Any,
        auto_augment: str | None = None,
        re_prob: float = 0.0,
        hflip: float = 0.5,
        verify_images: bool = True,
        bad_images: str = "stop",
        **kwargs: Any,
    ) -> None:
        if bad_images not in ("stop", "skip"):
            raise DataError(f"datamodule.bad_images={bad_images!r}: choose stop or skip")
        super().__init__(*args, **kwargs)
        self._source: Source | None = None
        self.skipped: list[tuple[str, str]] = []

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
            if not path.name.lower().endswith((".tar", ".tar.gz", ".tgz")):
                raise DataError(f"datamodule.data_dir={path} is a file but not a .tar/.tar.gz/.tgz archive")
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
        hp = self.hparams
        return timm_transform(
            train, self.img_size, self.mean, self.std, self._spec, hp.auto_augment, hp.re_prob, hp.hflip
        )

    @staticmethod
    def subset(dataset: Dataset, n: int) -> Dataset:
        """The first `n` files (the samplers hand this dataset `(epoch, index)` keys, which Subset cannot map)."""
        return ImageFileDataset(dataset.files[:n], dataset.transform, dataset.seed)

    def load_splits(self) -> Splits:
        hp, splits = self.hparams, self.source.splits
        train_files = splits["train"]
        if "val" in splits:
            val_files = splits["val"]
        else:
            train_files, val_files = carve_val(train_files, hp.val_size, hp.split_seed)
        train_files = self._usable("train", train_files)
        val_files = self._usable("val", val_files)
        if "test" in splits:
            test_files = self._usable("test", splits["test"])
        else:
            log.info("the image folder has no test/: testing on the validation split")
            test_files = val_files
        train_t, eval_t = self.build_transform(train=True), self.build_transform(train=False)
        seed = hp.shuffle_seed
        return Splits(
            train=ImageFileDataset(train_files, train_t, seed),
            val=ImageFileDataset(val_files, eval_t, seed),
            test=ImageFileDataset(test_files, eval_t, seed),
        )
