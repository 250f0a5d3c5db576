"""datamodule=streaming: `make shards` from an image folder to a folder and to S3 (moto server), training
from both on 1 and 2 processes, exact evaluation on an odd split, mid-epoch resume of the streaming loader,
GPU-decode code path on the CPU (crops drawn per sample by the workers: the same with 0 and 2 workers and
after a mid-epoch resume), and the one-line errors."""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import re
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from PIL import Image
from torchvision.io import encode_jpeg

from data_factory import pattern_image
from helpers import (
    ROOT,
    TINY_VIT,
    DecodedRecorder,
    Recorder,
    assert_predicted_as_evaluated,
    compose_cfg,
    predicted,
    run_cli,
)
from vitrain.data.datamodules import streaming
from vitrain.data.datamodules.streaming import StreamingDataModule, litdata_env
from vitrain.data.shards import FORMAT_VERSION, METADATA_FILE, write_shards
from vitrain.data.shards import main as shards_main
from vitrain.data.transforms import decode_for
from vitrain.errors import DataError
from vitrain.tasks.training import train

CLASSES = ("ant", "bee", "cat")
N_TRAIN = 22  # per class: 66 train images
N_VAL = 3  # per class: 9 validation images (odd, for 2 ranks)
RUN_TIMEOUT = 300


def _img(label: int, index: int, size: tuple[int, int]) -> torch.Tensor:
    h, w = size
    return pattern_image(label, index, size=max(h, w))[:, :h, :w].contiguous()


