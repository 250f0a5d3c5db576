"""Every logger in a short real run: W&B offline files, a real MLflow tracking server, several at once."""

import csv
import json
import os
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from helpers import compose_cfg, mlflow_get, mlflow_runs, tiny_overrides
from vitrain.loggers import LoggerError
from vitrain.tasks.training import train

SECRET = "hf_vitrain-test-secret-0123456789"
SCALARS = {"train/loss_step", "train/loss_epoch", "train/acc1", "val/loss", "val/acc1", "val/acc5", "lr"}


@pytest.fixture
def wandb_offline(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """W&B offline, its settings and caches in a temp dir, no login anywhere."""
    home = tmp_path_factory.mktemp("wandb_home")
    for var, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_DATA_DIR": str(home / "data"),
        "WANDB_ARTIFACT_DIR": str(home / "artifacts"),
        "NETRC": str(home / "netrc"),
    }.items():
        monkeypatch.setenv(var, value)
    for var in ("WANDB_API_KEY", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    import wandb

    wandb.teardown()  # W&B keeps the settings of its first run per process: start from these
    yield
    wandb.teardown()


def wandb_records(run_dir: Path) -> list[Any]:
    """The records of the one offline W&B run under `run_dir`, parsed with W&B's own protobuf messages.

    wandb 0.31 ships no Python reader for its `.wandb` transaction log (the Go core writes it): the file
    is a LevelDB-style log, a 7-byte header (":W&B", magic, version) then 32 KiB blocks of records, each
    with a (crc32, length, type) header; a record spans blocks as FIRST/MIDDLE/LAST pieces.
    """
    import zlib

    from wandb.proto import wandb_internal_pb2

    files = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    data = files[0].read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(bytes([kind]) + chunk) == crc, "corrupt record"
        pos += 7 + length
        pending += chunk
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def wandb_history(records: list[Any]) -> dict[str, list[float]]:
    series: dict[str, list[float]] = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            for item in record.history.item:
                series.setdefault(_key(item), []).append(json.loads(item.value_json))
    return series


def wandb_config(records: list[Any]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for record in records:
        kind = record.WhichOneof("record_type")
        updates = (
            record.run.config.update if kind == "run" else record.config.update if kind == "config" else []
        )
        for item in updates:
            config[_key(item)] = json.loads(item.value_json)
    return config


def files_containing(root: Path, needle: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]


def test_wandb_offline_run_holds_the_scalars_and_the_redacted_config(
    tmp_path: Path,
    tiny_cifar: Path,
    data_cache: Path,
    wandb_offline: None,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture,
):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    overrides = [
        *tiny_overrides(tiny_cifar, data_cache),
        "logger=wandb",
        "trainer.max_epochs=2",
        "+extras.hub_token=${oc.env:HF_TOKEN}",  # masked by its key's name
        "+extras.note=token-${oc.env:HF_TOKEN}",  # masked by its value
    ]
    metrics, _ = train(compose_cfg("train", overrides, tmp_path))
    import wandb

    # the transaction log is read once W&B's service has ended and closed it, as at the end of a CLI run
    wandb.teardown()
    records = wandb_records(tmp_path)
    history = wandb_history(records)
    assert history.keys() >= SCALARS, sorted(history)
    # One row per validation epoch. The W&B core (0.31) dropped one of these rows in one CI run
    # under load (its own writer; ours hands every row to `run.log`), so a missing row is tolerated
    # while a wrong, extra or out-of-range value is not.
    val = history["val/acc1"]
    assert 1 <= len(val) <= 2 and all(0.0 <= v <= 1.0 for v in val), val
    assert len(val) == 1 or val[-1] == pytest.approx(metrics["val/acc1"]), (val, metrics["val/acc1"])
    assert history["test/acc1"] == [pytest.approx(metrics["test/acc1"])]
    config = wandb_config(records)
    assert config["datamodule"]["batch_size"] == 8 and config["model"]["net"]["embed_dim"] == 32
    assert config["extras"]["hub_token"] == "***" and config["extras"]["note"] == "token-***"
    assert not files_containing(tmp_path, SECRET), "the secret reached a file of the run"
    # Lightning's `anonymous=None` made W&B warn at every run that the setting has no effect
    assert "anonymous setting" not in capfd.readouterr().err


def test_wandb_without_a_login_fails_in_one_line(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path, wandb_offline: None, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("WANDB_MODE", "online")
    cfg = compose_cfg("train", [*tiny_overrides(tiny_cifar, data_cache), "logger=wandb"], tmp_path)
    with pytest.raises(LoggerError, match=r"WandbLogger could not start: .*API key.*WANDB_MODE=offline"):
        train(cfg)


# --- MLflow: a real tracking server --------------------------------------------------------------------


def test_mlflow_logs_params_metrics_and_the_best_checkpoint_to_a_server(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path, mlflow_server: str, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    experiment = f"test-{uuid.uuid4().hex[:8]}"
    overrides = [
        *tiny_overrides(tiny_cifar, data_cache),
        "logger=mlflow",
        f"logger.mlflow.experiment_name={experiment}",
        "logger.mlflow.log_best_checkpoint=true",
        "trainer.max_epochs=2",
    ]
    metrics, objects = train(compose_cfg("train", overrides, tmp_path))

    [run] = mlflow_runs(mlflow_server, experiment)
    assert run["info"]["status"] == "FINISHED"
    latest = {m["key"]: m for m in run["data"]["metrics"]}
    assert SCALARS | {"test/acc1"} <= latest.keys(), sorted(latest)
    assert latest["test/acc1"]["value"] == pytest.approx(metrics["test/acc1"])
    history = mlflow_get(
        mlflow_server, "metrics/get-history", run_id=run["info"]["run_id"], metric_key="val/acc1"
    )
    assert len(history["metrics"]) == 2
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    assert params["datamodule/batch_size"] == "8" and params["model/net/embed_dim"] == "32"

    # the best checkpoint, byte for byte, as an artifact served by the tracking server
    from mlflow.tracking import MlflowClient

    best = Path(objects.best_model_path)
    client = MlflowClient(mlflow_server)
    listed = [Path(a.path).name for a in client.list_artifacts(run["info"]["run_id"], "checkpoints")]
    assert listed == [best.name]
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert tags["best_checkpoint"] == best.name
    fetched = client.download_artifacts(
        run["info"]["run_id"], f"checkpoints/{best.name}", str(tmp_path / "dl")
    )
    assert Path(fetched).read_bytes() == best.read_bytes()
    assert torch.load(fetched, weights_only=True)["run_config"]["model"]["net"]["embed_dim"] == 32


def test_many_loggers_log_the_same_scalars(
    tmp_path: Path,
    tiny_cifar: Path,
    data_cache: Path,
    wandb_offline: None,
    mlflow_server: str,
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    experiment = f"test-many-{uuid.uuid4().hex[:8]}"
    overrides = [
        *tiny_overrides(tiny_cifar, data_cache),
        "logger=many",
        f"logger.mlflow.experiment_name={experiment}",
    ]
    cfg = compose_cfg("train", overrides, tmp_path)
    assert set(cfg.logger) == {"tensorboard", "csv", "mlflow", "wandb"}
    _, objects = train(cfg)
    assert len(objects.loggers) == 4
    import wandb

    # the transaction log is read once W&B's service has ended and closed it, as at the end of a CLI run
    # (read while its core still wrote, it once lacked the epoch-end rows: a CI run of 2026-11-27)
    wandb.teardown()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    with (tmp_path / "csv" / "metrics.csv").open() as f:
        csv_keys = {k for row in csv.DictReader(f) for k, v in row.items() if v}
    [run] = mlflow_runs(mlflow_server, experiment)
    logged = {
        "tensorboard": set(events.Tags()["scalars"]),
        "csv": csv_keys,
        "mlflow": {m["key"] for m in run["data"]["metrics"]},
        "wandb": set(wandb_history(wandb_records(tmp_path))),
    }
    for name, keys in logged.items():
        assert SCALARS | {"test/acc1"} <= keys, (name, sorted(keys))


# --- a resumed run continues its W&B / MLflow run ----------------------------------------------------------


def test_a_resumed_run_continues_its_mlflow_run(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path, mlflow_server: str, monkeypatch: pytest.MonkeyPatch
):
    """One MLflow run for a run and its resume, running again, its params kept (MLflow refuses to change
    one) and what the resume changed as tags; a new run dir started from that checkpoint is a new run."""
    # a password in the server's URI (the test server has no auth and ignores it) stays out of the run dir
    password = "pw-vitrain-0123456789"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.replace("://", f"://vitrain:{password}@"))
    experiment = f"test-resume-{uuid.uuid4().hex[:8]}"
    overrides = [
        *tiny_overrides(tiny_cifar, data_cache),
        "logger=mlflow",
        f"logger.mlflow.experiment_name={experiment}",
        "test=false",
    ]
    first = tmp_path / "first"
    train(compose_cfg("train", [*overrides, "trainer.max_epochs=1"], first))
    [before] = mlflow_runs(mlflow_server, experiment)
    recorded = json.loads((first / "logger_runs.json").read_text())
    assert recorded["mlflow"] == {
        "run_id": before["info"]["run_id"],
        "tracking_uri": mlflow_server.replace("://", "://***@"),
    }

    train(compose_cfg("train", [*overrides, "trainer.max_epochs=2", "ckpt_path=last"], first))
    [run] = mlflow_runs(mlflow_server, experiment)
    assert run["info"]["run_id"] == before["info"]["run_id"] and run["info"]["status"] == "FINISHED"
    history = mlflow_get(
        mlflow_server, "metrics/get-history", run_id=run["info"]["run_id"], metric_key="val/acc1"
    )["metrics"]
    assert len(history) == 2 and history[0]["step"] < history[1]["step"], history
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert params["trainer/max_epochs"] == "1" and tags["resumed/trainer/max_epochs"] == "2"
    assert params["ckpt_path"] == "None" and tags["resumed/ckpt_path"] == "last"
    assert "resumed/model/net/embed_dim" not in tags

    elsewhere = [*overrides, "trainer.max_epochs=3", f"ckpt_path={first / 'checkpoints' / 'last.ckpt'}"]
    train(compose_cfg("train", elsewhere, tmp_path / "second"))
    assert len(mlflow_runs(mlflow_server, experiment)) == 2

    # stopped on request (SIGTERM, Ctrl-C), `last` saved: KILLED, not FAILED
    stopped = [
        *overrides,
        "+callbacks.sigterm_at._target_=test_user_path.SigtermSelfAt",
        "+callbacks.sigterm_at.step=3",
    ]
    with pytest.raises(SIGTERMException):
        train(compose_cfg("train", stopped, tmp_path / "third"))
    statuses = sorted(run["info"]["status"] for run in mlflow_runs(mlflow_server, experiment))
    assert statuses == ["FINISHED", "FINISHED", "KILLED"], statuses
    assert not files_containing(tmp_path, password), (
        "the tracking server's password reached a file of the run"
    )


def wandb_run_ids(run_dir: Path) -> list[str]:
    """The run id of each offline W&B run under `run_dir`, oldest first."""
    folders = sorted(run_dir.glob("wandb/offline-run-*"))
    return [folder.name.rsplit("-", 1)[1] for folder in folders]


def test_a_resumed_offline_wandb_run_is_a_new_run(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path, wandb_offline: None
):
    """W&B cannot continue an offline run, and `wandb sync` of a second offline folder with the same id
    would replace the first one's history: a resumed offline session is a run of its own (a run that names
    its id keeps it). The record says the run was offline."""
    overrides = [*tiny_overrides(tiny_cifar, data_cache), "logger=wandb", "test=false"]
    train(compose_cfg("train", [*overrides, "trainer.max_epochs=1"], tmp_path))
    import wandb

    wandb.teardown()
    [first] = wandb_run_ids(tmp_path)
    recorded = json.loads((tmp_path / "logger_runs.json").read_text())["wandb"]
    assert recorded == {"id": first, "project": "vitrain", "offline": True}
    train(compose_cfg("train", [*overrides, "trainer.max_epochs=2", "ckpt_path=last"], tmp_path))
    wandb.teardown()
    [_, second] = wandb_run_ids(tmp_path)
    assert second != first
    named = [*overrides, "trainer.max_epochs=3", "ckpt_path=last", "logger.wandb.id=mine"]
    train(compose_cfg("train", named, tmp_path))
    wandb.teardown()
    assert wandb_run_ids(tmp_path) == [first, second, "mine"]


def test_continue_logger_runs_only_into_the_recorded_project_or_server(
    tmp_path: Path, mlflow_server: str, monkeypatch: pytest.MonkeyPatch
):
    """An online W&B run is continued (W&B's `resume="allow"` with its id: `test_compat.py` checks that
    Lightning passes both to `wandb.init`), in its own project only; an MLflow run on its own server only."""
    from lightning.pytorch.loggers import WandbLogger
    from mlflow.tracking import MlflowClient

    from vitrain.loggers import MLFlowLogger, continue_logger_runs

    monkeypatch.delenv("WANDB_MODE", raising=False)
    # the session's server: a new SQLite store would cost its schema migrations (~15 s of CPU)
    client = MlflowClient(mlflow_server)
    mlflow_run = client.create_run(client.create_experiment(f"e-{uuid.uuid4().hex[:8]}")).info.run_id
    wandb_run = {"id": "w1", "project": "p", "offline": False}
    (tmp_path / "logger_runs.json").write_text(
        json.dumps({"wandb": wandb_run, "mlflow": {"run_id": mlflow_run, "tracking_uri": mlflow_server}})
    )
    same = [WandbLogger(project="p", save_dir=str(tmp_path)), MLFlowLogger(tracking_uri=mlflow_server)]
    other = [
        WandbLogger(project="q", save_dir=str(tmp_path)),
        MLFlowLogger(save_dir=str(tmp_path / "elsewhere")),
    ]
    offline = WandbLogger(project="p", save_dir=str(tmp_path), offline=True)
    continue_logger_runs([*same, *other, offline], tmp_path)
    assert same[0].version == "w1" and same[1].configured_run_id is None and same[1].continues
    assert same[1].run_id == mlflow_run
    assert other[0].version is None and not other[1].continues
    assert offline.version is None, "an offline session does not take an online run's id"

    (tmp_path / "logger_runs.json").write_text(json.dumps({"wandb": {**wandb_run, "offline": True}}))
    was_offline = WandbLogger(project="p", save_dir=str(tmp_path))
    continue_logger_runs([was_offline], tmp_path)
    assert was_offline.version is None, "a run that was offline is not continued online"


def test_a_deleted_mlflow_run_is_not_continued(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path, monkeypatch: pytest.MonkeyPatch
):
    """The run dir's MLflow run was deleted from its store: the resume logs to a new run, with a warning,
    instead of failing to start. No tracking URI: the store is the local one under `save_dir` (the only test
    of that default; the others use the session's server, a new SQLite store costs its schema migrations)."""
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    overrides = [
        *tiny_overrides(tiny_cifar, data_cache),
        "logger=mlflow",
        f"logger.mlflow.save_dir={tmp_path / 'store'}",
    ]
    # fit, then test: the logger is finalized twice
    train(compose_cfg("train", [*overrides, "trainer.max_epochs=1"], tmp_path / "run"))
    recorded = json.loads((tmp_path / "run" / "logger_runs.json").read_text())["mlflow"]
    assert recorded["tracking_uri"] == f"sqlite:///{(tmp_path / 'store').resolve() / 'mlflow.db'}"
    # the next job of this process (a multirun) does not inherit this job's store through the environment
    assert "MLFLOW_TRACKING_URI" not in os.environ
    client = MlflowClient(recorded["tracking_uri"])
    # the test's metrics reached the run; the second finalize opened no store at MLflow's default (./mlflow.db)
    assert "test/acc1" in client.get_run(recorded["run_id"]).data.metrics
    assert list((tmp_path / "cwd").iterdir()) == []
    overrides.append("test=false")
    client.delete_run(recorded["run_id"])
    train(compose_cfg("train", [*overrides, "trainer.max_epochs=2", "ckpt_path=last"], tmp_path / "run"))
    again = json.loads((tmp_path / "run" / "logger_runs.json").read_text())["mlflow"]
    assert again["run_id"] != recorded["run_id"]
    assert client.get_run(again["run_id"]).info.status == "FINISHED"
