"""Checkpoints hold plain data only: `torch.load(path, weights_only=True)` reads every one of them.

The DDP and FSDP (sharded folder and one file) checkpoints are checked in tests/test_distributed.py, on the
runs made there.
"""

from pathlib import Path
from typing import Any

import hydra
import numpy as np
import pytest
import torch

from helpers import TINY_VIT, assert_plain, compose_cfg
from vitrain import checkpoints
from vitrain.callbacks.resume import ExactResume
from vitrain.errors import UserError


def test_single_process_checkpoints_are_plain(tiny_checkpoint: Path):
    saved = sorted((tiny_checkpoint / "checkpoints").glob("*.ckpt"))
    assert len(saved) == 2  # last and the best
    for path in saved:
        checkpoint = torch.load(path, weights_only=True)
        assert_plain(checkpoint, path.name)
        assert checkpoints.load(path).keys() == checkpoint.keys()
    hparams = checkpoint["hyper_parameters"]
    assert hparams["optimizer"]["_target_"] == "torch.optim.AdamW" and "_partial_" not in hparams["optimizer"]
    assert hparams["scheduler"]["_target_"] == "vitrain.models.schedules.warmup_cosine"
    assert checkpoint["run_config"]["model"]["optimizer"] == hparams["optimizer"]


def test_model_builds_the_optimizer_it_is_configured_with(tmp_path: Path):
    """`model.optimizer._target_=...` swaps the class (docs/recipes.md's SGD command); the node stays data."""
    overrides = [
        *TINY_VIT,
        "model.net.num_classes=10",
        "model.optimizer._target_=torch.optim.SGD",
        "~model.optimizer.betas",
        "model.optimizer.lr=0.03",
        "+model.optimizer.momentum=0.9",
        "model.scheduler=null",
    ]
    model = hydra.utils.instantiate(compose_cfg("train", overrides, tmp_path).model)
    assert model.hparams.optimizer == {"_target_": "torch.optim.SGD", "lr": 0.03, "weight_decay": 0.05,
                                       "momentum": 0.9}  # fmt: skip
    assert_plain(dict(model.hparams), "hparams")
    optimizer = model.configure_optimizers()["optimizer"]
    assert isinstance(optimizer, torch.optim.SGD)
    assert {g["lr"] for g in optimizer.param_groups} == {0.03}
    assert {g["momentum"] for g in optimizer.param_groups} == {0.9}
    assert {g["weight_decay"] for g in optimizer.param_groups} == {0.0, 0.05}  # norms, biases: no decay


def test_datamodule_lists_are_plain(tmp_path: Path):
    cfg = compose_cfg("train", ["datamodule.mean=[0.5,0.5,0.5]", "datamodule.std=[0.2,0.2,0.2]"], tmp_path)
    datamodule = hydra.utils.instantiate(cfg.datamodule)
    assert datamodule.hparams.mean == [0.5, 0.5, 0.5] and type(datamodule.hparams.std) is list


def test_numpy_generator_state_is_saved_as_a_list():
    np.random.seed(3)
    state = ExactResume()._collect()
    assert_plain(state, "rng_states")
    expected = np.random.random(4)
    np.random.seed(4)
    np.random.set_state(state["numpy"])  # as Lightning's _set_rng_states restores it
    assert np.array_equal(np.random.random(4), expected)


@pytest.mark.parametrize("bad", [None, "torch.optim.SGD"])
def test_optimizer_must_be_a_node(bad: Any):
    from vitrain.errors import ModelError
    from vitrain.models.classifier import ImageClassifier

    net = {"model_name": "vit_tiny_patch16_224", "num_classes": 10, "img_size": 32, "patch_size": 8,
           "embed_dim": 32, "depth": 1, "num_heads": 2}  # fmt: skip
    with pytest.raises(ModelError, match=r"model\.optimizer must be a config node"):
        ImageClassifier(net=net, optimizer=bad)


def test_a_checkpoint_with_python_objects_is_refused_in_one_line(tmp_path: Path):
    """What a checkpoint of an earlier version (config objects in its hyperparameters) gives."""
    from omegaconf import OmegaConf

    path = tmp_path / "old.ckpt"
    torch.save({"hyper_parameters": {"net": OmegaConf.create({"model_name": "x"})}}, path)
    with pytest.raises(checkpoints.CheckpointError, match="holds Python objects, not only plain data"):
        checkpoints.load(path)
    with pytest.raises(checkpoints.CheckpointError, match="holds Python objects"):
        checkpoints.AtomicCheckpointIO().load_checkpoint(path)


