"""datamodule=image_folder: a class-folder tree (or an archive of one) of real CIFAR-10 JPEGs re-encoded at
random sizes, with a grayscale JPEG, an RGBA PNG, a palette PNG, a CMYK JPEG and a corrupt file; training on
1 process and 2 DDP processes with exact evaluation on an odd split, mid-epoch resume of the worker loader,
the model's head following the data, class names in the checkpoint, per-class accuracy in eval, and the
one-line errors."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import lightning as L
import pytest
import torch
from PIL import Image

from helpers import ROOT, TINY_VIT, Recorder, compose_cfg, fails_in_process, run_cli
from vitrain.data.datamodules import image_folder
from vitrain.data.datamodules.image_folder import ImageFolderDataModule
from vitrain.errors import DataError
from vitrain.tasks.training import train

CLASSES = ("bird", "cat", "ship")  # a subset of CIFAR-10's, in label order
N_TRAIN = 20  # per class
N_VAL = 3  # per class: 9 validation images (odd, for 2 ranks)
RUN_TIMEOUT = 300


def _members(archive: Path) -> dict[str, list[bytes]]:
    """The first JPEGs of CLASSES from the real CIFAR-10 archive's train/ (read, not unpacked)."""
    want = {cls: [] for cls in CLASSES}
    with tarfile.open(archive) as tf:
        for m in tf:
            parts = m.name.split("/")
            if (
                m.isfile()
                and parts[0] == "train"
                and parts[1] in want
                and len(want[parts[1]]) < N_TRAIN + N_VAL
            ):
                want[parts[1]].append(tf.extractfile(m).read())
            if all(len(v) == N_TRAIN + N_VAL for v in want.values()):
                break
    return want


