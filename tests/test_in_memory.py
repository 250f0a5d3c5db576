"""datamodule=image_folder with `in_memory`: the choice made from the file count before anything is decoded
(auto: in memory when it fits the budget, else from disk; true: in memory or a one-line refusal, exit 2),
training on the in-memory tensors with on-device augmentation, exact evaluation (the accuracy Lightning logs
is that of every validation image once), the decode cache, and the bitwise mid-epoch resume of the
in-memory loader. The folder is test_image_folder's: real CIFAR-10 JPEGs at random sizes and modes."""

# ruff: noqa: F811 - `photos`, test_image_folder's fixture, is imported and then named as an argument

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import lightning as L
import pytest
import torch

from helpers import ROOT, assert_predicted_as_evaluated, compose_cfg, fails_in_process, predicted, run_cli
from test_image_folder import (  # noqa: F401 - `photos` is a fixture
    CLASSES,
    N_TRAIN_ALL,
    N_VAL_ALL,
    RUN_TIMEOUT,
    SaveAt,
    _overrides,
    _trainer,
    photos,
)
from vitrain.data.datamodules.image_folder import ImageFileDataset, ImageFolderDataModule
from vitrain.data.loaders import TensorImageDataset
from vitrain.data.readers import decode as in_memory
from vitrain.errors import DataError
from vitrain.tasks.evaluation import evaluate
from vitrain.tasks.training import train

N_ALL = N_TRAIN_ALL + N_VAL_ALL  # the photos have train/ and val/, no test/ (test = val)


def _memory_overrides(photos: Path, tmp_path: Path, *extra: str) -> list[str]:
    """test_image_folder's overrides with in_memory set here instead of false."""
    base = [o for o in _overrides(photos, tmp_path) if not o.startswith("datamodule.in_memory=")]
    return [*base, *extra]


def _dm(photos: Path, tmp_path: Path, **kwargs) -> ImageFolderDataModule:
    dm = ImageFolderDataModule(str(photos), str(tmp_path / "cache"), batch_size=8, **kwargs)
    dm.set_input_spec(img_size=32)
    return dm


