"""CIFAR-10 and CIFAR-100 sources, cache, datamodules, samplers and device-side augmentation, on tiny
generated data."""

from __future__ import annotations

import errno
import hashlib
import json
import pickle
import random
import socket
import tarfile
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from data_factory import (
    CIFAR100_NAMES,
    CLASSES,
    cifar100_image,
    label_of,
    make_cifar100_python,
    make_class_folders,
    make_python_batches,
    make_targz,
    pattern_image,
)
from vitrain.data.augment import BatchTransform, random_crop_flip, to_model_input
from vitrain.data.datamodules.base import on_device_choice
from vitrain.data.datamodules.cifar import CIFAR10_MEAN, CIFAR10_STD, CIFAR10DataModule
from vitrain.data.readers.cifar import DOWNLOAD_TIMEOUT_S, load_cifar, load_cifar10
from vitrain.data.readers.cifar_spec import CIFAR100
from vitrain.data.sampling import batch_seed, make_sampler, per_process_batch, split_indices, stratified_split
from vitrain.errors import DataError


def _trainer(**kw) -> Trainer:
    opts = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return Trainer(**{**opts, **kw})


def _decoded_files(cache: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in (cache / "cifar10").glob("decoded-*.pt")}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_class_folders(tmp_path_factory.mktemp("folders"), n_per_class_train=4, n_per_class_test=2)


# --- sources ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("ext", ["png", "jpg"])
def test_class_folders_decode(tmp_path: Path, ext: str):
    root = make_class_folders(tmp_path / "data", n_per_class_train=4, n_per_class_test=2, ext=ext)
    d = load_cifar10(root, tmp_path / "cache")
    assert d.train_x.shape == (40, 3, 32, 32) and d.train_x.dtype == torch.uint8
    assert d.test_x.shape == (20, 3, 32, 32) and d.test_y.dtype == torch.int64
    assert d.classes == list(CLASSES)
    assert torch.equal(d.train_y, torch.arange(10).repeat_interleave(4))
    assert torch.equal(label_of(d.train_x), d.train_y) and torch.equal(label_of(d.test_x), d.test_y)
    if ext == "png":  # lossless: exact pixels
        assert torch.equal(d.train_x[5], pattern_image(1, 1))


def test_python_batches_decode(tmp_path: Path):
    batches = make_python_batches(tmp_path / "data", n_per_batch=4, n_test=6)
    from_parent = load_cifar10(tmp_path / "data", tmp_path / "cache")
    from_batches = load_cifar10(batches, tmp_path / "cache")
    for d in (from_parent, from_batches):
        assert d.train_x.shape == (20, 3, 32, 32) and d.train_x.dtype == torch.uint8
        assert d.test_x.shape == (6, 3, 32, 32)
        assert d.classes == list(CLASSES)
        assert torch.equal(d.train_y, torch.arange(20) % 10)
        assert torch.equal(d.train_x[13], pattern_image(3, 13))
        assert torch.equal(label_of(d.test_x), d.test_y)
    assert torch.equal(from_parent.train_x, from_batches.train_x)


def test_folder_source_decoded_once_and_rekeyed_on_change(tmp_path: Path):
    root = make_class_folders(tmp_path / "data", n_per_class_train=2, n_per_class_test=1)
    load_cifar10(root, tmp_path / "cache")
    first = _decoded_files(tmp_path / "cache")
    assert len(first) == 1
    load_cifar10(root, tmp_path / "cache")
    assert _decoded_files(tmp_path / "cache") == first  # not rewritten
    (root / "train" / "cat" / "0009.png").write_bytes((root / "train" / "cat" / "0000.png").read_bytes())
    d = load_cifar10(root, tmp_path / "cache")
    assert len(d.train_y) == 21 and len(_decoded_files(tmp_path / "cache")) == 2


@pytest.mark.parametrize(
    ("layout", "arcname", "name"),
    [
        ("folders", "cifar10-jpeg", "a.tar.gz"),
        ("folders", ".", "b.tgz"),
        ("batches", "cifar-10-batches-py", "cifar-10-python.tar.gz"),
    ],
)
def test_archive_unpacked_and_decoded_once(tmp_path: Path, layout: str, arcname: str, name: str):
    if layout == "folders":
        src = make_class_folders(tmp_path / "src", n_per_class_train=2, n_per_class_test=1, ext="jpg")
        n_train = 20
    else:
        src = make_python_batches(tmp_path / "src", n_per_batch=3, n_test=4)
        n_train = 15
    archive = make_targz(src, tmp_path / name, arcname=arcname)
    cache = tmp_path / "cache"
    d = load_cifar10(archive, cache)
    assert len(d.train_y) == n_train and d.classes == list(CLASSES)
    unpacked = list((cache / "cifar10" / "unpacked").iterdir())
    assert len(unpacked) == 1 and not unpacked[0].name.startswith(".")
    seen = (unpacked[0].stat().st_mtime_ns, _decoded_files(cache))

    again = CIFAR10DataModule(str(archive), str(cache), batch_size=2, val_size=5)
    again.setup("fit")
    assert (unpacked[0].stat().st_mtime_ns, _decoded_files(cache)) == seen
    assert list((cache / "cifar10" / "unpacked").iterdir()) == unpacked
    assert len(again.train_set) + len(again.val_set) == n_train