@pytest.fixture(scope="session")
def photos(real_cifar10_cache, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """train/ + val/ of 3 classes: CIFAR-10 JPEGs resized to 40..160 px per side (JPEG, PNG, WebP), plus in
    train a grayscale JPEG, an RGBA PNG, a palette PNG and a CMYK JPEG; no corrupt file (see `broken`)."""
    _, archive = real_cifar10_cache
    root = tmp_path_factory.mktemp("photos") / "photos"
    gen = torch.Generator().manual_seed(0)
    for label, (cls, blobs) in enumerate(_members(archive).items()):
        for i, blob in enumerate(blobs):
            split = "train" if i < N_TRAIN else "val"
            d = root / split / cls
            d.mkdir(parents=True, exist_ok=True)
            h, w = (int(v) for v in torch.randint(40, 161, (2,), generator=gen))
            img = Image.open(io.BytesIO(blob)).convert("RGB").resize((w, h))
            fmt = ("JPEG", "PNG", "WEBP")[i % 3] if split == "train" else "JPEG"
            img.save(d / f"{i:03d}.{fmt.lower()}", fmt)
        first = Image.open(io.BytesIO(blobs[0]))
        mode, fmt = (("L", "JPEG"), ("RGBA", "PNG"), ("P", "PNG"))[label]
        first.convert(mode).resize((57, 93)).save(root / "train" / cls / f"odd-mode.{fmt.lower()}", fmt)
    Image.open(io.BytesIO(blobs[1])).convert("CMYK").save(root / "train" / CLASSES[0] / "cmyk.jpg", "JPEG")
    return root


N_TRAIN_ALL = 3 * (N_TRAIN + 1) + 1  # + one odd mode per class + the CMYK JPEG
N_VAL_ALL = 3 * N_VAL


def _overrides(data_dir: Path | str, cache: Path, batch_size: int = 8) -> list[str]:
    return [
        *TINY_VIT,
        "datamodule=image_folder",
        f"datamodule.data_dir={data_dir}",
        f"datamodule.cache_dir={cache}",
        f"datamodule.batch_size={batch_size}",
        "datamodule.eval_batch_size=4",
        "datamodule.num_workers=1",
        "datamodule.in_memory=false",  # the worker path; in memory: tests/test_in_memory.py
        "trainer.accelerator=cpu",
        "trainer.precision=32-true",
        "trainer.max_epochs=1",
        "trainer.log_every_n_steps=1",
        "extras.print_config=false",
        "logger=csv",
    ]


def test_trains_one_process_then_eval_per_class(photos: Path, tmp_path: Path, capsys: pytest.CaptureFixture):
    """The head follows the data (3 classes, no num_classes given); the checkpoint keeps the class names;
    eval prints and writes per-class accuracy; a checkpoint meets data with other classes: one line."""
    from vitrain.checkpoints import CheckpointError
    from vitrain.tasks.evaluation import evaluate

    cfg = compose_cfg("train", [*_overrides(photos, tmp_path), "+trainer.limit_train_batches=3"], tmp_path)
    metrics, objects = train(cfg)
    assert objects.trainer.global_step == 3 and "val/acc1" in metrics
    assert objects.model.net.head.out_features == 3
    dm = objects.datamodule
    assert (len(dm.train_set), len(dm.val_set)) == (N_TRAIN_ALL, N_VAL_ALL)
    last = tmp_path / "checkpoints" / "last.ckpt"
    ckpt = torch.load(last, weights_only=True)
    assert ckpt["class_names"] == list(CLASSES)
    assert ckpt["run_config"]["model"]["net"]["num_classes"] == 3

    evaluated, out = evaluate(compose_cfg("eval", [f"ckpt_path={last}", "split=val"], tmp_path / "eval"))
    written = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert set(written["per_class_acc"]) == set(CLASSES) == set(out.per_class_acc)
    # the per-class accuracies are those of the same predictions: their mean over 3 equal classes is acc1
    mean = sum(written["per_class_acc"].values()) / 3
    assert mean == pytest.approx(evaluated["val/acc1"], abs=1e-6)
    printed = capsys.readouterr().out
    assert all(f"│ {cls} " in printed for cls in CLASSES)

    other = tmp_path / "other"
    shutil.copytree(photos, other)
    for split in ("train", "val"):
        shutil.copytree(other / split / "cat", other / split / "dog")
    with pytest.raises(CheckpointError, match=r"trained on other classes \(3 classes, the data has 4\)"):
        evaluate(compose_cfg("eval", [f"ckpt_path={last}", f"datamodule.data_dir={other}"], tmp_path / "e2"))


def test_archive_is_unpacked_once_and_val_carved(photos: Path, tmp_path: Path):
    """A .tar.gz of a tree with only train/: unpacked once into the cache, validation carved from train."""
    archive = tmp_path / "mine.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(photos / "train", arcname="mine/train")
    dm = ImageFolderDataModule(
        str(archive), str(tmp_path / "cache"), batch_size=4, val_size=0.2, in_memory=False
    )
    assert dm.classes == list(CLASSES)
    dm.setup("fit")
    assert len(dm.train_set) + len(dm.val_set) == N_TRAIN_ALL and len(dm.val_set) == round(0.2 * N_TRAIN_ALL)
    assert dm.test_set.files == dm.val_set.files
    unpacked = list((tmp_path / "cache" / "unpacked").iterdir())
    assert len(unpacked) == 1 and ImageFolderDataModule(
        str(archive), str(tmp_path / "cache")
    ).root().is_relative_to(unpacked[0])
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 3, 224, 224) and x.dtype == torch.float32 and y.dtype == torch.long


def _tree(tmp_path: Path, photos: Path) -> Path:
    root = tmp_path / "tree"
    shutil.copytree(photos, root)
    return root


def _classes_and_setup(root: Path, tmp_path: Path, **kwargs) -> ImageFolderDataModule:
    dm = ImageFolderDataModule(
        str(root), str(tmp_path / "cache"), batch_size=4, **{"in_memory": False, **kwargs}
    )
    dm.classes  # noqa: B018 - the folder listing
    dm.setup("fit")
    return dm


def test_bad_input_is_one_line(photos: Path, tmp_path: Path):
    root = _tree(tmp_path, photos)
    broken = root / "train" / "cat" / "broken.jpg"
    broken.write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    with pytest.raises(DataError, match=r"broken\.jpg is not a readable image.*bad_images=skip"):
        _classes_and_setup(root, tmp_path)
    dm = _classes_and_setup(root, tmp_path, bad_images="skip")
    assert len(dm.train_set) == N_TRAIN_ALL and dm.skipped[0][0] == str(broken)
    broken.unlink()

    (root / "val" / "dog").mkdir()
    (root / "val" / "dog" / "0.jpg").write_bytes((root / "val" / "cat" / "020.jpeg").read_bytes())
    with pytest.raises(DataError, match=r"other classes than train/ \(extra: \['dog'\]"):
        _classes_and_setup(root, tmp_path)
    shutil.rmtree(root / "val" / "dog")

    (root / "train" / "empty").mkdir()
    (root / "val" / "empty").mkdir()
    with pytest.raises(DataError, match=r"train/empty holds no .*images"):
        _classes_and_setup(root, tmp_path)

    bare = tmp_path / "bare"
    (bare / "train" / "a").mkdir(parents=True)
    (bare / "train" / "a" / "notes.txt").write_text("no images")
    with pytest.raises(DataError, match=r"holds no .*images"):
        _classes_and_setup(bare, tmp_path)
    with pytest.raises(DataError, match=r"has no train/<class>/ folder"):
        _classes_and_setup(tmp_path / "bare" / "train", tmp_path)
    with pytest.raises(DataError, match="does not exist"):
        _classes_and_setup(tmp_path / "nowhere", tmp_path)


