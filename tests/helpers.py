"""Composing configs and running the entry points the way users do, for tests."""

import hashlib
import json
import os
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

import warm
from vitrain.tasks.runs import RUN_ID_VARS, register_resolvers

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
PYTHON = sys.executable
# what launchers set (torchrun, Lightning's own launcher, also in an in-process DDP/FSDP run's own process): none
# may leak from the test runner into a run, nor from one test into the next (conftest.py)
RANK_VARS = ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")
LAUNCH_VARS = (*RUN_ID_VARS, *RANK_VARS)

# a ViT small enough that a CPU step takes milliseconds
TINY_VIT = [
    "model=vit",
    "model.net.model_name=vit_tiny_patch16_224",
    "model.net.pretrained=false",
    "model.net.img_size=32",
    "model.net.patch_size=8",
    "+model.net.embed_dim=32",
    "+model.net.depth=2",
    "+model.net.num_heads=2",
    "model.net.drop_path_rate=0.0",
]


def tiny_overrides(data_dir: Path, cache_dir: Path, batch_size: int = 8) -> list[str]:
    """A short CPU run of the tiny ViT on a generated dataset."""
    return [
        *TINY_VIT,
        f"datamodule.data_dir={data_dir}",
        f"datamodule.cache_dir={cache_dir}",
        f"datamodule.batch_size={batch_size}",
        "datamodule.val_size=16",
        "trainer.accelerator=cpu",
        # the same numerics on every machine (`auto` is bf16 where the CPU has it): tests of `auto` say so
        "trainer.precision=32-true",
        "trainer.max_epochs=1",
        "trainer.log_every_n_steps=1",
        "extras.print_config=false",
    ]


def compose_cfg(config_name: str, overrides: Sequence[str], output_dir: Path) -> DictConfig:
    """Compose `configs/<config_name>.yaml` like `@hydra.main` does, with the run dir at `output_dir`."""
    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        cfg.paths.output_dir = str(output_dir)
        del cfg.hydra
    return cfg


def fails_in_process(config_name: str, overrides: Sequence[str], output_dir: Path) -> tuple[int, str]:
    """Run the entry point's task (`run_task(train|evaluate, cfg)`) in this process on a config that must
    fail: its exit code and what it printed to stderr. Only a UserError becomes that one line and exit 2; any
    other exception (what a CLI run would show as a traceback) propagates and fails the test. Error paths
    checked this way cost no process start-up (~10 s of imports each); tests/test_errors.py keeps CLI cases
    for the entry points themselves."""
    import contextlib
    import io

    from lightning.pytorch.utilities import rank_zero_only

    from vitrain.tasks.evaluation import evaluate
    from vitrain.tasks.export import export_model
    from vitrain.tasks.harness import run_task
    from vitrain.tasks.prediction import predict
    from vitrain.tasks.training import train

    task = {"train": train, "eval": evaluate, "predict": predict, "export": export_model}[config_name]
    cfg = compose_cfg(config_name, overrides, output_dir)
    rank, err = rank_zero_only.rank, io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            run_task(task, cfg)
    except SystemExit as stop:
        return int(stop.code or 0), err.getvalue()
    finally:
        rank_zero_only.rank = rank  # run_task sets it from the environment
    raise AssertionError(f"{config_name} with {list(overrides)} did not stop: {err.getvalue()[-2000:]}")