@pytest.fixture(scope="session")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """train/ and val/ of 3 classes, JPEGs of 40..160 px per side; in train also a grayscale JPEG, an RGBA
    PNG and one corrupt file (which `make shards` skips)."""
    root = tmp_path_factory.mktemp("photos")
    gen = torch.Generator().manual_seed(0)
    for split, n in (("train", N_TRAIN), ("val", N_VAL)):
        for label, cls in enumerate(CLASSES):
            d = root / split / cls
            d.mkdir(parents=True)
            for i in range(n):
                h, w = (int(v) for v in torch.randint(40, 161, (2,), generator=gen))
                index = (
                    100 + 50 * i if split == "val" else i
                )  # val: colours far apart, JPEG keeps them distinct
                (d / f"{i:03d}.jpg").write_bytes(
                    encode_jpeg(_img(label, index, (h, w)), quality=90).numpy().tobytes()
                )
    gray = pattern_image(0, 500, size=64)[:1]
    (root / "train" / "ant" / "gray.jpg").write_bytes(encode_jpeg(gray).numpy().tobytes())
    rgba = pattern_image(1, 501, size=48, channels=4).permute(1, 2, 0).numpy()
    Image.fromarray(rgba, mode="RGBA").save(root / "train" / "bee" / "rgba.png")
    (root / "train" / "cat" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    return root


N_TRAIN_READABLE = 3 * N_TRAIN + 2  # + gray + rgba, broken skipped
N_VAL_ALL = 3 * N_VAL


@pytest.fixture(scope="session")
def local_shards(photos: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("shards") / "photos"
    write_shards(photos, str(dst), chunk_bytes="24KB", workers=2, cache_dir=tmp_path_factory.mktemp("wcache"))
    return dst


def _overrides(data_dir: str, cache: Path, batch_size: int = 8) -> list[str]:
    return [
        *TINY_VIT,
        "model.net.num_classes=3",
        "datamodule=streaming",
        f"datamodule.data_dir={data_dir}",
        f"datamodule.cache_dir={cache}",
        f"datamodule.batch_size={batch_size}",
        "datamodule.eval_batch_size=4",
        "datamodule.num_workers=1",
        "trainer.accelerator=cpu",
        "trainer.max_epochs=1",
        "trainer.log_every_n_steps=1",
        "extras.print_config=false",
        "logger=csv",
    ]


def _read_index(stream: streaming.StreamingDataset) -> list[int]:
    return sorted(int(stream[i]["index"]) for i in range(len(stream)))


# --- writing ------------------------------------------------------------------------------------------


def test_shards_hold_every_image_once_as_encoded_bytes(photos: Path, local_shards: Path):
    meta = json.loads((local_shards / METADATA_FILE).read_text())
    assert meta["version"] == FORMAT_VERSION and meta["classes"] == list(CLASSES)
    assert meta["splits"] == {"train": N_TRAIN_READABLE, "val": N_VAL_ALL}
    assert [Path(p).name for p in meta["skipped"]] == ["broken.jpg"]
    train = streaming.StreamingDataset(str(local_shards / "train"))
    assert _read_index(train) == list(range(N_TRAIN_READABLE))
    # the stored bytes are the file's bytes (no re-encoding), with its label
    files = sorted(p for c in CLASSES for p in (photos / "train" / c).iterdir() if p.name != "broken.jpg")
    stored = {hashlib.sha1(train[i]["image"]).hexdigest(): train[i]["label"] for i in range(len(train))}
    for path in files:
        assert stored[hashlib.sha1(path.read_bytes()).hexdigest()] == CLASSES.index(path.parent.name)


def test_shards_cli_from_archive_and_bad_sources(
    photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    import tarfile

    archive = tmp_path / "photos.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(photos / "train", arcname="photos/train")  # no val/: carved from train
    monkeypatch.setenv("VITRAIN_CACHE", str(tmp_path / "cache"))  # where the archive is unpacked
    argv = [str(archive), str(tmp_path / "out"), "--val-size", "7", "--chunk-bytes", "64KB", "--workers", "1"]
    assert shards_main(argv) == 0  # what `make shards SRC=... DST=... SHARDS_ARGS=...` runs
    meta = json.loads((tmp_path / "out" / METADATA_FILE).read_text())
    assert meta["splits"] == {"train": N_TRAIN_READABLE - 7, "val": 7}

    (tmp_path / "bad" / "train" / "ant").mkdir(parents=True)
    with pytest.raises(DataError, match=r"train/ant holds no"):
        write_shards(tmp_path / "bad", str(tmp_path / "o2"))
    (tmp_path / "bad" / "train" / "ant" / "a.jpg").write_bytes(
        (photos / "train" / "ant" / "000.jpg").read_bytes()
    )
    (tmp_path / "bad" / "val" / "bee").mkdir(parents=True)
    with pytest.raises(
        DataError, match=r"other classes than train/ \(extra: \['bee'\], missing: \['ant'\]\)"
    ):
        write_shards(tmp_path / "bad", str(tmp_path / "o2"))
    with pytest.raises(DataError, match="no train/<class>/ folder"):
        write_shards(tmp_path / "bad" / "val", str(tmp_path / "o2"))


# --- reading: errors -----------------------------------------------------------------------------------


def test_bad_shard_locations_are_one_line_errors(local_shards: Path, tmp_path: Path):
    def classes(path: Path | str) -> list[str]:
        return StreamingDataModule(data_dir=str(path), cache_dir=str(tmp_path)).classes

    with pytest.raises(DataError, match="does not exist: write it with `make shards"):
        classes(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="is empty: write it with `make shards"):
        classes(tmp_path / "empty")
    old = tmp_path / "old"
    old.mkdir()
    meta = json.loads((local_shards / METADATA_FILE).read_text())
    (old / METADATA_FILE).write_text(json.dumps({**meta, "version": FORMAT_VERSION + 1}))
    with pytest.raises(
        DataError, match=f"format version {FORMAT_VERSION + 1}, this vitrain reads version {FORMAT_VERSION}"
    ):
        classes(old)


def test_s3_errors_are_one_line(
    s3_bucket: str,
    s3_env: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
):
    from vitrain.s3.errors import S3BucketNotFound, S3CredentialsError

    with pytest.raises(DataError, match=f"no shards at s3://{s3_bucket}/none"):
        _ = StreamingDataModule(data_dir=f"s3://{s3_bucket}/none", cache_dir=str(tmp_path)).classes
    with pytest.raises(S3BucketNotFound, match="bucket does not exist"):
        _ = StreamingDataModule(data_dir="s3://no-such-bucket-h13b/x", cache_dir=str(tmp_path)).classes
    assert shards_main([str(tmp_path), "s3://no-such-bucket-h13b/x"]) == 2  # make shards: before reading SRC
    assert capsys.readouterr().err.strip().startswith("error: S3: cannot write to s3://no-such-bucket-h13b/x")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(S3CredentialsError, match="no usable AWS credentials"):
        _ = StreamingDataModule(data_dir=f"s3://{s3_bucket}/x", cache_dir=str(tmp_path)).classes


# --- sampling ------------------------------------------------------------------------------------------


class IndexSample:
    """Stands in for SampleTransform: the sample's index as its 'image', to see what a loader delivered."""

    def __call__(self, item: dict, epoch: int) -> tuple[torch.Tensor, int]:
        return torch.full((1, 1, 1), float(item["index"])), item["label"]


def _datamodule(shards: Path, tmp_path: Path, batch_size: int, workers: int) -> StreamingDataModule:
    dm = StreamingDataModule(
        data_dir=str(shards),
        cache_dir=str(tmp_path),
        batch_size=batch_size,
        eval_batch_size=4,
        num_workers=workers,
    )
    dm.set_input_spec(32, (0.5,) * 3, (0.5,) * 3)
    return dm


def test_train_epoch_over_two_ranks_sees_each_sample_at_most_once(local_shards: Path, tmp_path: Path):
    """The ranks' streams (2 workers each) partition one shuffled epoch: no sample twice, all but fewer than
    a global batch x workers used, and the next epoch is another order."""
    per_epoch = []
    for epoch in range(2):
        seen: list[int] = []
        for rank in range(2):
            dm = _datamodule(local_shards, tmp_path, batch_size=4, workers=2)
            dm.setup("fit")
            dm.train_set.sample = IndexSample()
            dm.train_set.distributed_env = litdata_env(2, rank)
            loader = dm.train_dataloader()
            loader.current_epoch = epoch  # what the loader counts after `epoch` finished epochs
            ranks = [int(v) for x, _ in loader for v in x.flatten()]
            assert len(ranks) == len(loader) * 4
            seen += ranks
        assert len(seen) == len(set(seen)), "a sample was read twice in one epoch"
        assert N_TRAIN_READABLE - 2 * 2 * 4 < len(seen) <= N_TRAIN_READABLE
        per_epoch.append(seen)
    assert per_epoch[0] != per_epoch[1]


def test_shards_are_written_shuffled_so_batches_mix_classes(
    local_shards: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """Each split is written in a fixed random order: every training batch mixes the classes (written class
    by class, litdata's chunk shuffle gave batches of one to three classes of ten), and a split's prefix is a
    random sample of it. Shards written before, in class order, train with a one-line warning."""
    meta = json.loads((local_shards / METADATA_FILE).read_text())
    assert meta["order"] == "shuffled" and meta["split_seed"] == 0
    labels = [int(streaming.StreamingDataset(str(local_shards / "train"))[i]["label"]) for i in range(24)]
    # written class by class the first 24 would change class at most twice
    assert sum(a != b for a, b in itertools.pairwise(labels)) >= 8, labels
    dm = _datamodule(local_shards, tmp_path, batch_size=8, workers=1)
    with caplog.at_level("WARNING"):
        dm.setup("fit")
    assert "written in folder order" not in caplog.text
    batches = [y.tolist() for _, y in dm.train_dataloader()]
    assert len(batches) >= 6 and all(len(set(b)) >= 2 for b in batches)
    assert sum(len(set(b)) == len(CLASSES) for b in batches) >= len(batches) // 2

    old = tmp_path / "old"
    shutil.copytree(local_shards, old)
    (old / METADATA_FILE).write_text(
        json.dumps({k: v for k, v in meta.items() if k not in ("order", "split_seed")})
    )
    caplog.clear()
    with caplog.at_level("WARNING"):
        _datamodule(old, tmp_path / "c2", batch_size=8, workers=1).setup("fit")
    assert caplog.text.count("written in folder order, class by class") == 1
    assert f"make shards SRC=<image folder> DST={old}" in caplog.text


def test_eval_reads_every_sample_once_on_two_ranks(local_shards: Path, tmp_path: Path):
    """9 validation images on 2 ranks: 5 + 4, none padded or dropped (the base's UnrepeatedDistributedSampler)."""
    from torch.utils.data import DataLoader

    from vitrain.data.sampling import make_sampler

    dm = _datamodule(local_shards, tmp_path, batch_size=4, workers=1)
    dm.setup("fit")
    dm.val_set.sample = IndexSample()
    seen = []
    for rank in range(2):
        sampler = make_sampler(dm.val_set, train=False, num_replicas=2, rank=rank, seed=0)
        loader = DataLoader(
            dm.val_set, batch_size=4, sampler=sampler, num_workers=1, collate_fn=streaming.collate
        )
        seen.append([int(v) for x, _ in loader for v in x.flatten()])
    assert sorted(len(s) for s in seen) == [4, 5]
    assert sorted(seen[0] + seen[1]) == list(range(N_VAL_ALL))


# --- training ------------------------------------------------------------------------------------------


def test_train_from_local_shards_one_process(local_shards: Path, photos: Path, tmp_path: Path):
    """Trains from the shards; src/predict.py then classifies the val/ photos with the checkpoint, each
    decoded, resized and cropped as the shards' evaluation images are, the shards themselves not read."""
    metrics, objects = train(
        compose_cfg(
            "train", [*_overrides(str(local_shards), tmp_path), "+trainer.limit_train_batches=3"], tmp_path
        )
    )
    assert objects.trainer.global_step == 3
    assert 0 <= metrics["val/acc1"] <= 1 and "test/acc1" in metrics
    # the photos have train/ and val/ only: the shards have no test split, tested on val, as the report says
    assert objects.datamodule.test_is_val and "(test = the val images" in (tmp_path / "report.md").read_text()

    last, gone = tmp_path / "checkpoints" / "last.ckpt", f"datamodule.data_dir={tmp_path / 'moved'}"
    rows = predicted(last, photos / "val", tmp_path / "predict", gone)
    files = sorted((photos / "val").rglob("*.jpg"))
    dm = objects.datamodule
    transform = dm.worker_transform(train=False)  # what the shards' val/test samples go through
    images = torch.stack([transform(decode_for(transform, f.read_bytes())) for f in files])
    assert_predicted_as_evaluated(rows, objects.model, dm, images, files)


@pytest.mark.slow
def test_shards_on_s3_train_one_process(photos: Path, s3_bucket: str, s3_env: str, tmp_path: Path):
    uri = f"s3://{s3_bucket}/data/photos"
    write_shards(photos, uri, chunk_bytes="24KB", workers=2, cache_dir=tmp_path / "wcache")
    import boto3

    keys = {o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=s3_bucket)["Contents"]}
    assert f"data/photos/{METADATA_FILE}" in keys and "data/photos/train/index.json" in keys
    metrics, objects = train(
        compose_cfg(
            "train", [*_overrides(uri, tmp_path / "cache"), "+trainer.limit_train_batches=3"], tmp_path
        )
    )
    assert objects.trainer.global_step == 3 and "val/acc1" in metrics
    assert any((tmp_path / "cache" / "shards").rglob("chunk-*.bin")), "chunks were cached locally"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(RUN_TIMEOUT)
def test_ddp_two_processes_from_local_shards_exact_eval(local_shards: Path, tmp_path: Path):
    """2 DDP processes train from the shards; the 9 validation images are evaluated 5 + 4, none twice."""
    args = [*_overrides(str(local_shards), tmp_path, batch_size=8), "trainer=ddp", "trainer.devices=2",
            "trainer.accelerator=cpu", "+trainer.limit_train_batches=3", f"hydra.run.dir={tmp_path / 'run'}",
            "+callbacks.eval_samples._target_=helpers.EvalSamples", f"+callbacks.eval_samples.out={tmp_path}"]  # fmt: skip
    done = run_cli("train.py", args, env={"PYTHONPATH": str(ROOT / "tests")}, timeout=RUN_TIMEOUT)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in done.stdout + done.stderr
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert sorted(map(len, ranks)) == [4, 5]
    assert len(set(ranks[0]) | set(ranks[1])) == N_VAL_ALL


# --- resume ----------------------------------------------------------------------------------------------


def _fit(dm: StreamingDataModule, model: Recorder, root: Path, **kwargs) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, use_distributed_sampler=False, default_root_dir=root,
        **kwargs,
    )  # fmt: skip
    trainer.fit(model, datamodule=dm)
    return trainer


class SaveAt(L.Callback):
    """Save a checkpoint after training batch `step`, where the SIGTERM callback saves (a kill after it
    loses nothing)."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


@pytest.mark.parametrize(("epochs", "step"), [(1, 3), (2, 11)], ids=["epoch-0", "epoch-1"])
def test_mid_epoch_resume_continues_the_epoch(
    local_shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, epochs: int, step: int
):
    """Checkpoint 3 batches into an epoch of 8 (2 loader workers), in the first epoch or the second, resume
    from it: the batches before the save and the resumed run's batches are those of the uninterrupted run,
    each sample once per epoch, in the same order (in the second epoch, the second epoch's shuffle: the
    litdata state Lightning restores used to pin the first's)."""
    monkeypatch.setattr(streaming.SampleTransform, "__call__", IndexSample.__call__)

    def dm() -> StreamingDataModule:
        return _datamodule(local_shards, tmp_path, batch_size=8, workers=2)

    ckpt = tmp_path / "mid.ckpt"
    whole = Recorder()
    _fit(dm(), whole, tmp_path, max_epochs=epochs, callbacks=[SaveAt(step, ckpt)])
    per_epoch = 8 * (N_TRAIN_READABLE // 8)
    assert len(whole.seen) == epochs * per_epoch
    assert all(len(set(whole.seen[e * per_epoch : (e + 1) * per_epoch])) == per_epoch for e in range(epochs))
    saved = torch.load(ckpt, weights_only=True)["loops"]["fit_loop"]
    assert saved["state_dict"]["combined_loader"][0]["num_samples_yielded"] == 24

    rest = Recorder()
    L.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, use_distributed_sampler=False, max_epochs=epochs,
    ).fit(rest, datamodule=dm(), ckpt_path=ckpt)  # fmt: skip
    assert whole.seen[: 8 * step] + rest.seen == whole.seen


# --- GPU decode ------------------------------------------------------------------------------------------


@pytest.fixture
def decode_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """decode_device=cuda with the decoder on the CPU: the seam the GPU path's tests use (no mock of decoding)."""
    monkeypatch.setattr(StreamingDataModule, "decode_on", lambda self: torch.device("cpu"))


def _gpu_dm(shards: Path, tmp_path: Path, workers: int) -> StreamingDataModule:
    dm = StreamingDataModule(
        data_dir=str(shards), cache_dir=str(tmp_path), batch_size=8, num_workers=workers, decode_device="cuda"
    )
    dm.set_input_spec(32, (0.5,) * 3, (0.5,) * 3)
    return dm


def test_gpu_decode_path_runs_on_cpu(local_shards: Path):
    """The batch decoder (nvJPEG on a GPU) with device=cpu: JPEG, grayscale and PNG bytes, with the crops
    the workers draw (SampleTransform, raw), become normalised model-size images; evaluation is deterministic."""
    from vitrain.data.gpu_decode import GpuDecoder, collate_encoded

    train = streaming.StreamingDataset(str(local_shards / "train"))
    sample = streaming.SampleTransform(None, seed=0, raw=True)
    encoded, _ = collate_encoded([sample(train[i], 1) for i in range(len(train))])
    decoder = GpuDecoder(32, (0.5,) * 3, (0.5,) * 3, device="cpu")
    x = decoder(encoded.blobs(), train=True, boxes=encoded.boxes, flips=encoded.flips)
    assert x.shape == (len(train), 3, 32, 32) and x.dtype == torch.float32
    assert x.min() >= -1.0 - 1e-4 and x.max() <= 1.0 + 1e-4
    blobs = encoded.blobs()[:4]
    assert torch.equal(decoder(blobs, train=False), decoder(blobs, train=False)), (
        "eval decode is deterministic"
    )


def test_gpu_decode_crops_are_per_sample_whatever_the_workers(
    local_shards: Path, tmp_path: Path, decode_on_cpu: None
):
    """decode_device=cuda: the workers send each training image's bytes with its crop box and flip,
    `draw_crop` from (seed, epoch, index) and the size in the image's header, collated into an EncodedBatch;
    0 and 2 workers give each sample the same crop (litdata deals the samples to its workers, so the batches
    hold others), and the training process decodes a batch into normalised model-size images."""
    from torchvision.io import decode_image

    from vitrain.data.gpu_decode import EncodedBatch, draw_crop
    from vitrain.data.sampling import sample_seed

    stored = streaming.StreamingDataset(str(local_shards / "train"))
    index_of = {
        hashlib.sha1(stored[i]["image"]).hexdigest(): int(stored[i]["index"]) for i in range(len(stored))
    }
    assert len(index_of) == N_TRAIN_READABLE
    crops: dict[int, dict[int, tuple]] = {}
    for workers in (0, 2):
        dm = _gpu_dm(local_shards, tmp_path, workers)
        dm.setup("fit")
        loader = dm.train_dataloader()
        batches = list(loader)
        crops[workers] = {}
        for encoded, _ in batches:
            assert isinstance(encoded, EncodedBatch) and encoded.boxes.shape == (8, 4)
            for blob, box, flip in zip(encoded.blobs(), encoded.boxes.tolist(), encoded.flips, strict=True):
                index = index_of[hashlib.sha1(blob.numpy().tobytes()).hexdigest()]
                h, w = decode_image(blob).shape[-2:]
                seed = sample_seed(dm.hparams.shuffle_seed, loader.current_epoch, index)
                assert (tuple(box), bool(flip)) == draw_crop(h, w, seed, 0.5)
                crops[workers][index] = (tuple(box), bool(flip))
        x, y = dm.on_before_batch_transfer(batches[0], 0)
        assert x.shape == (8, 3, 32, 32) and x.dtype == torch.float32 and torch.equal(y, batches[0][1])
        assert x.min() >= -1.0 - 1e-4 and x.max() <= 1.0 + 1e-4
    both = crops[0].keys() & crops[2].keys()
    assert len(both) >= N_TRAIN_READABLE - 2 * 8 * 2
    assert all(crops[0][i] == crops[2][i] for i in both)
    assert {flip for _, flip in crops[0].values()} == {True, False}


def test_gpu_decode_mid_epoch_resume_sees_the_same_batches(
    local_shards: Path, tmp_path: Path, decode_on_cpu: None
):
    """decode_device=cuda, 2 workers: a run checkpointed in its second epoch (after 11 of 16 batches) and
    resumed from the checkpoint trains on bitwise the decoded batches the uninterrupted run saw, and the
    resume is announced as exact (no caveat)."""
    ckpt = tmp_path / "mid.ckpt"
    whole = DecodedRecorder()
    _fit(_gpu_dm(local_shards, tmp_path, 2), whole, tmp_path, max_epochs=2, callbacks=[SaveAt(11, ckpt)])
    rest, dm = DecodedRecorder(), _gpu_dm(local_shards, tmp_path, 2)
    L.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, use_distributed_sampler=False, max_epochs=2,
    ).fit(rest, datamodule=dm, ckpt_path=ckpt)  # fmt: skip
    assert dm._gpu_decoder is not None and dm.resume_caveat() is None
    assert len(whole.seen) == 16 and len(rest.seen) == 5
    assert all(torch.equal(a, b) for a, b in zip(whole.seen[11:], rest.seen, strict=True))
    assert whole.seen[0].shape == (8, 3, 32, 32) and not torch.equal(whole.seen[0], whole.seen[8])


def test_gpu_decode_names_a_sample_that_is_no_image(
    local_shards: Path, tmp_path: Path, decode_on_cpu: None, monkeypatch: pytest.MonkeyPatch
):
    """Stored bytes that are no image (shards damaged after `make shards` checked them): the worker that
    draws the crop stops with a one-line DataError naming the sample and the shards."""
    read = streaming.StreamingDataset.__next__
    monkeypatch.setattr(
        streaming.StreamingDataset, "__next__", lambda self: {**read(self), "image": b"\xff\xd8 not a jpeg"}
    )
    dm = _gpu_dm(local_shards, tmp_path, 0)
    dm.setup("fit")
    with pytest.raises(DataError) as err:
        next(iter(dm.train_dataloader()))
    where = re.escape(str(local_shards / "train"))
    assert re.fullmatch(
        rf"cannot read sample \d+ \(label \d\) of {where} \(UnidentifiedImageError: .*\): "
        r"write the shards again with `make shards`",
        str(err.value),
    ), str(err.value)


def test_gpu_decode_names_a_sample_that_does_not_decode(
    local_shards: Path, tmp_path: Path, decode_on_cpu: None, monkeypatch: pytest.MonkeyPatch
):
    """Stored bytes whose header reads but whose pixels do not (a JPEG cut short): the batch decode stops
    with a one-line DataError naming the sample and the shards."""
    buffer = io.BytesIO()
    Image.frombytes("RGB", (120, 90), bytes(range(256)) * 127).save(
        buffer, "JPEG"
    )  # a long scan after the header
    damaged = buffer.getvalue()[: len(buffer.getvalue()) // 2]
    read = streaming.StreamingDataset.__next__

    def one_damaged(self: streaming.StreamingDataset) -> dict:
        item = read(self)
        return {**item, "image": damaged} if item["index"] == 3 else item

    monkeypatch.setattr(streaming.StreamingDataset, "__next__", one_damaged)
    dm = _gpu_dm(local_shards, tmp_path, 0)
    dm.setup("fit")
    batches = iter(dm.train_dataloader())
    where = re.escape(str(local_shards / "train"))
    with pytest.raises(DataError) as err:
        for batch in batches:  # the batch that holds sample 3
            dm.on_before_batch_transfer(batch, 0)
    assert re.fullmatch(
        rf"cannot decode sample 3 of {where} \([^\n]*\): write the shards again with `make shards`",
        str(err.value),
    ), str(err.value)


def test_decode_device_cuda_falls_back_on_cpu(
    local_shards: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    dm = StreamingDataModule(
        data_dir=str(local_shards), cache_dir=str(tmp_path), batch_size=4, decode_device="cuda"
    )
    dm.set_input_spec(32, (0.5,) * 3, (0.5,) * 3)
    with caplog.at_level("INFO"):
        dm.setup("fit")
    if not torch.cuda.is_available():
        assert "decoding on the CPU instead" in caplog.text
        x, _ = next(iter(dm.train_dataloader()))
        assert x.shape == (4, 3, 32, 32)
    with pytest.raises(DataError, match="decode_device='tpu'"):
        StreamingDataModule(data_dir=str(local_shards), cache_dir=str(tmp_path), decode_device="tpu")


def test_gpu_decode_wiring_trains(local_shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """decode_device=cuda end to end with the decoder on the CPU: workers hand over encoded bytes, the
    training process decodes and augments them into model-size batches before the transfer."""
    seen = []
    monkeypatch.setattr(StreamingDataModule, "decode_on", lambda self: torch.device("cpu"))

    class Shapes(Recorder):
        def training_step(self, batch, batch_idx):
            seen.append(tuple(batch[0].shape))
            return (self.w * batch[0].mean()).sum()

    dm = StreamingDataModule(
        data_dir=str(local_shards), cache_dir=str(tmp_path), batch_size=8, num_workers=1, decode_device="cuda"
    )
    dm.set_input_spec(32, (0.5,) * 3, (0.5,) * 3)
    _fit(dm, Shapes(), tmp_path, max_steps=2)
    assert seen == [(8, 3, 32, 32)] * 2


def test_gpu_decode_applies_the_batch_augmentation_or_refuses_it(
    local_shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """With decode_device=cuda, RandAugment and random erasing run on the decoded batch (the in-memory path's
    batch ops); a policy those ops do not have is refused in one line, before any shard is read."""
    monkeypatch.setattr(StreamingDataModule, "decode_on", lambda self: torch.device("cpu"))
    common = {
        "data_dir": str(local_shards),
        "cache_dir": str(tmp_path),
        "batch_size": 8,
        "decode_device": "cuda",
    }
    dm = StreamingDataModule(**common, auto_augment="rand-m9-n2-mstd0.5", re_prob=0.25)
    dm.set_input_spec(32, (0.5,) * 3, (0.5,) * 3)
    dm.setup("fit")
    assert (
        dm._gpu_decoder.augment.auto_augment == "rand-m9-n2-mstd0.5"
        and dm._gpu_decoder.augment.re_prob == 0.25
    )
    with pytest.raises(DataError, match=r"decode_device=cuda the policy runs on the GPU.*decode_device=cpu"):
        StreamingDataModule(**common, auto_augment="rand-m9-mstd0.5-inc1")


def test_batch_size_search_decodes_like_the_run(
    local_shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """`+tune=batch_size` with decode_device=cuda (the decoder on the CPU here): the search's trials get the
    datamodule's decoded batches as the run does, not the encoded bytes its workers hand over."""
    monkeypatch.setattr(StreamingDataModule, "decode_on", lambda self: torch.device("cpu"))
    overrides = [
        *_overrides(str(local_shards), tmp_path),
        "datamodule.decode_device=cuda",
        "+tune=batch_size",
        "tune.batch_size.max_trials=2",
        "tune.batch_size.steps_per_trial=1",
        "tune.batch_size.apply=true",
        "+trainer.limit_train_batches=2",
    ]
    metrics, objects = train(compose_cfg("train", overrides, tmp_path))
    assert [t["batch_size"] for t in objects.batch_size_search["trials"]] == [2, 4]
    assert objects.trainer.global_step == 2 and "test/acc1" in metrics


def test_colour_jitter_only_where_workers_decode(tmp_path: Path):
    """`color_jitter` on shards: the workers' transform (tests/test_image_folder.py), refused in one line with
    the GPU decoder, which has none."""
    with pytest.raises(DataError, match=r"^datamodule\.color_jitter runs in the loader workers") as err:
        StreamingDataModule(
            data_dir=str(tmp_path), cache_dir=str(tmp_path), color_jitter=0.4, decode_device="cuda"
        )
    assert "\n" not in str(err.value)
    with pytest.raises(DataError, match=r"^datamodule\.color_jitter=\[1, 2\]: use null"):
        StreamingDataModule(data_dir=str(tmp_path), cache_dir=str(tmp_path), color_jitter=[1, 2])
    dm = StreamingDataModule(data_dir=str(tmp_path), cache_dir=str(tmp_path), color_jitter=[0.2, 0.2, 0.2])
    assert dm.hparams.color_jitter == [0.2, 0.2, 0.2]
