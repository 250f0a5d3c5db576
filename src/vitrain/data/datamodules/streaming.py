"""Shards written by `make shards` (vitrain/data/shards.py), read with litdata from a local folder or S3.

Training streams with litdata's `StreamingDataset` + `StreamingDataLoader`: chunks are fetched into a local
cache ahead of use and evicted after, each rank and worker reads its own part of the epoch, and a resumed run
continues the interrupted epoch with its next batch, placed from the trainer's restored (epoch, batches
done) (`ResumableStreamingLoader`); each sample's augmentation is seeded from (seed, epoch, index), also with
`decode_device=cuda`, where the workers draw each image's crop and flip for the GPU decoder. Validation and
test read the same shards by index through the shared base's samplers, because a streaming eval would have to
drop or pad samples to give every rank whole batches; the base's `UnrepeatedDistributedSampler` counts every
sample exactly once.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from litdata import StreamingDataLoader, StreamingDataset
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from vitrain.compat import litdata_allow_http, litdata_distributed_env
from vitrain.data.augment import BatchTransform, flip_probability
from vitrain.data.datamodules.base import ImageDataModule, Splits
from vitrain.data.decode_ahead import check_depth
from vitrain.data.gpu_decode import (
    GpuDecoder,
    check_augment,
    check_decode_device,
    collate_encoded,
    encoded_sample,
    gpu_decode_device,
)
from vitrain.data.sampling import sample_seed, seeded_sample
from vitrain.data.shards import FORMAT_NAME, FORMAT_VERSION, METADATA_FILE, SHUFFLED
from vitrain.data.transforms import check_color_jitter, decode_for
from vitrain.errors import DataError

log = logging.getLogger(__name__)
# litdata logs its cache sizing and mmap choices at INFO once per worker and split
logging.getLogger("litdata").setLevel(logging.WARNING)


# --- metadata ---------------------------------------------------------------------------------------------


#: shards written before `make shards` shuffled each split (the metadata has no `order`)
CLASS_ORDER = (
    "the shards at %s were written in folder order, class by class: litdata's shuffle permutes chunks and "
    "mixes samples only within a window, so a training batch holds few classes, and a partial evaluation "
    "scores few; write them again with `make shards SRC=<image folder> DST=%s` (each split then shuffled)"
)


def read_metadata(location: str, endpoint_url: str | None = None) -> dict[str, Any]:
    """The shards' metadata file, local or on S3; every way it can be unusable is a one-line error.

    Read with vitrain's S3 client before litdata touches the bucket: litdata's own client retries a missing
    bucket or absent credentials for a long time instead of failing."""
    from vitrain.s3.client import S3Options, is_s3_uri, parse_s3_uri
    from vitrain.s3.store import S3Store

    where = f"{location.rstrip('/')}/{METADATA_FILE}"
    if is_s3_uri(location):
        uri = parse_s3_uri(location).child(METADATA_FILE)
        store = S3Store(S3Options(endpoint_url=endpoint_url))
        try:
            body = store.client.get_object(Bucket=uri.bucket, Key=uri.key)["Body"].read()
        except Exception as exc:
            err = store.error(exc, f"reading {uri}")
            if type(err).__name__ == "S3ObjectNotFound":
                raise DataError(
                    f"no shards at {location} ({METADATA_FILE} not found): write them with `make shards SRC=<folder> DST={location}`"
                ) from None
            raise err from None
        text = body.decode("utf-8", "replace")
    else:
        path = Path(location).expanduser()
        if not path.is_dir():
            raise DataError(
                f"shard folder {path} does not exist: write it with `make shards SRC=<image folder> DST={path}`"
            )
        if not (path / METADATA_FILE).is_file():
            what = (
                "is empty"
                if not any(path.iterdir())
                else f"has no {METADATA_FILE} (not written by `make shards`, or unfinished)"
            )
            raise DataError(
                f"shard folder {path} {what}: write it with `make shards SRC=<image folder> DST={path}`"
            )
        text = (path / METADATA_FILE).read_text()
    try:
        meta = json.loads(text)
    except json.JSONDecodeError:
        raise DataError(f"{where} is not valid JSON: write the shards again with `make shards`") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise DataError(f"{where} does not describe vitrain shards: write them again with `make shards`")
    if meta.get("version") != FORMAT_VERSION:
        raise DataError(
            f"shards at {location} have format version {meta.get('version')}, this vitrain reads version "
            f"{FORMAT_VERSION}: write them again with `make shards SRC=<image folder> DST={location}`"
        )
    for split in ("train", "val"):
        if not meta.get("splits", {}).get(split):
            raise DataError(
                f"shards at {location} have no {split} split: write them again with `make shards`"
            )
    return meta


# --- samples ----------------------------------------------------------------------------------------------


class SampleTransform:
    """A stored sample -> (image tensor, label). CPU: decode + timm's per-sample transform, seeded by
    (seed, epoch, index) so a sample's augmentation does not depend on rank, worker or a resume.
    `raw=True` (GPU decode): ((encoded bytes as uint8, crop box, flip), label), the box and flip drawn from
    the same seed and the size in the image's header (`encoded_sample`), so they too do not depend on rank,
    worker or a resume; `source` names the shards in the error for bytes that are no image."""

    def __init__(
        self, transform: Any, seed: int, raw: bool = False, hflip: float = 0.5, source: str = "the shards"
    ) -> None:
        self.transform, self.seed, self.raw, self.hflip, self.source = transform, seed, raw, hflip, source

    def __call__(self, item: dict[str, Any], epoch: int) -> tuple[Any, int]:
        seed = sample_seed(self.seed, epoch, item["index"])
        if self.raw:
            try:
                return encoded_sample(item["image"], seed, self.hflip, item["index"]), item["label"]
            except Exception as e:  # PIL raises many types; `make shards` checked every image it wrote
                raise DataError(
                    f"cannot read sample {item['index']} (label {item['label']}) of {self.source} "
                    f"({type(e).__name__}: {e}): write the shards again with `make shards`"
                ) from None
        with seeded_sample(seed):
            return self.transform(decode_for(self.transform, item["image"])), item["label"]


def collate(batch: list[tuple[Tensor, int]]) -> tuple[Tensor, Tensor]:
    """Decoded samples -> (images, labels); GPU-decode training batches use `collate_encoded` instead."""
    images, labels = zip(*batch, strict=True)
    return torch.stack(images), torch.tensor(labels, dtype=torch.long)


class ShardStream(StreamingDataset):
    """litdata's StreamingDataset, each sample passed through a SampleTransform with the epoch it is in."""

    def __init__(self, sample: SampleTransform, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sample = sample

    def __next__(self) -> tuple[Tensor, int]:
        return self.sample(super().__next__(), self.current_epoch)


class ShardIndexDataset(Dataset):
    """The shards of one split read by index (map-style), for exact evaluation with the base's samplers.
    The litdata reader is opened lazily in the process that reads (each loader worker has its own)."""

    def __init__(self, length: int, sample: SampleTransform, **stream_kwargs: Any) -> None:
        self.length, self.sample, self.stream_kwargs = length, sample, stream_kwargs
        self._stream: Any = None

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        if self._stream is None:
            self._stream = StreamingDataset(shuffle=False, **self.stream_kwargs)
            # opening it as an iterator sets up the chunk cache: reads by index then fetch whole chunks into
            # it (litdata's default for index reads is one ranged GET per sample)
            iter(self._stream)
        return self.sample(self._stream[index], 0)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_stream": None}

    collate = staticmethod(collate)


class ResumableStreamingLoader(StreamingDataLoader):
    """litdata's loader, whose every pass starts where the trainer's restored counters say: epoch `e` of the
    fit loop is litdata's epoch `e + 1` (its shuffle), and a resumed epoch starts after the batches the
    restored loop has completed, as litdata's own resume does (each worker skips its share unread).

    litdata counts epochs by the passes started and resumes from the state Lightning stores in the checkpoint;
    but Lightning creates the training iterator (for `estimated_stepping_batches`) before it restores its
    loop counters and then never hands that state to the loader, so a killed run replayed the start of the
    interrupted epoch, or epoch 0's shuffle after an epoch boundary. Here the position is set when the first
    batch is asked for, from (epoch, batches done) alone; the state litdata saves is left unused. It is also
    exact after a SIGTERM save, which happens after the loader already handed out the next batch."""

    def __init__(
        self,
        position: Callable[[], tuple[int, int] | None],
        *args: Any,
        ahead: Callable[[Iterator], Iterator] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._position = position
        #: wraps each pass's batches (GPU decode ahead of the training thread, vitrain/data/decode_ahead.py)
        self.ahead = ahead

    def __iter__(self) -> Any:
        passes = super().__iter__  # a generator function: nothing runs before the first batch

        def batches() -> Any:
            position = self._position()
            if position is not None:  # None: no trainer, litdata counts the passes itself
                self.seek(*position)
            yield from passes()

        return self.ahead(batches()) if self.ahead else batches()

    def seek(self, epoch: int, batches_done: int) -> None:
        """The next pass is fit-loop epoch `epoch`, `batches_done` batches in."""
        if not batches_done:
            self.current_epoch, self.restore = epoch, False  # litdata starts a fresh pass at epoch + 1
            return
        assert self.batch_size
        yielded = batches_done * self.batch_size
        # the litdata state Lightning restored from the checkpoint (unused) makes `set_epoch` a no-op, and the
        # state below would carry the dataset's first epoch: a resume after epoch 0 replayed epoch 0's order
        self.dataset.reset_state_dict()
        self.dataset.set_epoch(epoch + 1)
        self.load_state_dict(
            {
                "dataset": self.dataset.state_dict(yielded, self.num_workers, self.batch_size),
                "current_epoch": epoch + 1,
                "num_samples_yielded": yielded,
                # batches come from the workers in turn, the first from worker 0
                "latest_worker_idx": (batches_done - 1) % max(self.num_workers, 1),
            }
        )


# --- the datamodule ---------------------------------------------------------------------------------------


class StreamingDataModule(ImageDataModule):
    """Shards from `make shards`, local or `s3://`; see configs/datamodule/streaming.yaml."""

    # litdata deals an epoch's chunks to ranks and workers by their count: each skips its own share
    REST_OF_EPOCH_ON_OTHER_WORLD = "litdata deals the rest of the epoch to the processes anew (images of it may be skipped or seen twice)"

    def __init__(
        self,
        *args: Any,
        max_cache_size: str | None = "50GB",
        endpoint_url: str | None = None,
        decode_device: str = "cpu",
        decode_ahead: int = 2,
        auto_augment: str | None = None,
        re_prob: float = 0.0,
        hflip: float = 0.5,
        color_jitter: float | list[float] | None = None,
        **kwargs: Any,
    ) -> None:
        check_decode_device(decode_device)
        check_depth(decode_ahead)
        check_color_jitter(color_jitter, decode_device)
        flip_probability(hflip)
        if decode_device == "cuda":
            check_augment(auto_augment, re_prob)
        super().__init__(*args, **kwargs)
        self._meta: dict[str, Any] | None = None

    @property
    def metadata(self) -> dict[str, Any]:
        if self._meta is None:
            _allow_http_endpoints(self.hparams.endpoint_url)
            self._meta = read_metadata(str(self.hparams.data_dir), self.hparams.endpoint_url)
            # unreadable files `make shards` left out: counted in the run report like image_folder's skips
            self.skipped = [(str(p), "skipped by make shards") for p in self._meta.get("skipped") or []]
        return self._meta

    def split_sizes(self) -> dict[str, int | None]:
        """Images per split as written (the training stream's own length is per rank and worker)."""
        splits = self.metadata["splits"]
        return {"train": splits["train"], "val": splits["val"], "test": splits.get("test") or splits["val"]}

    def find_classes(self) -> list[str]:
        return list(self.metadata["classes"])

    def _split_dir(self, split: str) -> str:
        root = str(self.hparams.data_dir)
        return (
            f"{root.rstrip('/')}/{split}"
            if root.startswith("s3://")
            else str(Path(root).expanduser() / split)
        )

    def _stream_kwargs(self, split: str) -> dict[str, Any]:
        hp = self.hparams
        options = {"endpoint_url": hp.endpoint_url} if hp.endpoint_url else None
        kwargs: dict[str, Any] = {"input_dir": self._split_dir(split), "storage_options": options}
        if str(hp.data_dir).startswith("s3://"):
            # one local chunk cache per split; litdata evicts beyond max_cache_size
            kwargs["cache_dir"] = str(
                Path(hp.cache_dir).expanduser() / "shards" / _cache_key(self._split_dir(split))
            )
            kwargs["max_cache_size"] = hp.max_cache_size
        return kwargs

    def build_transform(self, train: bool) -> Any:
        """timm's per-sample transform from the model's data config (RandomResizedCrop + flip [+ RandAugment,
        random erasing] for training; resize + center crop with crop_pct for evaluation)."""
        return self.worker_transform(train)

    def device_transform(self) -> BatchTransform:
        return self.worker_batches_transform()

    def decode_on(self) -> torch.device | None:
        """The device that decodes training batches (this process's GPU), or None: loader workers decode."""
        return gpu_decode_device(self.hparams.decode_device, self.trainer)

    def carves_val(self) -> bool:
        return False  # the shards hold their splits (`make shards` carved theirs)

    def load_splits(self) -> Splits:
        meta, hp = self.metadata, self.hparams
        device = self.decode_on()
        if device is None:
            train_sample = SampleTransform(self.build_transform(train=True), hp.shuffle_seed)
        else:
            # the crops and flips come with the batches, drawn by the workers (SampleTransform, raw)
            self._gpu_decoder = GpuDecoder(
                self.img_size, self.mean, self.std, device=device, auto_augment=hp.auto_augment,
                re_prob=hp.re_prob,
            )  # fmt: skip
            train_sample = SampleTransform(
                None,
                hp.shuffle_seed,
                raw=True,
                hflip=flip_probability(hp.hflip),
                source=self._split_dir("train"),
            )
        eval_sample = SampleTransform(self.build_transform(train=False), hp.shuffle_seed)
        world, rank = self._world()
        if rank == 0 and meta.get("order") != SHUFFLED:
            log.warning(CLASS_ORDER, self.hparams.data_dir, self.hparams.data_dir)
        train = ShardStream(
            sample=train_sample,
            shuffle=True,
            drop_last=True,
            seed=hp.shuffle_seed,
            **self._stream_kwargs("train"),
        )
        train.distributed_env = litdata_env(world, rank)
        test_split = "test" if meta["splits"].get("test") else "val"
        self.test_is_val = test_split == "val"
        if self.test_is_val:
            log.info("the shards have no test split: testing on val")
        return Splits(
            train=train,
            val=ShardIndexDataset(meta["splits"]["val"], eval_sample, **self._stream_kwargs("val")),
            test=ShardIndexDataset(
                meta["splits"][test_split], eval_sample, **self._stream_kwargs(test_split)
            ),
        )

    @staticmethod
    def keep(dataset: Dataset, indices: Sequence[int]) -> Dataset:
        raise DataError(
            "datamodule.train_subset and test_subset do not apply to streaming shards: write a smaller shard "
            "set instead"
        )

    def train_dataloader(self) -> DataLoader:
        if self.train_set is None:
            raise RuntimeError("call setup() before asking for a dataloader")
        workers = self.num_workers()
        # litdata's loader, placed at each pass's start from the trainer's restored (epoch, batches done)
        return ResumableStreamingLoader(
            self._position,
            self.train_set,
            ahead=self.decoder_ahead(),
            batch_size=self._batch,
            num_workers=workers,
            pin_memory=self.pin_memory(),
            persistent_workers=workers > 0,
            collate_fn=collate_encoded if self._gpu_decoder is not None else collate,
            drop_last=True,
            # a private generator, as the base's loaders have: starting a pass draws the workers' base seed,
            # which must not move the global RNG that drop-path draws from (an uninterrupted run starts more
            # passes of its persistent workers than a resumed one)
            generator=torch.Generator().manual_seed(self.hparams.shuffle_seed),
        )

    def _position(self) -> tuple[int, int] | None:
        """(epoch, batches of it already trained on) for the training pass about to start; None outside a
        trainer."""
        if self.trainer is None:
            return None
        return self._epoch(), self._resume_offset()

    def undecodable(self, index: int, reason: str) -> DataError:
        return DataError(
            f"cannot decode sample {index} of {self._split_dir('train')} ({reason}): write the shards again "
            "with `make shards`"
        )


def litdata_env(world_size: int, global_rank: int) -> Any:
    """The ranks as Lightning numbers them, for litdata (which otherwise guesses from torch.distributed and
    the GPUs per machine). Always one "node": litdata 0.2.76's node-local reshuffle (epochs after the first
    with several nodes) gives a chunk that straddles two nodes to both, so samples repeat within an epoch
    (found while testing this); one global shuffle per epoch is a partition for any number of nodes, at the
    price of less chunk-cache reuse between epochs."""
    return litdata_distributed_env(world_size, global_rank, num_nodes=1)


def _cache_key(location: str) -> str:
    import hashlib

    return hashlib.sha256(location.encode()).hexdigest()[:16]


def _allow_http_endpoints(endpoint_url: str | None = None) -> None:
    """litdata fetches chunks with obstore, which refuses plain-HTTP endpoints (a MinIO in the cluster, a
    test server) unless told; boto3 and the rest of vitrain accept them, so allow them when one is set."""
    endpoint = (
        endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
    )
    if endpoint.startswith("http://"):
        litdata_allow_http()


_allow_http_endpoints()  # also in loader workers started with spawn (they import this module to unpickle)