def test_parent_folder_with_single_unpacked_tree(tmp_path: Path, folders: Path):
    make_class_folders(tmp_path / "parent" / "cifar10", n_per_class_train=1, n_per_class_test=1)
    d = load_cifar10(tmp_path / "parent", tmp_path / "cache")
    assert len(d.train_y) == 10 and len(d.test_y) == 10


# --- errors ----------------------------------------------------------------------------------------


def test_missing_and_empty_data_dir(tmp_path: Path):
    with pytest.raises(DataError, match=r"not found at .*nope: point datamodule.data_dir"):
        load_cifar10(tmp_path / "nope", tmp_path / "cache")
    (tmp_path / "empty").mkdir()  # e.g. left by a failed download: the data is not found, not malformed
    with pytest.raises(DataError, match=r"not found at .*empty: point datamodule.data_dir.*download=true"):
        load_cifar10(tmp_path / "empty", tmp_path / "cache")
    with pytest.raises(DataError, match=r"archive .*nope.tar.gz not found"):
        load_cifar10(tmp_path / "nope.tar.gz", tmp_path / "cache")


def test_empty_or_missing_class_folder(tmp_path: Path):
    root = make_class_folders(tmp_path / "a", n_per_class_train=1, n_per_class_test=1)
    for f in (root / "test" / "dog").iterdir():
        f.unlink()
    with pytest.raises(DataError, match=r"test/dog holds no .* images"):
        load_cifar10(root, tmp_path / "cache")
    (root / "test" / "dog").rmdir()
    with pytest.raises(DataError, match=r"class folder .*test/dog is missing \(train/dog exists\)"):
        load_cifar10(root, tmp_path / "cache")
    for split in ("train", "test"):
        (tmp_path / "b" / split).mkdir(parents=True)
    with pytest.raises(DataError, match=r"train has no class folders"):
        load_cifar10(tmp_path / "b", tmp_path / "cache")


def test_corrupted_archive(tmp_path: Path):
    src = make_class_folders(tmp_path / "src", n_per_class_train=3, n_per_class_test=1)
    archive = make_targz(src, tmp_path / "c.tar.gz", arcname="c")
    data = archive.read_bytes()
    archive.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"cannot unpack .*c.tar.gz .*truncated or corrupted"):
        load_cifar10(archive, tmp_path / "cache")
    assert list((tmp_path / "cache" / "cifar10" / "unpacked").iterdir()) == []  # no half-unpacked folder
    archive.write_bytes(b"this is not a tar file")
    with pytest.raises(DataError, match=r"cannot unpack"):
        load_cifar10(archive, tmp_path / "cache")


