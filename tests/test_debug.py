"""Debug configs (`debug=...`) and the optional, git-ignored per-machine group (configs/local/)."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from helpers import CONFIGS, ROOT, compose_cfg, tiny_overrides
from vitrain.tasks.runs import register_resolvers
from vitrain.tasks.training import train


def compose_with_hydra(overrides: list[str], config_dir: Path = CONFIGS) -> DictConfig:
    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        return compose("train", overrides=overrides, return_hydra_config=True)


def debug_run(option: str, tmp_path: Path, tiny_cifar: Path, data_cache: Path, *extra: str):
    # the debug config decides epochs and limits: the tiny run's own max_epochs is left out
    base = [o for o in tiny_overrides(tiny_cifar, data_cache) if not o.startswith("trainer.max_epochs")]
    return train(compose_cfg("train", [*base, f"debug={option}", *extra], tmp_path))


def test_debug_default_is_one_cpu_process_with_nothing_leaving_the_machine():
    cfg = compose_with_hydra(
        ["debug=default", "trainer=ddp", "logger=many", "callbacks=[default,s3]"]
    )  # group choices give way to the debug config; explicit values (trainer.devices=4) would not
    # (not resolved: a time-named run dir is made when resolved)
    run_dir = OmegaConf.to_container(cfg.hydra.run, resolve=False)["dir"]
    assert cfg.task_name == "debug" and "${task_name}/runs" in run_dir
    assert cfg.hydra.job_logging.root.level == "DEBUG"
    # matplotlib's font search (the report's plots) wrote ~150 of a debug run's ~160 log lines
    assert cfg.hydra.job_logging.loggers.matplotlib.level == "INFO"
    assert cfg.trainer.accelerator == "cpu" and cfg.trainer.devices == 1 and cfg.trainer.num_nodes == 1
    assert cfg.trainer.detect_anomaly is True
    assert cfg.logger is None and cfg.callbacks.s3_upload is None
    assert cfg.callbacks.model_checkpoint is not None  # the rest of the callbacks stay


# (debug config, what the test shortens further, training steps): time on a loaded CI machine is precious
RUNS = [
    ("default", ["trainer.limit_train_batches=4"], 4),
    ("fdr", [], 1),
    ("limit", ["trainer.max_epochs=1"], 5),
]


@pytest.mark.parametrize(("option", "shorter", "steps"), RUNS, ids=[r[0] for r in RUNS])
def test_debug_config_runs(
    option: str, shorter: list[str], steps: int, tmp_path: Path, tiny_cifar: Path, data_cache: Path
):
    metrics, objects = debug_run(option, tmp_path, tiny_cifar, data_cache, *shorter)
    trainer = objects.trainer
    assert trainer.global_step == steps and trainer.world_size == 1
    # no logger but the record (fast_dev_run swaps every logger for Lightning's DummyLogger)
    expected = "DummyLogger" if option == "fdr" else "MetricRecord"
    assert [type(lg).__name__ for lg in trainer.loggers] == [expected]
    assert {"train/loss_epoch", "val/acc1", "test/acc1"} <= metrics.keys()
    if option == "limit":
        assert trainer.limit_val_batches == 2 and trainer.limit_test_batches == 2


def test_debug_profiler_writes_its_table_into_the_run_dir(tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    debug_run("profiler", tmp_path, tiny_cifar, data_cache, "trainer.limit_train_batches=3")
    table = (tmp_path / "fit-profile.txt").read_text()
    assert "run_training_epoch" in table and "Mean duration" in table


def test_debug_overfit_loss_falls(tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    """The same 3 batches again and again: the training loss must fall (6 of the config's 20 epochs)."""
    _, objects = debug_run("overfit", tmp_path, tiny_cifar, data_cache, "trainer.max_epochs=6")
    trainer = objects.trainer
    assert trainer.global_step == 18 and trainer.num_training_batches == 3
    assert not list(tmp_path.glob("checkpoints/*.ckpt"))
    losses = [
        json.loads(line)["train/loss_epoch"]
        for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
        if "train/loss_epoch" in json.loads(line)
    ]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.15, losses


def test_local_config_is_optional_and_applied_when_present(tmp_path: Path):
    """configs/local/default.yaml (git-ignored) is merged when it exists: here a copy of configs/ with one."""
    configs = tmp_path / "configs"
    shutil.copytree(CONFIGS, configs)
    (configs / "local" / "default.yaml").write_text(
        "# @package _global_\npaths:\n  data_dir: /mnt/datasets\ntrainer:\n  max_epochs: 7\n"
    )
    cfg = compose_with_hydra(["experiment=cifar"], config_dir=configs)
    assert cfg.paths.data_dir == "/mnt/datasets" and cfg.trainer.max_epochs == 7  # over the experiment too
    assert compose_with_hydra(["trainer.max_epochs=3"], config_dir=configs).trainer.max_epochs == 3

    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "configs/local/default.yaml"], cwd=ROOT, check=False
    ).returncode
    kept = subprocess.run(["git", "check-ignore", "-q", "configs/local/.gitkeep"], cwd=ROOT, check=False)
    assert ignored == 0 and kept.returncode == 1