def test_auto_trains_in_memory_with_exact_eval(
    photos: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """auto + a small folder: held in memory at the model's 32 px, trained with the on-device transform; the
    head follows the 3 classes and the checkpoint keeps their names; val/acc1 is the accuracy over every
    validation image once, each decoded as the eval path would (shorter side resized, center crop)."""
    cfg = compose_cfg(
        "train",
        _memory_overrides(photos, tmp_path, "+trainer.limit_train_batches=3", "test=false"),
        tmp_path,
    )
    with caplog.at_level(logging.INFO, logger="vitrain.data.datamodules.image_folder"):
        metrics, objects = train(cfg)
    assert any("image folder: in memory (datamodule.in_memory=auto)" in r.message for r in caplog.records)
    dm, model = objects.datamodule, objects.model
    assert isinstance(dm.train_set, TensorImageDataset) and isinstance(dm.val_set, TensorImageDataset)
    assert dm.train_set.x.shape == (N_TRAIN_ALL, 3, 32, 32) and dm.train_set.x.dtype == torch.uint8
    assert dm.num_workers() == 0 and dm.device_transform() is not None
    assert objects.trainer.global_step == 3 and model.net.head.out_features == 3
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["class_names"] == list(CLASSES)

    # the validation tensors are the val/ files, in order, each decoded once
    val_files = sorted((photos / "val").rglob("*.jpeg"))
    assert len(val_files) == N_VAL_ALL
    resample = 2 if dm._spec.get("interpolation") in (None, "bilinear") else 3  # PIL BILINEAR / BICUBIC
    direct = torch.stack([in_memory.decode_square(str(f), 32, resample) for f in val_files])
    assert torch.equal(dm.val_set.x, direct)
    assert dm.val_set.y.tolist() == [CLASSES.index(f.parent.name) for f in val_files]

    # the logged accuracy is that of all N_VAL_ALL images, none twice: recompute it by hand
    model.eval()
    with torch.no_grad():
        logits = model(dm.device_transform()(dm.val_set.x, train=False))
    by_hand = (logits.argmax(1) == dm.val_set.y).float().mean().item()
    assert metrics["val/acc1"] == pytest.approx(by_hand, abs=1e-6)
    # src/eval.py on the checkpoint: the same images (from the decode cache), the same accuracy (in fp32, as
    # above: eval's default `auto` picks bf16 on a CPU whose native bf16 measures faster)
    last = tmp_path / "checkpoints" / "last.ckpt"
    overrides = [f"ckpt_path={last}", "split=val", "trainer.precision=32-true"]
    evaluated, _ = evaluate(compose_cfg("eval", overrides, tmp_path / "eval"))
    assert evaluated["val/acc1"] == pytest.approx(by_hand, abs=1e-6)
    # src/predict.py on the val/ photos: each decoded as the held images were (the checkpoint says the run
    # held them in memory; its data is not read), then resized and normalised on the device as they were
    assert torch.load(last, weights_only=True)["ImageFolderDataModule"]["in_memory"] is True
    gone = f"datamodule.data_dir={tmp_path / 'moved'}"  # the training data need not be there
    rows = predicted(last, photos / "val", tmp_path / "predict", gone)
    assert_predicted_as_evaluated(rows, model, dm, dm.val_set.x, val_files)


def test_budget_decides_before_decoding(photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A budget below the decoded size: auto streams from disk, true refuses with the size it needs; neither
    decodes a pixel for the decision. A fitting budget with in_memory_size: stored at that size, resized to
    the model's input on the device, cached for the next run."""

    def no_decode(*args):
        raise AssertionError("decoded an image")

    need = N_ALL * 3 * 32 * 32
    monkeypatch.setattr(in_memory, "decode_square", no_decode)
    tiny = need / 2 / 1e9
    dm = _dm(photos, tmp_path, in_memory_budget_gb=tiny)
    dm.setup()
    assert not dm.memory_plan().in_memory and "streaming from disk" in dm.memory_plan().reason
    assert isinstance(dm.train_set, ImageFileDataset)
    # from disk the workers crop and flip; the device only normalises (and erases) their uint8 batches
    transform = dm.device_transform()
    assert transform.crop_padding == 0 and transform.flip_p == 0 and transform.auto_augment is None
    with pytest.raises(DataError, match=rf"in_memory=true but {N_ALL} images at 32x32 px need ") as err:
        _dm(photos, tmp_path, in_memory=True, in_memory_budget_gb=tiny).setup()
    assert in_memory.human(need) in str(err.value) and in_memory.human(need // 2) in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(DataError, match=r"in_memory='yes': choose auto, true or false"):
        _dm(photos, tmp_path, in_memory="yes")

    monkeypatch.undo()
    dm = _dm(
        photos, tmp_path, in_memory=True, in_memory_budget_gb=N_ALL * 3 * 40 * 40 / 1e9, in_memory_size=40
    )
    dm.setup()
    assert dm.train_set.x.shape == (N_TRAIN_ALL, 3, 40, 40) and dm.device_transform().crop_padding == 5
    x = next(iter(dm.train_dataloader()))[0].x
    assert x.dtype == torch.uint8 and dm.device_transform()(x, train=False).shape == (8, 3, 32, 32)
    cached = list((tmp_path / "cache" / "image_folder").glob("decoded-*.pt"))
    assert len(cached) == 1
    monkeypatch.setattr(in_memory, "decode_square", no_decode)  # the second run loads the cache file
    again = _dm(photos, tmp_path, in_memory=True, in_memory_size=40)
    again.setup()
    assert torch.equal(again.train_set.x, dm.train_set.x) and torch.equal(again.test_set.x, dm.val_set.x)


def test_in_memory_true_over_budget_is_one_line_exit_2(photos: Path, tmp_path: Path):
    overrides = _memory_overrides(
        photos, tmp_path, "datamodule.in_memory=true", "datamodule.in_memory_budget_gb=0.0001"
    )
    code, stderr = fails_in_process("train", [o for o in overrides if not o.startswith("hydra.")], tmp_path)
    assert code == 2, stderr[-3000:]
    line = f"datamodule.in_memory=true but {N_ALL} images at 32x32 px need {in_memory.human(N_ALL * 3072)}"
    assert line in stderr and "the budget of 100 kB" in stderr
    assert not list(tmp_path.rglob("decoded-*.pt")), "refused before decoding"


class BatchDigests(L.LightningModule):
    """Records a digest of every training batch as it reaches the model."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[str] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append(hashlib.sha1(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest())
        return (self.w * x.float().mean()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_mid_epoch_resume_is_bitwise(photos: Path, tmp_path: Path):
    """Checkpoint after 3 of 8 in-memory batches, resume from it with a plain Trainer: the resumed run's
    batches, augmented on the device (crop, flip, RandAugment, random erasing), are bit for bit the rest of
    the uninterrupted epoch (the base's batch-skipping loader, and each batch's random ops seeded by its own
    seed: nothing restores the global generators here)."""
    ckpt = tmp_path / "mid.ckpt"
    whole = BatchDigests()
    torch.manual_seed(0)
    _trainer(callbacks=[SaveAt(3, ckpt)], default_root_dir=tmp_path).fit(
        whole, datamodule=_dm(photos, tmp_path, auto_augment="rand-m9-n2-mstd0.5", re_prob=0.5)
    )
    assert len(whole.seen) == N_TRAIN_ALL // 8
    rest = BatchDigests()
    torch.manual_seed(1)
    _trainer(default_root_dir=tmp_path).fit(
        rest, datamodule=_dm(photos, tmp_path, auto_augment="rand-m9-n2-mstd0.5", re_prob=0.5), ckpt_path=ckpt
    )
    assert whole.seen[:3] + rest.seen == whole.seen and len(set(whole.seen)) == len(whole.seen)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(RUN_TIMEOUT)
def test_ddp_two_processes_in_memory_exact_eval(photos: Path, tmp_path: Path):
    """2 DDP processes on the in-memory path: each holds the tensors (the budget counts 2 copies), the 9
    validation images are evaluated 5 + 4, none twice. Global rank zero first runs the batch-size search
    on one process (`+tune=batch_size`): the datamodule it set up there for one process is not the one the
    ranks then train with (it had skipped the ranks' broadcast and barrier: a collective mismatch). Each
    rank's batches are augmented by a thread ahead of its training thread (`augment_ahead=2`), whose passes
    the search's short trials leave early."""
    args = _memory_overrides(
        photos, tmp_path, "trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu",
        "datamodule.augment_ahead=2", "datamodule.auto_augment=trivial",
        "+trainer.limit_train_batches=2", f"hydra.run.dir={tmp_path / 'run'}",
        "+callbacks.eval_samples._target_=helpers.EvalSamples", f"+callbacks.eval_samples.out={tmp_path}",
        "+tune=batch_size", "tune.batch_size.max_trials=2", "tune.batch_size.steps_per_trial=1",
        "tune.batch_size.apply=true",
    )  # fmt: skip
    done = run_cli("train.py", args, env={"PYTHONPATH": str(ROOT / "tests")}, timeout=RUN_TIMEOUT)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "x 2 processes on this node" in out and "image folder: in memory" in out
    assert out.count("image folder: in memory") == 2  # planned for the search's one process, then for two
    search = json.loads((tmp_path / "run" / "batch_size_search.json").read_text())
    assert [t["batch_size"] for t in search["trials"]] == [2, 4] and search["world_size"] == 2
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["class_names"] == list(CLASSES) and ckpt["global_step"] == 2
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert sorted(map(len, ranks)) == [4, 5]
    assert len(set(ranks[0]) | set(ranks[1])) == N_VAL_ALL


@pytest.mark.slow
@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_sigterm_mid_epoch_then_resume_is_bitwise(photos: Path, tmp_path: Path):
    """The whole run, on-device augmentation included (crop, flip, TrivialAugment, random erasing): stopped
    by SIGTERM in the middle of the second epoch and resumed with ckpt_path=last, it ends with the weights of
    the run left alone, bit for bit."""

    def run(run_dir: Path, *extra: str):
        args = _memory_overrides(
            photos, run_dir, "datamodule.in_memory=true", "datamodule.auto_augment=trivial",
            "datamodule.re_prob=0.25", "trainer.max_epochs=2", "test=false", f"hydra.run.dir={run_dir}", *extra,
        )  # fmt: skip
        return run_cli("train.py", args, env={"PYTHONPATH": str(ROOT / "tests")}, timeout=RUN_TIMEOUT)

    def weights(run_dir: Path) -> dict[str, torch.Tensor]:
        ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
        assert ckpt["global_step"] == 2 * (N_TRAIN_ALL // 8)
        return ckpt["state_dict"]

    alone = run(tmp_path / "alone")
    assert alone.returncode == 0, alone.stderr[-3000:]
    stopped = run(
        tmp_path / "stopped",
        "+callbacks.fault._target_=fault_injection.SigtermAt",
        "+callbacks.fault.step=11",
    )
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    saved = torch.load(tmp_path / "stopped" / "checkpoints" / "last.ckpt", weights_only=True)
    assert (saved["global_step"], saved["epoch"]) == (11, 1)
    resumed = run(tmp_path / "stopped", "ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = weights(tmp_path / "alone"), weights(tmp_path / "stopped")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