def test_an_unpack_stopped_by_ctrl_c_leaves_no_half_copy(tmp_path: Path, monkeypatch):
    """Ctrl-C during the first run's unpack (minutes for ImageNet): the half-unpacked hidden folder went with
    it (it stayed, taking the disk, when the error was not the archive's); the next run unpacks afresh."""
    src = make_class_folders(tmp_path / "src", n_per_class_train=2, n_per_class_test=1, ext="jpg")
    archive = make_targz(src, tmp_path / "a.tar.gz", arcname="a")
    real = tarfile.TarFile.extractall

    def interrupted(self, path, *args, **kwargs):
        for member in self.getmembers()[:5]:
            self.extract(member, path, filter="data")
        raise KeyboardInterrupt

    monkeypatch.setattr(tarfile.TarFile, "extractall", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_cifar10(archive, tmp_path / "cache")
    assert list((tmp_path / "cache" / "cifar10" / "unpacked").iterdir()) == []
    monkeypatch.setattr(tarfile.TarFile, "extractall", real)
    assert len(load_cifar10(archive, tmp_path / "cache").train_y) == 20


def test_corrupted_or_wrong_size_image(tmp_path: Path):
    root = make_class_folders(tmp_path / "a", n_per_class_train=2, n_per_class_test=1)
    bad = root / "train" / "bird" / "0001.png"
    bad.write_bytes(bad.read_bytes()[:40])
    with pytest.raises(DataError, match=r"cannot decode image .*train/bird/0001.png"):
        load_cifar10(root, tmp_path / "cache")
    root = make_class_folders(tmp_path / "b", n_per_class_train=2, n_per_class_test=1)
    make_class_folders(tmp_path / "small", n_per_class_train=1, n_per_class_test=0, classes=["frog"], size=16)
    (root / "test" / "frog" / "0000.png").write_bytes(
        (tmp_path / "small" / "train" / "frog" / "0000.png").read_bytes()
    )
    with pytest.raises(DataError, match=r"image .*test/frog/0000.png has shape 3x16x16 .*needs 3x32x32"):
        load_cifar10(root, tmp_path / "cache")


def test_corrupted_python_batch(tmp_path: Path):
    batches = make_python_batches(tmp_path / "data", n_per_batch=2, n_test=2)
    (batches / "data_batch_3").write_bytes(b"\x80\x02garbage")
    with pytest.raises(DataError, match=r"cannot read .*data_batch_3"):
        load_cifar10(batches, tmp_path / "cache")
    (batches / "data_batch_3").unlink()
    with pytest.raises(DataError, match=r"data_batch_3 is missing"):
        load_cifar10(batches, tmp_path / "cache")


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> list[float | None]:
    """No internet, whatever this machine has: every connection fails at once, as an offline one does (with
    internet the download tests would fetch the data set; behind a firewall that drops packets they would
    wait). Yields the timeout each connection was given."""
    tried: list[float | None] = []

    def unreachable(address, timeout=socket._GLOBAL_DEFAULT_TIMEOUT, *args, **kwargs):  # http.client's call
        tried.append(socket.getdefaulttimeout() if timeout is socket._GLOBAL_DEFAULT_TIMEOUT else timeout)
        raise OSError(errno.ENETUNREACH, "Network is unreachable")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    return tried


def test_download_without_internet_is_a_data_error(tmp_path: Path, offline: list[float | None]):
    """The error says what to do, and no connection could have waited for ever (torchvision's urlopen sets
    no timeout of its own)."""
    before = socket.getdefaulttimeout()
    with pytest.raises(DataError, match=r"downloading CIFAR-10 into .*failed .*download=false"):
        load_cifar10(tmp_path / "dl", tmp_path / "cache", download=True)
    assert offline and all(t == DOWNLOAD_TIMEOUT_S for t in offline), offline  # each try bounded
    assert socket.getdefaulttimeout() == before  # the process's default is left as it was
    assert not (tmp_path / "dl").exists()  # the failed download leaves no folder behind


# --- datamodule ------------------------------------------------------------------------------------


def test_datamodule_splits(folders: Path, tmp_path: Path):
    def make(**kw) -> CIFAR10DataModule:
        dm = CIFAR10DataModule(str(folders), str(tmp_path / "cache"), batch_size=4, val_size=10, **kw)
        dm.setup("fit")
        return dm

    a, b = make(), make()
    assert (len(a.train_set), len(a.val_set), len(a.test_set)) == (30, 10, 20)
    assert a.num_classes == 10 and a.classes == list(CLASSES)
    assert torch.equal(a.val_set.x, b.val_set.x) and torch.equal(a.train_set.y, b.train_set.y)
    # an image is identified by (label, index) = (red, green): train and val share none
    ident = lambda ds: {(int(x[0, 0, 0]), int(x[1, 0, 0])) for x in ds.x}  # noqa: E731
    assert len(ident(a.train_set)) == 30 and ident(a.train_set).isdisjoint(ident(a.val_set))
    assert torch.equal(label_of(a.val_set.x), a.val_set.y)
    assert not torch.equal(make(split_seed=1).val_set.x, a.val_set.x)
    sub = make(train_subset=7)
    # a fixed random sample of the train split (class folders are stored sorted: its first 7 are 3 classes)
    assert len(sub.train_set) == 7 and ident(sub.train_set) <= ident(a.train_set)
    assert torch.equal(make(train_subset=7).train_set.x, sub.train_set.x)
    assert len(set(sub.train_set.y.tolist())) > 3, sub.train_set.y
    assert a.hparams.val_size == 10 and a.hparams.batch_size == 4


def test_split_indices_cover_and_reject_bad_sizes():
    labels = torch.arange(5).repeat(10)  # 5 classes of 10
    train, val = split_indices(labels, 5, seed=0)
    assert sorted(torch.cat([train, val]).tolist()) == list(range(50)) and len(val) == 5
    assert sorted(labels[val].tolist()) == [0, 1, 2, 3, 4]  # one of each class
    assert val.tolist() != sorted(val.tolist())  # in random order: a prefix is a fair sample
    torch.manual_seed(123)  # the global seed must not matter
    assert torch.equal(split_indices(labels, 5, seed=0)[1], val)
    assert not torch.equal(split_indices(labels, 5, seed=1)[1], val)
    with pytest.raises(
        DataError, match=r"datamodule.val_size=46 must be between 1 and 45 images .* 5 classes"
    ):
        split_indices(labels, 46, seed=0)
    # `random`: the carve of checkpoints written before the stratified one, exactly (eval.py repeats it)
    perm = torch.randperm(50, generator=torch.Generator().manual_seed(0))
    train, val = split_indices(labels, 5, seed=0, method="random")
    assert torch.equal(train, perm[5:]) and torch.equal(val, perm[:5])
    with pytest.raises(DataError, match=r"datamodule.val_size=50 must be between 1 and 49"):
        split_indices(labels, 50, seed=0, method="random")
    # a fraction of a few images is one image at least (5 % of 9 is 0.45), either way; 0 is still refused
    for method in ("stratified", "random"):
        assert len(split_indices(labels[:9], 0.05, seed=0, method=method)[1]) == 1
        with pytest.raises(DataError, match=r"datamodule.val_size=0.0 must be between 1 and"):
            split_indices(labels[:9], 0.0, seed=0, method=method)


def test_the_carved_validation_split_holds_every_class_in_proportion():
    """A photo folder's classes are rarely balanced: at the folder default of 5 %, a random carve left a class
    of 20 images without validation images one time in three (its accuracy unmeasured). Each class gets its
    share (largest remainders), keeps a training image, and the carve is the same every time."""
    sizes = {0: 500, 1: 20, 2: 20, 3: 20, 4: 3, 5: 1}
    labels = [c for c, n in sizes.items() for _ in range(n)]
    random.Random(0).shuffle(labels)
    train, val = stratified_split(labels, 0.05, seed=0)
    assert len(val) == round(0.05 * len(labels)) == 28
    assert sorted(train + val) == list(range(len(labels))) and val == sorted(val)
    per_class = Counter(labels[i] for i in val)
    assert per_class == {0: 25, 1: 1, 2: 1, 3: 1}, per_class
    for seed in range(20):  # whichever images: every class of 20 has its one
        assert Counter(labels[i] for i in stratified_split(labels, 0.05, seed)[1]) == per_class
    _, most = stratified_split(labels, len(labels) - len(sizes), seed=0)
    assert Counter(labels[i] for i in most) == {c: n - 1 for c, n in sizes.items() if n > 1}  # one left each
    with pytest.raises(DataError, match=r"--val-size=559 must be between 1 and 558"):
        stratified_split(labels, len(labels) - len(sizes) + 1, seed=0, key="--val-size")


def test_loaders_fetch_whole_batches(folders: Path, tmp_path: Path):
    dm = CIFAR10DataModule(
        str(folders), str(tmp_path / "cache"), batch_size=8, eval_batch_size=6, val_size=10
    )
    dm.setup("fit")
    train = list(dm.train_dataloader())
    assert len(train) == 3  # 30 // 8, last incomplete batch dropped
    # each training batch carries the seed of its augmentation: (shuffle seed, epoch, rank, batch index)
    assert [seeded.seed for seeded, _ in train] == [batch_seed(0, 0, 0, i) for i in range(3)]
    x, y = train[0][0].x, train[0][1]
    assert x.shape == (8, 3, 32, 32) and x.dtype == torch.uint8 and y.dtype == torch.int64
    assert torch.equal(label_of(x), y)
    val = list(dm.val_dataloader())
    assert [len(b[1]) for b in val] == [6, 4]
    assert torch.equal(torch.cat([b[0] for b in val]), dm.val_set.x)  # sequential, complete
    assert sum(len(b[1]) for b in dm.test_dataloader()) == 20


def test_global_batch_split_across_processes(folders: Path, tmp_path: Path):
    assert per_process_batch(128, 4) == 32 and per_process_batch(7, 1) == 7
    with pytest.raises(DataError) as e:
        per_process_batch(10, 4)
    assert str(e.value) == (
        "datamodule.batch_size=10 does not divide across 4 processes "
        "(trainer.devices x trainer.num_nodes): use a multiple of 4"
    )
    trainer = _trainer(devices=4, strategy="ddp")
    dm = CIFAR10DataModule(
        str(folders), str(tmp_path / "cache"), batch_size=8, eval_batch_size=12, val_size=10
    )
    dm.trainer = trainer
    dm.setup("fit")
    assert dm.train_dataloader().batch_size == 2 and dm.val_dataloader().batch_size == 3
    dm = CIFAR10DataModule(
        str(folders), str(tmp_path / "cache"), batch_size=8, eval_batch_size=10, val_size=10
    )
    dm.trainer = trainer
    with pytest.raises(DataError, match=r"datamodule.eval_batch_size=10 does not divide across 4 processes"):
        dm.setup("fit")


def test_eval_sampler_counts_every_sample_once():
    data = list(range(5))
    shards = [list(make_sampler(data, train=False, num_replicas=3, rank=r, seed=0)) for r in range(3)]
    assert sorted(i for s in shards for i in s) == data
    train = [make_sampler(data, train=True, num_replicas=3, rank=r, seed=0) for r in range(3)]
    for s in train:
        s.set_epoch(1)
    train_shards = [list(s) for s in train]
    assert all(len(s) == 1 for s in train_shards)  # drop_last: equal shards, no repeats
    assert len({i for s in train_shards for i in s}) == 3


# --- augmentation ----------------------------------------------------------------------------------


def _coordinates(b: int, h: int = 32) -> torch.Tensor:
    """uint8 [b,3,h,h] whose channel 0 is row+1 and channel 1 is column+1 (0 only in padding)."""
    r = torch.arange(1, h + 1, dtype=torch.uint8)
    x = torch.stack(
        [r[:, None].expand(h, h), r[None, :].expand(h, h), torch.full((h, h), 7, dtype=torch.uint8)]
    )
    return x.expand(b, 3, h, h).clone()


def _crop_shift(sample: torch.Tensor) -> tuple[int, int]:
    """Where a cropped sample's centre pixel came from, as (dy, dx) relative to the centre."""
    return int(sample[0, 16, 16]) - 17, int(sample[1, 16, 16]) - 17


def test_random_crop_shifts_content():
    torch.manual_seed(0)
    x = _coordinates(64)
    out = random_crop_flip(x, padding=4, flip_p=0.0)
    assert out.shape == x.shape and out.dtype == torch.uint8
    padded = torch.nn.functional.pad(x, (4, 4, 4, 4))
    shifts = set()
    for b in range(64):
        dy, dx = _crop_shift(out[b])
        assert -4 <= dy <= 4 and -4 <= dx <= 4
        assert torch.equal(out[b], padded[b, :, 4 + dy : 4 + dy + 32, 4 + dx : 4 + dx + 32])
        shifts.add((dy, dx))
    assert len(shifts) > 10 and any(dy == -4 for dy, _ in shifts) and any(dx == 4 for _, dx in shifts)


def test_random_hflip_some_not_all():
    torch.manual_seed(0)
    x = _coordinates(64)
    out = random_crop_flip(x, padding=0, flip_p=0.5)
    flipped = torch.tensor([torch.equal(o, i.flip(-1)) for o, i in zip(out, x, strict=True)])
    kept = torch.tensor([torch.equal(o, i) for o, i in zip(out, x, strict=True)])
    assert torch.all(flipped ^ kept) and 10 < int(flipped.sum()) < 54


def test_crop_then_flip_matches_torchvision_order():
    """Each sample equals torchvision's RandomCrop(padding) then RandomHorizontalFlip on that image."""
    torch.manual_seed(1)
    x = _coordinates(64)
    x[:, 2] = torch.randint(1, 255, (64, 32, 32), dtype=torch.uint8)  # content that a wrong flip would show
    out = random_crop_flip(x, padding=3, flip_p=0.5)
    padded = torch.nn.functional.pad(x, (3, 3, 3, 3))
    flips = 0
    for b in range(64):
        flipped = int(out[b, 1, 16, 15]) > int(out[b, 1, 16, 16])  # columns count down: mirrored
        centre = out[b].flip(-1) if flipped else out[b]
        dy, dx = _crop_shift(centre)
        assert torch.equal(centre, padded[b, :, 3 + dy : 3 + dy + 32, 3 + dx : 3 + dx + 32]), b
        flips += flipped
    assert 10 < flips < 54


def test_normalise_and_resize():
    x = torch.full((2, 3, 32, 32), 51, dtype=torch.uint8)
    out = to_model_input(x, 32, mean=(0.2, 0.1, 0.0), std=(0.5, 0.25, 2.0))
    assert out.dtype == torch.float32
    assert torch.allclose(out[:, 0], torch.tensor(0.0), atol=1e-6)
    assert torch.allclose(out[:, 1], torch.tensor(0.4), atol=1e-6)
    assert torch.allclose(out[:, 2], torch.tensor(0.1), atol=1e-6)
    big = to_model_input(x, 48, mean=(0.0,) * 3, std=(1.0,) * 3)
    assert big.shape == (2, 3, 48, 48) and torch.allclose(big, torch.tensor(0.2), atol=1e-6)


def test_batch_transform_is_reproducible():
    t = BatchTransform(32, CIFAR10_MEAN, CIFAR10_STD)
    x = _coordinates(16)
    torch.manual_seed(5)
    a = t(x, train=True)
    torch.manual_seed(5)
    assert torch.equal(a, t(x, train=True))
    assert torch.equal(t(x, train=False), to_model_input(x, 32, CIFAR10_MEAN, CIFAR10_STD))


def test_on_after_batch_transfer_augments_only_in_training(folders: Path, tmp_path: Path):
    dm = CIFAR10DataModule(str(folders), str(tmp_path / "cache"), batch_size=8, val_size=10)
    x, y = _coordinates(32), torch.arange(32)
    plain = to_model_input(x, 32, CIFAR10_MEAN, CIFAR10_STD)
    out, y_out = dm.on_after_batch_transfer((x, y), 0)  # no trainer: evaluation path
    assert torch.equal(out, plain) and y_out is y
    dm.trainer = _trainer(devices=1)
    dm.trainer.training = True
    torch.manual_seed(0)
    out, _ = dm.on_after_batch_transfer((x, y), 0)
    assert out.shape == plain.shape and out.dtype == torch.float32 and not torch.equal(out, plain)
    dm.trainer.validating = True
    assert torch.equal(dm.on_after_batch_transfer((x, y), 0)[0], plain)


def test_input_spec_precedence(folders: Path, tmp_path: Path):
    dm = CIFAR10DataModule(str(folders), str(tmp_path / "cache"))
    assert (dm.img_size, dm.mean, dm.std) == (32, CIFAR10_MEAN, CIFAR10_STD)
    dm.set_input_spec(224, (0.5, 0.5, 0.5), [0.5, 0.5, 0.5])
    assert (dm.img_size, dm.mean, dm.std) == (224, (0.5,) * 3, (0.5,) * 3)
    out, _ = dm.on_after_batch_transfer((_coordinates(2), torch.zeros(2)), 0)
    assert out.shape == (2, 3, 224, 224)
    dm = CIFAR10DataModule(str(folders), str(tmp_path / "cache"), img_size=64, mean=[0.1, 0.2, 0.3])
    dm.set_input_spec(224, (0.5, 0.5, 0.5), (0.4, 0.4, 0.4))
    assert (dm.img_size, dm.mean, dm.std) == (64, (0.1, 0.2, 0.3), (0.4, 0.4, 0.4))


class _Probe(LightningModule):
    """Records what the steps receive: the datamodule's hooks must hand over float model inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(3 * 32 * 32, 10)
        self.seen: list[tuple[str, torch.dtype, tuple[int, ...]]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append(("train", x.dtype, tuple(x.shape)))
        return torch.nn.functional.cross_entropy(self.net(x.flatten(1)), y)

    def validation_step(self, batch, batch_idx):
        self.seen.append(("val", batch[0].dtype, tuple(batch[0].shape)))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_fit_with_trainer(folders: Path, tmp_path: Path):
    dm = CIFAR10DataModule(str(folders), str(tmp_path / "cache"), batch_size=8, val_size=10)
    probe = _Probe()
    _trainer(devices=1, max_epochs=1, use_distributed_sampler=False, num_sanity_val_steps=0).fit(probe, dm)
    assert probe.seen.count(("train", torch.float32, (8, 3, 32, 32))) == 3
    val = [shape for stage, _, shape in probe.seen if stage == "val"]
    assert val == [(8, 3, 32, 32), (2, 3, 32, 32)]


def test_a_seeded_batch_transform_is_a_function_of_its_seed_alone():
    """With the batch's seed, every random op (crop, flip, TrivialAugment, erasing and its noise) draws from
    generators seeded by it: the same seed, the same batch, whatever torch's global generators hold, which
    it leaves untouched; another seed, another batch. Evaluation ignores it."""
    t = BatchTransform(32, CIFAR10_MEAN, CIFAR10_STD, auto_augment="trivial", re_prob=0.5)
    x = _coordinates(16)
    torch.manual_seed(1)
    state = torch.get_rng_state()
    a = t(x, train=True, seed=7)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(2)
    assert torch.equal(t(x, train=True, seed=7), a)
    assert not torch.equal(t(x, train=True, seed=8), a)
    assert torch.equal(t(x, train=False, seed=7), to_model_input(x, 32, CIFAR10_MEAN, CIFAR10_STD))


class _Digests(LightningModule):
    """Digests of the model input each training step receives; each step also draws from torch's global
    generator (as dropout or mixup would), which must not change the batches."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(3 * 32 * 32, 10)
        self.seen: list[str] = []
        self.ahead: set[threading.Thread] = set()  # the threads that augmented ahead during the steps

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append(hashlib.sha1(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest())
        self.ahead |= {t for t in threading.enumerate() if t.name == "augment-ahead"}
        noise = torch.rand(1)
        return torch.nn.functional.cross_entropy(self.net(x.flatten(1)), y) * noise

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _SaveAt(Callback):
    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: Trainer, *args) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def test_in_memory_batches_augmented_ahead_inline_or_resumed_are_the_same(folders: Path, tmp_path: Path):
    """`augment_ahead=2`: a thread slices and augments the in-memory training batches (crop, flip,
    TrivialAugment, random erasing) ahead of the training thread, in a real fit; the steps get, bit for bit,
    the batches the training thread makes itself (`augment_ahead=0`, the default). Stopped
    mid-epoch and resumed by a plain Trainer, with nothing restoring the global generators, the run gets the
    rest of those batches: each batch's random ops are seeded by (seed, epoch, rank, batch index)."""

    def fit(ahead: int, callbacks: list[Callback] | None = None, ckpt_path: Path | None = None) -> _Digests:
        dm = CIFAR10DataModule(
            str(folders), str(tmp_path / "cache"), batch_size=8, val_size=10, augment_ahead=ahead,
            auto_augment="trivial", re_prob=0.5, shuffle_seed=3,
        )  # fmt: skip
        model = _Digests()
        trainer = _trainer(
            devices=1, max_epochs=2, use_distributed_sampler=False, limit_val_batches=0, callbacks=callbacks
        )
        trainer.fit(model, dm, ckpt_path=ckpt_path)
        assert (trainer.train_dataloader.ahead is not None) == (ahead > 0)
        return model

    before = {t for t in threading.enumerate() if t.name == "augment-ahead"}  # none, unless another test's
    torch.manual_seed(0)
    inline = fit(0)
    torch.manual_seed(1)  # the global generators do not matter
    ckpt = tmp_path / "mid.ckpt"
    whole = fit(2, callbacks=[_SaveAt(4, ckpt)])
    assert len(inline.seen) == 6 and len(set(inline.seen)) == 6  # 2 epochs of 3 batches, all different
    assert whole.seen == inline.seen
    assert whole.ahead - before and not inline.ahead - before
    torch.manual_seed(2)
    rest = fit(2, ckpt_path=ckpt)
    assert rest.seen == whole.seen[4:]
    for bad in (-1, "auto", True):
        with pytest.raises(
            DataError, match=r"augment_ahead=.* must be a whole number of batches, at least 0"
        ):
            CIFAR10DataModule(str(folders), str(tmp_path / "cache"), augment_ahead=bad)


# --- real data -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_cifar10(real_cifar10_cache: tuple[Path, Path]):
    cache, archive = real_cifar10_cache
    dm = CIFAR10DataModule(str(archive), str(cache))
    dm.prepare_data()
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (45000, 5000, 10000)
    assert dm.classes == list(CLASSES) and dm.num_classes == 10
    labels = torch.cat([dm.train_set.y, dm.val_set.y])
    assert torch.equal(torch.bincount(labels), torch.full((10,), 5000))
    assert torch.equal(torch.bincount(dm.test_set.y), torch.full((10,), 1000))
    x = next(iter(dm.train_dataloader()))[0].x
    assert x.shape == (128, 3, 32, 32) and x.dtype == torch.uint8
    assert 80 < x.float().mean() < 160  # real photos, not blank decodes


# --- CIFAR-100 ---------------------------------------------------------------------------------------


def test_cifar100_python_format_and_class_folders(tmp_path: Path):
    """torchvision's cifar-100-python pickles: 100 fine classes named by the meta file, each image kept with
    its fine label; the same data as class folders decodes to the same tensors and names."""
    from torchvision.io import encode_png

    batches = make_cifar100_python(tmp_path / "py", n_train_per_class=2, n_test_per_class=1)
    d = load_cifar(tmp_path / "py", tmp_path / "cache", CIFAR100)
    assert d.classes == list(CIFAR100_NAMES) and d.train_x.shape == (200, 3, 32, 32) and len(d.test_y) == 100
    assert torch.equal(d.train_x[:, 0, 0, 0].long(), 20 + 2 * d.train_y)  # red encodes the label
    assert sorted(d.train_y.tolist()) == sorted(list(range(100)) * 2)
    assert list((tmp_path / "cache" / "cifar100").glob("decoded-*.pt"))

    folders = tmp_path / "folders"
    for split, x, y in (("train", d.train_x, d.train_y), ("test", d.test_x, d.test_y)):
        for i, (img, label) in enumerate(zip(x, y.tolist(), strict=True)):
            out = folders / split / CIFAR100_NAMES[label]
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{i:04d}.png").write_bytes(encode_png(img).numpy().tobytes())
    f = load_cifar(folders, tmp_path / "cache", CIFAR100)
    assert f.classes == d.classes and len(f.train_y) == 200
    assert torch.equal(f.train_x[:, 0, 0, 0].long(), 20 + 2 * f.train_y)
    assert torch.equal(f.test_x[f.test_y.argsort()], d.test_x[d.test_y.argsort()])

    (batches / "meta").unlink()
    with pytest.raises(DataError, match=r"meta is missing \(it holds the class names\)"):
        load_cifar(batches, tmp_path / "cache2", CIFAR100)
    with pytest.raises(DataError, match=r"CIFAR-100 not found at .*cifar-100-python folder"):
        load_cifar(tmp_path / "nope", tmp_path / "cache", CIFAR100)
    assert cifar100_image(99, 0)[0, 0, 0] == 218


def test_cifar100_download_without_internet_is_one_line(tmp_path: Path, offline: list[float | None]):
    """download=true keeps torchvision's real CIFAR100 download; without a network it fails in one line."""
    with pytest.raises(
        DataError, match=r"downloading CIFAR-100 into .*failed .*cifar-100-python.tar.gz"
    ) as e:
        load_cifar(tmp_path / "dl", tmp_path / "cache", CIFAR100, download=True)
    assert "\n" not in str(e.value) and offline  # it did try to download


def test_cifar100_trains_with_a_100_class_head(tmp_path: Path):
    """datamodule=cifar100 on the in-memory path: the model's head has 100 outputs, the checkpoint keeps the
    meta file's fine class names, CIFAR-100's own normalisation is used."""
    from helpers import compose_cfg, tiny_overrides
    from vitrain.data.datamodules.cifar import CIFAR100_MEAN, CIFAR100DataModule
    from vitrain.tasks.training import train

    make_cifar100_python(tmp_path / "data", n_train_per_class=2, n_test_per_class=1)
    overrides = [
        *tiny_overrides(tmp_path / "data", tmp_path / "cache"),
        "datamodule=cifar100",
        "datamodule.val_size=20",
        "+trainer.limit_train_batches=3",
        "test=false",
        "logger=csv",
    ]
    metrics, objects = train(compose_cfg("train", overrides, tmp_path / "run"))
    dm, model = objects.datamodule, objects.model
    assert isinstance(dm, CIFAR100DataModule) and dm.num_classes == 100 and dm.mean == CIFAR100_MEAN
    assert model.net.head.out_features == 100 and objects.trainer.global_step == 3
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (180, 20, 100)
    assert "val/acc1" in metrics
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["class_names"] == list(CIFAR100_NAMES)
    assert ckpt["run_config"]["model"]["net"]["num_classes"] == 100


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_cifar100_trains_on_two_processes(tmp_path: Path, strategy: str):
    """datamodule=cifar100 under DDP and FSDP x2: 180 training images split over the ranks (2 steps of a
    global 8), the 20 validation images evaluated once each (the report's count), 100-class head."""
    from helpers import run_cli, tiny_overrides

    make_cifar100_python(tmp_path / "data", n_train_per_class=2, n_test_per_class=1)
    run = tmp_path / "run"
    args = [
        *tiny_overrides(tmp_path / "data", tmp_path / "cache"),
        "datamodule=cifar100",
        "datamodule.val_size=20",
        f"trainer={strategy}",
        "trainer.devices=2",
        "+trainer.limit_train_batches=2",
        "test=false",
        "logger=csv",
        f"hydra.run.dir={run}",
    ]
    done = run_cli("train.py", args, timeout=280)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    report = json.loads((run / "report.json").read_text())
    assert report["world_size"] == 2 and report["global_step"] == 2
    assert report["data"]["num_classes"] == 100 and report["data"]["images"]["val"] == 20


def test_data_on_device_choice():
    """auto holds in-memory data on the GPU when it takes at most a tenth of it (and half its free memory) and
    no loader workers are asked for; true refuses in one line what cannot be done."""
    gib = 2**30
    assert on_device_choice("auto", 180 * 2**20, free=70 * gib, total=80 * gib, workers=0) is True
    assert on_device_choice("auto", 180 * 2**20, free=70 * gib, total=80 * gib, workers=2) is False
    assert on_device_choice("auto", 9 * gib, free=70 * gib, total=80 * gib, workers=0) is False  # > a tenth
    assert on_device_choice("auto", 1 * gib, free=1 * gib, total=80 * gib, workers=0) is False  # > free / 2
    assert on_device_choice(True, 9 * gib, free=70 * gib, total=80 * gib, workers=0) is True
    with pytest.raises(DataError, match=r"^datamodule.data_on_device=true with datamodule.num_workers=2: "):
        on_device_choice(True, 1, free=70 * gib, total=80 * gib, workers=2)
    with pytest.raises(
        DataError, match=r"the in-memory images take 40.0 GB, more than half of the GPU's 70.0"
    ):
        on_device_choice(True, 40 * gib, free=70 * gib, total=80 * gib, workers=0)


def test_data_on_device_stays_on_the_host_without_a_gpu(folders: Path, tmp_path: Path):
    dm = CIFAR10DataModule(str(folders), str(tmp_path / "cache"), batch_size=8, val_size=10)
    dm.trainer = _trainer(devices=1)
    dm.setup("fit")
    assert dm.data_device(dm.train_set) is None  # auto on a CPU run
    assert dm.train_dataloader().dataset is dm.train_set
    dm.hparams.data_on_device = True
    with pytest.raises(
        DataError, match=r"^datamodule.data_on_device=true needs a GPU to train on; this run "
    ):
        dm.train_dataloader()
    dm.hparams.data_on_device = "gpu"
    with pytest.raises(DataError, match=r"^datamodule.data_on_device='gpu' must be true, false or auto$"):
        dm.val_dataloader()


def test_data_held_on_a_device_is_sliced_there(
    folders: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The loader of data held on a device (the meta device stands in for a GPU here; bench/gpu_check.py
    `data_on_device` compares the batches with the host loader's on a real one): the dataset copied there
    once, batches sliced there, no workers and no pinning; loader workers are given the host tensors only."""
    dm = CIFAR10DataModule(str(folders), str(tmp_path / "cache"), batch_size=8, val_size=10, num_workers=0)
    dm.trainer = _trainer(devices=1)
    dm.setup("fit")
    host = [y for _, y in dm.train_dataloader()]
    meta = torch.device("meta")
    monkeypatch.setattr(dm, "data_device", lambda dataset: meta)
    monkeypatch.setattr(dm, "pin_memory", lambda: True)
    loader = dm.train_dataloader()
    assert loader.num_workers == 0 and loader.pin_memory is False
    assert loader.dataset is dm.train_set.to(meta) and loader.dataset.x.device == meta
    assert dm.train_set.copied_to(meta) and not dm.val_set.copied_to(meta)
    batches = list(loader)
    assert [x.x.device for x, _ in batches] == [meta] * len(host)
    assert [tuple(x.x.shape) for x, _ in batches] == [(8, 3, 32, 32)] * len(host)
    clone = pickle.loads(pickle.dumps(dm.train_set))
    assert clone._copies == {} and torch.equal(clone.x, dm.train_set.x)


def test_a_limit_that_scores_a_class_sorted_prefix_is_named(
    folders: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """`trainer.limit_test_batches` takes the first batches of the test split, which is stored sorted by class:
    a one-line warning says how many classes the scored images hold. The carved validation split (random
    order), a limit that covers the split, and no limit say nothing."""
    from vitrain.data.sampling import partial_pass_note

    dm = CIFAR10DataModule(str(folders), str(tmp_path / "cache"), batch_size=4, val_size=10)
    dm.trainer = _trainer(devices=1, limit_test_batches=1, limit_val_batches=1)
    dm.setup("fit")
    assert torch.equal(dm.test_set.y, dm.test_set.y.sort().values)  # the folders' order
    with caplog.at_level("WARNING", logger="vitrain.data.datamodules.base"):
        batch = next(iter(dm.test_dataloader()))
        dm.val_dataloader()
    warned = [r.getMessage() for r in caplog.records if r.name == "vitrain.data.datamodules.base"]
    held = len(set(batch[1].tolist()))
    assert warned == [
        f"trainer.limit_test_batches=1 scores the first 4 of the 20 test images, which hold {held} of its 10 "
        "classes (the split is stored sorted by class): its test figures are not the split's; leave the limit "
        "null for the whole split"
    ]
    labels = dm.test_set.y
    assert partial_pass_note("test", labels, None, 4, 1) is None
    assert partial_pass_note("test", labels, 5, 4, 1) is None  # 20 images: the whole split
    assert partial_pass_note("test", labels, 1.0, 4, 1) is None
    assert "the first 8 of the 20" in partial_pass_note("test", labels, 0.5, 4, 1)  # 2 of 5 batches
    assert "the first 16 of the 20" in partial_pass_note("test", labels, 2, 4, 2)  # 2 batches on 2 ranks
    assert partial_pass_note("val", dm.val_set.y, 1, 4, 1) is None  # random order: a sample
    assert partial_pass_note("test", None, 1, 4, 1) is None  # labels unknown (streaming)


def test_test_subset_is_a_fixed_random_sample_of_the_test_split(folders: Path, tmp_path: Path):
    """`datamodule.test_subset`: N test images drawn once with `split_seed` (the same every run), in their
    stored order: they span the classes where the first N of a class-sorted split would not. A count at or
    above the split's size keeps it whole; below 1 is refused in one line; streaming shards refuse it."""
    from vitrain.data.datamodules.streaming import StreamingDataModule

    def make(**kw) -> CIFAR10DataModule:
        dm = CIFAR10DataModule(str(folders), str(tmp_path / "cache"), batch_size=4, val_size=10, **kw)
        dm.setup("fit")
        return dm

    whole, a, b = make(), make(test_subset=8), make(test_subset=8)
    expected = torch.randperm(20, generator=torch.Generator().manual_seed(0))[:8].sort().values
    assert torch.equal(a.test_set.x, whole.test_set.x[expected]) and torch.equal(a.test_set.y, b.test_set.y)
    assert len(set(a.test_set.y.tolist())) > len(set(whole.test_set.y[:8].tolist()))
    assert not torch.equal(make(test_subset=8, split_seed=1).test_set.y, a.test_set.y)
    assert torch.equal(make(test_subset=50).test_set.x, whole.test_set.x)
    with pytest.raises(DataError, match=r"^datamodule.test_subset=0 must be at least 1 \(or null for all\)$"):
        make(test_subset=0)
    with pytest.raises(DataError, match=r"train_subset and test_subset do not apply to streaming shards"):
        StreamingDataModule.keep(whole.test_set, [0])