def test_head_mismatch_and_bad_image_errors(photos: Path, tmp_path: Path):
    """A head that does not fit the data is refused before building anything; through the CLI a truncated
    JPEG is one line and exit 2, before training."""
    with pytest.raises(
        DataError, match=r"model.net.num_classes=10 but the data has 3 classes \(bird, cat, ship\)"
    ):
        train(compose_cfg("train", [*_overrides(photos, tmp_path), "model.net.num_classes=10"], tmp_path))
    root = _tree(tmp_path, photos)
    (root / "train" / "ship" / "trunc.jpg").write_bytes(
        (root / "val" / "cat" / "020.jpeg").read_bytes()[:300]
    )
    code, stderr = fails_in_process("train", _overrides(root, tmp_path), tmp_path / "run")
    assert code == 2 and "trunc.jpg is not a readable image" in stderr, stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists(), "stopped before training"


class IndexSample:
    """Stands in for ImageFileDataset.__getitem__: the sample's index as its 'image', to record the order."""

    def __getitem__(self, key):
        index = key[1] if isinstance(key, tuple) else key
        return torch.tensor([float(index)]), 0


class SaveAt(L.Callback):
    """Save a checkpoint after training batch `step`, where the SIGTERM callback saves (a kill after it
    loses nothing)."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _trainer(**kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, use_distributed_sampler=False, max_epochs=1, **kwargs,
    )  # fmt: skip


def test_mid_epoch_resume_continues_the_epoch(photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Checkpoint after 3 of 8 batches (2 loader workers), resume from it: the batches before the save and the
    resumed run's are the samples of one uninterrupted epoch, each once, in the same order (the loader starts
    past the batches the restored loop completed; it keeps no state of its own)."""
    monkeypatch.setattr(image_folder.ImageFileDataset, "__getitem__", IndexSample.__getitem__)

    def dm() -> ImageFolderDataModule:
        return ImageFolderDataModule(
            str(photos), str(tmp_path / "cache"), batch_size=8, num_workers=2, in_memory=False
        )

    ckpt = tmp_path / "mid.ckpt"
    whole = Recorder()
    _trainer(callbacks=[SaveAt(3, ckpt)], default_root_dir=tmp_path).fit(whole, datamodule=dm())
    assert len(whole.seen) == 8 * (N_TRAIN_ALL // 8) and sorted(whole.seen) == list(range(N_TRAIN_ALL))
    saved = torch.load(ckpt, weights_only=True)["loops"]["fit_loop"]
    assert saved["epoch_loop.batch_progress"]["current"]["processed"] == 3  # what the loader resumes from
    assert "combined_loader" not in saved["state_dict"], "no loader state: the counters are enough"

    rest = Recorder()
    _trainer(default_root_dir=tmp_path).fit(rest, datamodule=dm(), ckpt_path=ckpt)
    assert whole.seen[:24] + rest.seen == whole.seen


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(RUN_TIMEOUT)
def test_ddp_two_processes_exact_eval(photos: Path, tmp_path: Path):
    """2 DDP processes train from the folder; the 9 validation images are evaluated 5 + 4, none twice."""
    args = [*_overrides(photos, tmp_path), "trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu",
            "+trainer.limit_train_batches=2", f"hydra.run.dir={tmp_path / 'run'}",
            "+callbacks.eval_samples._target_=helpers.EvalSamples", f"+callbacks.eval_samples.out={tmp_path}"]  # fmt: skip
    done = run_cli("train.py", args, env={"PYTHONPATH": str(ROOT / "tests")}, timeout=RUN_TIMEOUT)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in done.stdout + done.stderr
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["class_names"] == list(CLASSES) and ckpt["global_step"] == 2
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert sorted(map(len, ranks)) == [4, 5]
    assert len(set(ranks[0]) | set(ranks[1])) == N_VAL_ALL
