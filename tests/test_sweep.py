"""Hydra multirun sweeps (`python src/train.py -m ...`), on one process per job and with DDP, and their summary."""

import csv
import importlib
import json
import logging
import os
import sys
import uuid
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import open_dict

from helpers import CONFIGS, ROOT, run_cli, tiny_overrides
from vitrain.distributed.multirun import DistributedMultirun, job_command
from vitrain.reporting.sweep import write_summary
from vitrain.tasks.runs import register_resolvers
from vitrain.tasks.training import best_value

SWEEP_TIMEOUT = 240  # seconds; normally 30-60 s on 2 slow cores


def run_sweep(sweep_dir: Path, tiny_cifar: Path, data_cache: Path, args: list[str]) -> str:
    base = [o for o in tiny_overrides(tiny_cifar, data_cache) if not o.startswith("datamodule.batch_size")]
    done = run_cli(
        "train.py",
        ["-m", *base, *args, f"hydra.sweep.dir={sweep_dir}", "callbacks.rich_progress_bar=null"],
        timeout=SWEEP_TIMEOUT,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return output


def summary(sweep_dir: Path) -> list[dict[str, str]]:
    with (sweep_dir / "summary.csv").open() as f:
        return list(csv.DictReader(f))


def check_jobs(sweep_dir: Path, batch_sizes: list[int], world_size: int) -> None:
    rows = summary(sweep_dir)
    assert [r["job"] for r in rows] == [str(i) for i in range(len(batch_sizes))]
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == [r["job"] for r in rows]
    md = (sweep_dir / "summary.md").read_text()
    for row, batch in zip(rows, batch_sizes, strict=True):
        job = sweep_dir / row["job"]
        assert (job / "checkpoints" / "last.ckpt").is_file() and list(
            (job / "checkpoints").glob("epoch*.ckpt")
        )
        assert (job / ".hydra" / "overrides.yaml").is_file()
        report = json.loads((job / "report.json").read_text())
        assert report["batch_size"] == {
            "global": batch,
            "per_device": batch // world_size,
            "per_device_observed": batch // world_size,
            "accumulate_grad_batches": 1,
        }
        assert report["world_size"] == world_size and len(report["memory"]["per_device"]) == world_size
        assert row["status"] == "done" and row["overrides"] == f"datamodule.batch_size={batch}"
        assert (int(row["global_batch"]), int(row["per_device_batch"])) == (batch, batch // world_size)
        assert float(row["images_per_s"]) > 0 and float(row["time_per_epoch_s"]) > 0
        assert len(row["peak_memory_gb_per_device"].split(" / ")) == world_size
        assert 0 <= float(row["best_val_acc1"]) <= 1 and 0 <= float(row["test_acc1"]) <= 1
        assert row["test_split"] == "test"  # CIFAR-10's own test split
        assert (sweep_dir / row["report"]).is_file() and Path(row["dir"]) == job.resolve()
        assert f"[{row['report']}]({row['report']})" in md


@pytest.mark.timeout(SWEEP_TIMEOUT)
def test_batch_size_sweep_one_process_per_job(tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    sweep_dir = tmp_path / "sweep"
    output = run_sweep(sweep_dir, tiny_cifar, data_cache, ["trainer=cpu", "datamodule.batch_size=16,32,64"])
    assert output.count("Launching 3 jobs locally") == 1
    check_jobs(sweep_dir, [16, 32, 64], world_size=1)


@pytest.mark.distributed
@pytest.mark.timeout(SWEEP_TIMEOUT)
def test_batch_size_sweep_with_ddp(tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    """Each job starts its own second rank, which runs that job (not the sweep) in that job's dir."""
    sweep_dir = tmp_path / "sweep"
    output = run_sweep(
        sweep_dir, tiny_cifar, data_cache, ["trainer=ddp", "trainer.devices=2", "datamodule.batch_size=16,32"]
    )
    assert output.count("Launching 2 jobs locally") == 1, "a child process started its own sweep"
    assert output.count("GLOBAL_RANK: 1, MEMBER: 2/2") == 2, "every job must launch its own rank 1"
    check_jobs(sweep_dir, [16, 32], world_size=2)


def test_child_command_runs_exactly_its_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # as `python src/train.py` runs it (pytest itself runs as `python -m pytest`)
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", None)
    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(
            "train", overrides=["trainer=ddp", "datamodule.batch_size=32"], return_hydra_config=True
        )
    job_dir = tmp_path / "sweep" / "1"
    with open_dict(cfg):
        cfg.hydra.mode = RunMode.MULTIRUN
        cfg.hydra.runtime.output_dir = str(job_dir)
        cfg.hydra.runtime.cwd = str(ROOT)
        cfg.hydra.overrides.hydra = ["hydra.mode=MULTIRUN", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    HydraConfig.instance().set_config(cfg)
    argv = ["src/train.py", "-m", "--config-name", "train", "trainer=ddp", "datamodule.batch_size=16,32"]
    command, cwd = job_command(local_rank=1, argv=argv)
    assert command == [
        sys.executable,
        str(ROOT / "src" / "train.py"),
        "--config-name",
        "train",
        "trainer=ddp",
        "datamodule.batch_size=32",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        f'hydra.run.dir="{job_dir}"',
        "hydra.mode=RUN",
        "hydra.job.name=train_ddp_process_1",
        "hydra.output_subdir=null",
    ]
    assert cwd == str(ROOT)


def test_each_job_starts_from_the_launch_environment_of_the_sweep(monkeypatch: pytest.MonkeyPatch):
    """What job 1's launcher put into os.environ must not make job 2 think it is an outside-launched rank."""
    monkeypatch.setenv("NODE_RANK", "0")  # set by the user: kept
    for var in ("LOCAL_RANK", "MASTER_PORT", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    callback = DistributedMultirun()
    callback.on_multirun_start(config=None)
    try:
        os.environ.update(LOCAL_RANK="0", MASTER_PORT="29511", WORLD_SIZE="2", NODE_RANK="0")
        callback.on_job_start(config=None)
        assert "LOCAL_RANK" not in os.environ and "MASTER_PORT" not in os.environ
        assert "WORLD_SIZE" not in os.environ and os.environ["NODE_RANK"] == "0"
    finally:
        callback.on_multirun_end(config=None)
    # Lightning's own command builders are back after the sweep
    from vitrain.compat import HYDRA_LAUNCHER_MODULES
    from vitrain.distributed import multirun

    for name in HYDRA_LAUNCHER_MODULES:
        assert importlib.import_module(name)._hydra_subprocess_cmd is not multirun._subprocess_cmd


def test_summary_lists_jobs_without_a_report(tmp_path: Path):
    """A failed (or still running) job appears in the summary, without figures."""
    (tmp_path / "multirun.yaml").write_text("{}\n")
    for job in ("0", "1"):
        (tmp_path / job / ".hydra").mkdir(parents=True)
        (tmp_path / job / ".hydra" / "overrides.yaml").write_text(f"- seed={job}\n- trainer=cpu\n")
    write_summary(tmp_path)
    rows = {r["job"]: r for r in summary(tmp_path)}
    assert rows["1"]["status"].startswith("no report") and rows["1"]["overrides"] == "seed=1"
    assert rows["0"]["images_per_s"] == ""


@pytest.mark.timeout(SWEEP_TIMEOUT)
def test_an_evaluation_sweep_summarises_each_jobs_accuracy(tmp_path: Path, tiny_checkpoint: Path):
    """`src/eval.py -m ckpt_path=<best>,<last> split=val,test`: one row per job with its split, images and
    accuracy from its metrics.json, not a training sweep's columns left empty with "no report"."""
    best, last = (
        next((tiny_checkpoint / "checkpoints").glob("epoch*.ckpt")),
        tiny_checkpoint / "checkpoints" / "last.ckpt",
    )
    sweep = tmp_path / "sweep"
    args = ["-m", f"ckpt_path={best},{last}", "split=val,test", "trainer.precision=32-true"]
    done = run_cli("eval.py", [*args, f"hydra.sweep.dir={sweep}"], timeout=SWEEP_TIMEOUT)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    rows = summary(sweep)
    assert list(rows[0]) == [
        "job",
        "status",
        "overrides",
        "split",
        "images",
        "acc1",
        "acc5",
        "loss",
        "metrics",
        "dir",
    ]
    jobs = [(ckpt, split) for ckpt in (best, last) for split in ("val", "test")]
    assert len(rows) == len(jobs)
    md = (sweep / "summary.md").read_text()
    for row, (ckpt, split) in zip(rows, jobs, strict=True):
        metrics = json.loads((sweep / row["job"] / "metrics.json").read_text())
        assert (row["status"], row["overrides"], row["split"]) == (
            "done",
            f"ckpt_path={ckpt} split={split}",
            split,
        )
        assert (
            int(row["images"]) == sum(metrics["per_class_images"].values()) == (16 if split == "val" else 40)
        )
        for name in ("acc1", "acc5", "loss"):
            assert float(row[name]) == pytest.approx(metrics[f"{split}/{name}"], rel=1e-3), (row, name)
        assert f"[{row['job']}/metrics.json]({row['job']}/metrics.json)" in md
    assert "no report" not in md


def test_a_prediction_sweep_summarises_its_files(tmp_path: Path):
    """`src/predict.py -m inputs=a,b`: the files each job classified, and the accuracy of labelled ones; a job
    that failed is listed as such."""
    from vitrain.reporting.sweep import summary_rows

    written = {
        "0": {"ckpt_path": "c.ckpt", "inputs": "/photos/labelled", "images": 12, "acc1": 0.75, "acc5": 1.0},
        "1": {"ckpt_path": "c.ckpt", "inputs": "/photos/new", "images": 5},
    }
    for job in ("0", "1", "2"):
        (tmp_path / job / ".hydra").mkdir(parents=True)
        (tmp_path / job / ".hydra" / "overrides.yaml").write_text(f"- inputs=/photos/{job}\n")
        (tmp_path / job / "predict.log").write_text("")
        if job in written:
            (tmp_path / job / "metrics.json").write_text(json.dumps(written[job]))
    rows = [
        {k: r[k] for k in ("job", "status", "split", "images", "acc1", "acc5")}
        for r in summary_rows(tmp_path)
    ]
    assert rows == [
        {"job": "0", "status": "done", "split": "files", "images": 12, "acc1": 0.75, "acc5": 1.0},
        {"job": "1", "status": "done", "split": "files", "images": 5, "acc1": None, "acc5": None},
        {"job": "2", "status": "no metrics.json (failed or running)", "split": None, "images": None, "acc1": None,
         "acc5": None},
    ]  # fmt: skip


@pytest.mark.distributed
@pytest.mark.timeout(2 * SWEEP_TIMEOUT)  # two 2-process jobs; a guard against hangs, not a timing check
def test_optuna_search_with_ddp(tmp_path: Path, tiny_cifar: Path, data_cache: Path, mlflow_server: str):
    """`hparams_search=cifar_optuna` (no -m): 2 TPE trials, each a 2-process DDP job logging one MLflow run;
    Optuna receives each trial's best val/acc1."""
    sweep_dir = tmp_path / "sweep"
    experiment = f"optuna-{uuid.uuid4().hex[:8]}"
    searched = ("datamodule.batch_size", "model.net.drop_path_rate")  # a value given here is not searched
    base = [o for o in tiny_overrides(tiny_cifar, data_cache) if not o.startswith(searched)]
    done = run_cli(
        "train.py",
        [
            *base,
            "hparams_search=cifar_optuna",
            "hydra.sweeper.n_trials=2",
            "datamodule.batch_size=16",  # fixed on the command line: left out of the search space
            "trainer=ddp",
            "trainer.devices=2",
            "trainer.limit_train_batches=2",
            "trainer.limit_val_batches=1",
            "trainer.limit_test_batches=1",
            "trainer.num_sanity_val_steps=0",
            "logger=mlflow",
            f"logger.mlflow.experiment_name={experiment}",
            f"hydra.sweep.dir={sweep_dir}",
            "callbacks.rich_progress_bar=null",
        ],
        env={"MLFLOW_TRACKING_URI": mlflow_server},
        timeout=2 * SWEEP_TIMEOUT,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert output.count("Sampler: TPESampler") == 1, "a child process started its own search"
    assert output.count("GLOBAL_RANK: 1, MEMBER: 2/2") == 2, "every trial must launch its own rank 1"

    jobs = [sweep_dir / str(i) for i in range(2)]
    best = {}
    for job in jobs:
        report = json.loads((job / "report.json").read_text())
        assert report["world_size"] == 2 and report["batch_size"]["global"] == 16
        best[job.name] = report["metrics"]["best"]["val/acc1"]["value"]
        overrides = (job / ".hydra" / "overrides.yaml").read_text()
        assert "model.optimizer.lr=" in overrides and "model.net.drop_path_rate=" in overrides
    results = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert results["best_value"] == pytest.approx(max(best.values()))
    assert set(results["best_params"]) == {
        "model.optimizer.lr",
        "model.optimizer.weight_decay",
        "model.net.drop_path_rate",
    }

    # rank zero alone created a run: one per trial, each with its trial's sampled lr
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_server)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 2
    lrs = sorted(float(r.data.params["model/optimizer/lr"]) for r in runs)
    sampled = sorted(
        float(o.split("=", 1)[1])
        for job in jobs
        for o in yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
        if o.startswith("model.optimizer.lr=")
    )
    assert lrs == pytest.approx(sampled)


def test_objective_is_the_best_value_of_the_run_not_the_last(tmp_path: Path):
    """What a sweeper optimises: the monitored metric's best score (ModelCheckpoint's), not its last value."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val/acc1", mode="max")
    trainer = L.Trainer(callbacks=[checkpoint], logger=False, accelerator="cpu", default_root_dir=tmp_path)
    checkpoint.best_model_score = torch.tensor(0.75)  # what fit leaves there after its best epoch
    last = {"val/acc1": 0.5, "val/loss": 1.25}
    assert best_value("val/acc1", last, trainer) == 0.75
    assert best_value("val/loss", last, trainer) == 1.25  # no checkpoint monitors it: its last value
    assert best_value("val/acc5", last, trainer) is None


def test_only_a_sweeps_objective_warns_that_its_last_value_stands(tmp_path: Path, caplog):
    trainer = L.Trainer(
        logger=False, accelerator="cpu", default_root_dir=tmp_path, enable_checkpointing=False
    )

    def warned() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "vitrain.tasks.training"]

    with caplog.at_level(logging.WARNING, logger="vitrain.tasks.training"):
        assert best_value("val/acc1", {"val/acc1": 0.5}, trainer, warn=False) == 0.5
        assert not warned()
        assert best_value("val/acc1", {"val/acc1": 0.5}, trainer) == 0.5
    assert warned() == ["No ModelCheckpoint monitors val/acc1: its last value stands for the run"]


def test_the_summary_says_which_images_test_acc1_is_on(tmp_path: Path):
    """An image folder without test/ is tested on its val images: the summary's test_split says `val`."""
    from vitrain.reporting.sweep import summary_rows

    for job, test_is_val in (("0", True), ("1", False)):
        (tmp_path / job).mkdir()
        report = {
            "overrides": [f"datamodule.data_dir=/data/{job}"],
            "batch_size": {"global": 8},
            "metrics": {"best": {}, "test": {"test/acc1": 0.5}},
            "data": {"test_is_val": test_is_val},
        }
        (tmp_path / job / "report.json").write_text(json.dumps(report))
    rows = summary_rows(tmp_path)
    assert [(r["job"], r["test_acc1"], r["test_split"]) for r in rows] == [
        ("0", 0.5, "val"),
        ("1", 0.5, "test"),
    ]