@pytest.mark.parametrize(
    ("saved", "now"),
    [
        ("vitrain.data.cifar10.CIFAR10DataModule", "vitrain.data.datamodules.cifar.CIFAR10DataModule"),
        ("vitrain.data.cifar10.CIFAR100DataModule", "vitrain.data.datamodules.cifar.CIFAR100DataModule"),
        (
            "vitrain.data.image_folder.ImageFolderDataModule",
            "vitrain.data.datamodules.image_folder.ImageFolderDataModule",
        ),
        (
            "vitrain.data.streaming.StreamingDataModule",
            "vitrain.data.datamodules.streaming.StreamingDataModule",
        ),
    ],
)
def test_a_checkpoint_written_before_the_move_rebuilds_its_run(saved: str, now: str, monkeypatch):
    """Issue 32 moved the datamodules: eval.py finds a checkpoint's saved `_target_` where the class is now."""
    from hydra.core.hydra_config import HydraConfig

    from vitrain.tasks.evaluation import saved_config

    # no command line here: another test's Hydra run (same worker process) must not lend its overrides
    monkeypatch.setattr(HydraConfig.instance(), "cfg", None)

    run_config = {
        "model": {"_target_": "vitrain.models.classifier.ImageClassifier", "net": {"model_name": "resnet18"}},
        "datamodule": {"_target_": saved, "batch_size": 8},
    }
    cfg = saved_config({"run_config": run_config}, Path("old.ckpt"))
    assert cfg.datamodule._target_ == now and cfg.datamodule.batch_size == 8
    assert hydra.utils.get_class(now).__name__ == saved.rsplit(".", 1)[1]
    assert cfg.model._target_ == "vitrain.models.classifier.ImageClassifier"


# --- writing in the background (AtomicCheckpointIO(background=True), the trainer's default) ------------------


@pytest.fixture
def slow_disk(monkeypatch: pytest.MonkeyPatch):
    """Checkpoint writes that wait until the test releases them: a disk as slow as the test wants."""
    import threading

    release = threading.Event()
    write = checkpoints._write

    def held(checkpoint: dict, target: Path) -> None:
        assert release.wait(60), "the test never released the write"
        write(checkpoint, target)

    monkeypatch.setattr(checkpoints, "_write", held)
    return release


def test_a_background_save_returns_before_the_write_and_keeps_the_state_it_was_given(
    tmp_path: Path, slow_disk
):
    io = checkpoints.AtomicCheckpointIO(background=True)
    previous_best = tmp_path / "epoch000.ckpt"
    torch.save({"epoch": 0}, previous_best)
    weights = torch.arange(4.0)
    best, last = tmp_path / "epoch001.ckpt", tmp_path / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": weights}, "epoch": 1}, best)
    io.remove_checkpoint(previous_best)  # ModelCheckpoint replacing its best: queued behind the write
    weights.add_(100)  # training goes on while the files are written
    io.save_checkpoint({"state_dict": {"w": weights}, "epoch": 2}, last)
    assert not best.exists() and not last.exists(), "the saves waited for the disk"
    assert previous_best.exists(), "the previous best went before the new one was written"
    slow_disk.set()
    io.wait()
    assert not previous_best.exists()
    assert torch.equal(io.load_checkpoint(best)["state_dict"]["w"], torch.arange(4.0)), "a point-in-time copy"
    assert torch.equal(io.load_checkpoint(last)["state_dict"]["w"], torch.arange(4.0) + 100)
    io.teardown()


def test_a_load_waits_for_the_write_of_the_same_checkpoint(tmp_path: Path, slow_disk):
    import threading

    io = checkpoints.AtomicCheckpointIO(background=True)
    path = tmp_path / "best.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}}, path)
    threading.Timer(0.2, slow_disk.set).start()
    assert torch.equal(io.load_checkpoint(path)["state_dict"]["w"], torch.ones(3))  # not "does not exist"
    io.teardown()


def test_a_failed_background_write_is_raised_in_the_training_thread(tmp_path: Path):
    io = checkpoints.AtomicCheckpointIO(background=True)
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the checkpoint folder should be")
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}}, blocker / "last.ckpt")
    with pytest.raises(OSError):
        io.teardown()
    io.teardown()  # raised once; the IO is reusable
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}}, tmp_path / "last.ckpt")
    io.wait()
    assert (tmp_path / "last.ckpt").is_file()
    io.teardown()


def test_auto_writes_in_the_background_only_a_state_on_an_accelerator(tmp_path: Path, slow_disk):
    io = checkpoints.AtomicCheckpointIO()  # background="auto", the trainer's default
    slow_disk.set()
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, tmp_path / "cpu.ckpt")
    assert not io.busy and (tmp_path / "cpu.ckpt").is_file(), "a state in host memory is written in place"
    meta = {"state_dict": {"w": torch.ones(2, device="meta")}}  # a device other than the CPU, without a GPU
    assert io.writes_in_background(meta) and not io.writes_in_background({"state_dict": {"w": torch.ones(2)}})
    with pytest.raises(UserError, match="choose true, false or auto"):
        checkpoints.AtomicCheckpointIO(background="yes")