def run_cli(
    script: str,
    overrides: Sequence[str],
    env: dict[str, str] | None = None,
    timeout: float = 300,
    cwd: Path = ROOT,
    fresh: bool = False,
    file_size_limit: int | None = None,
    **popen: object,
) -> subprocess.CompletedProcess:
    """`python src/<script> overrides...` in a process and session of its own, as a user types it: forked
    from a server that has imported torch, Lightning and timm (tests/warm.py says what that leaves out), or,
    with `fresh=True`, a new interpreter; with Popen arguments (`preexec_fn`), a new interpreter started by
    `subprocess.run`. `file_size_limit`: no file written past it (EFBIG, as a full disk gives ENOSPC)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    # no rank/launcher variables leak in from the test runner
    for var in RANK_VARS:
        if env is None or var not in env:
            full_env.pop(var, None)
    if not popen:
        target = [ROOT / "src" / script, *overrides]
        return warm.run_script(target, full_env, cwd, timeout, fresh=fresh, file_size_limit=file_size_limit)
    command = [PYTHON, str(ROOT / "src" / script), *overrides]
    return subprocess.run(
        command, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout, **popen
    )


# what `torch.load(weights_only=True)` reads: a checkpoint holds nothing else
PLAIN = (str, int, float, bool, type(None), torch.Tensor)


def epoch_figures(run_dir: Path) -> dict[int, dict[str, float]]:
    """The epoch-level training figures each epoch logged, from the run's metric record (kept across a
    resume, whatever the loggers)."""
    figures: dict[int, dict[str, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "train/acc1" in row:
            figures[int(row["epoch"])] = {k: row[k] for k in ("train/acc1", "train/acc5", "train/loss_epoch")}
    return figures


def assert_plain(value: Any, where: str = "checkpoint") -> None:
    """Only dicts, lists, tuples, scalars, strings and tensors: no config or numpy objects anywhere."""
    if isinstance(value, dict):
        for key, item in value.items():
            assert isinstance(key, str | int), f"{where}: key {key!r}"
            assert_plain(item, f"{where}/{key}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            assert_plain(item, f"{where}[{i}]")
    else:
        assert isinstance(value, PLAIN), f"{where}: {type(value).__name__}"


class EvalSamples(L.Callback):
    """Writes, per rank, a digest of every validation image it evaluated: a DDP test adds it by name
    (`+callbacks.eval_samples._target_=helpers.EvalSamples`, tests/ on PYTHONPATH) to check that each
    image was evaluated exactly once across ranks."""

    def __init__(self, out: str) -> None:
        self.out, self.seen = Path(out), []

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module, batch, *args) -> None:
        if not trainer.sanity_checking:
            self.seen += [hashlib.sha1(x.numpy().tobytes()).hexdigest() for x in batch[0]]

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.seen))


class Recorder(L.LightningModule):
    """A one-parameter model that records the sample indices of every training batch:
    what a resumed loader yields, compared with an uninterrupted run's."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[int] = []

    def training_step(self, batch, batch_idx):
        x, _ = batch
        self.seen += [int(v) for v in x.flatten()]
        return (self.w * x.float().mean()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class DecodedRecorder(L.LightningModule):
    """A one-parameter model that records every training batch as the training step receives it (decoded
    images): what a resumed GPU-decode loader yields, compared with an uninterrupted run's."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[0].clone())
        return (self.w * batch[0].mean()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


# --- MLflow: what a tracking server holds, read back -------------------------------------------------


def mlflow_get(server: str, endpoint: str, **params: str) -> dict[str, Any]:
    """GET on the tracking server's REST API (no MLflow client involved)."""
    url = f"{server}/api/2.0/mlflow/{endpoint}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def mlflow_runs(server: str, experiment_name: str) -> list[dict[str, Any]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(server)
    experiment = client.get_experiment_by_name(experiment_name)
    assert experiment is not None, f"no experiment {experiment_name} on the server"
    return [
        mlflow_get(server, "runs/get", run_id=r.info.run_id)["run"]
        for r in client.search_runs([experiment.experiment_id])
    ]


def predicted(ckpt: Path, inputs: Path | str, output_dir: Path, *extra: str) -> list[dict[str, str]]:
    """src/predict.py's task in this process (fp32, as the tests train): the rows of its predictions.csv."""
    import csv

    from vitrain.tasks.prediction import predict

    overrides = [
        f"ckpt_path={ckpt}",
        f"inputs={inputs}",
        "trainer.precision=32-true",
        "extras.print_config=false",
    ]
    predict(compose_cfg("predict", [*overrides, *extra], output_dir))
    with open(output_dir / "predictions.csv", newline="") as f:
        return list(csv.DictReader(f))


def assert_predicted_as_evaluated(rows: list[dict[str, str]], model, datamodule, images, files) -> None:
    """Each row is `files`' image classified as evaluation sees it: the uint8 `images` (the evaluation
    split's, in `files`' order) through the datamodule's device transform and the model, by hand."""
    model.eval()
    with torch.no_grad():
        probabilities = model.eval_logits(datamodule.device_transform()(images, train=False)).softmax(-1)
    top = probabilities.max(-1)
    assert [row["file"] for row in rows] == [str(f) for f in files]
    assert [row["class"] for row in rows] == [datamodule.classes[i] for i in top.indices.tolist()]
    assert [float(row["probability"]) for row in rows] == pytest.approx(top.values.tolist(), abs=2e-6)
