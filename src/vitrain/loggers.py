"""What the template adds to Lightning's loggers (configs/logger/).

- `MetricRecord`: the run's own record of every logged value, `<run dir>/metrics.jsonl`, whatever the
  configured loggers (none included): the report's metrics and curves come from it;
- every logger receives the composed config, resolved and with secrets redacted (the model saves its
  hyperparameters with `logger=False`: the config is the single source of truth);
- a logger that cannot start (W&B without a login, an unreachable MLflow server) ends the run with one
  line that says what to do;
- `MLFlowLogger(log_best_checkpoint=True)` uploads the best checkpoint;
- `CSVLogger` keeps the rows of the run a resumed run continues (Lightning's starts `metrics.csv` over);
- a resume drops what the interrupted run logged after its checkpoint (`forget_steps_from`): the resumed
  run logs those steps again;
- a resumed run continues the W&B (online) and MLflow runs it logged to before (`logger_runs.json` in the
  run dir says which); MLflow keeps the params it had, a value changed by the resume goes to a `resumed/<key>`
  tag;
- W&B keeps one global run per process: it is finished after every task, so the next job of a sweep
  gets its own run instead of logging into the previous one.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import sys
import warnings
from argparse import Namespace
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger as _LightningCSVLogger
from lightning.pytorch.loggers import Logger, TensorBoardLogger, WandbLogger
from lightning.pytorch.loggers import MLFlowLogger as _LightningMLFlowLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException

from vitrain.compat import (
    mlflow_params,
    set_mlflow_run_id,
    set_wandb_run_id,
    tensorboard_purge_from,
    wandb_offline,
)
from vitrain.errors import UserError
from vitrain.utils.atomic import write_atomic
from vitrain.utils.run_files import LOGGER_RUNS_FILE, METRICS_FILE, read_json, write_json
from vitrain.utils.secrets import scrub

log = logging.getLogger(__name__)

# how to fix a logger that fails to start, by the module of the error it raised
_HINTS = {
    "wandb": "log in once with `wandb login` (or put WANDB_API_KEY in .env), or set WANDB_MODE=offline",
    "mlflow": "check MLFLOW_TRACKING_URI / logger.mlflow.tracking_uri and that the server is up",
}


class MetricRecord(Logger):
    """Every value the loggers get, at the same steps, as JSON lines: `{"step": N, "val/acc1": 0.5, ...}`.

    `training.build` adds it beside the configured loggers, so it is there with any of them or none. Global
    rank zero writes (Lightning calls loggers there only); each call appends and closes the file (once per
    `trainer.log_every_n_steps`), so a crashed run keeps its curves and a resumed one appends to them.
    """

    def __init__(self, run_dir: str | Path) -> None:
        super().__init__()
        self.path = Path(run_dir) / METRICS_FILE

    @property
    def name(self) -> str:
        return "metric_record"

    @property
    def version(self) -> int:
        return 0

    @property
    def save_dir(self) -> str:
        return str(self.path.parent)

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        """Nothing: Hydra saves the config in the run dir (.hydra/), the model in every checkpoint."""

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        # JSON has no NaN/inf: a diverged value is written as null
        values = {k: (float(v) if math.isfinite(float(v)) else None) for k, v in metrics.items()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")

    @rank_zero_only
    def forget_steps_from(self, step: int) -> None:
        """Drop the lines of `step` and later (`forget_steps_from` below)."""
        if self.path.is_file():
            kept = [line for line in self.path.read_text().splitlines() if _step_of_line(line) < step]
            write_atomic(self.path, "".join(line + "\n" for line in kept))


def _step_of_line(line: str) -> float:
    """The step of a metric record line; infinite for a line a crash cut short (dropped with the rest)."""
    try:
        step = json.loads(line).get("step")
    except ValueError:
        return math.inf
    return -1 if step is None else float(step)


class CSVLogger(_LightningCSVLogger):
    """Lightning's CSVLogger, except that a run resumed in its run dir keeps the rows written before it.

    Lightning's writer deletes `metrics.csv` when its folder is not empty (it takes it for a new run in an
    old folder): a resumed run lost its curves up to the resume. Here the rows are put back and the new ones
    appended under the same header; the rows of steps the resumed run trains again go
    (`forget_steps_from`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rows_kept = False

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._rows_kept:
            return _LightningCSVLogger.experiment.fget(self)  # type: ignore[attr-defined]
        self._rows_kept = True
        path = Path(self.log_dir) / ExperimentWriter.NAME_METRICS_FILE
        before = path.read_text() if path.is_file() else ""
        with warnings.catch_warnings():  # "Previous log files in this directory will be deleted": not here
            warnings.filterwarnings(
                "ignore", message=r".*Previous log files in this directory will be deleted"
            )
            writer = _LightningCSVLogger.experiment.fget(self)  # type: ignore[attr-defined]
        if before:
            path.write_text(before)
            writer.metrics_keys = next(csv.reader(io.StringIO(before)), [])
        return writer

    @rank_zero_only
    def forget_steps_from(self, step: int) -> None:
        """Drop the rows of `step` and later (`forget_steps_from` below)."""
        writer = self.experiment
        writer.save()  # rows still in memory first
        path = Path(writer.metrics_file_path)
        if not path.is_file():
            return
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
        kept = [row for row in rows if not row.get("step") or int(row["step"]) < step]
        if len(kept) < len(rows):
            out = io.StringIO()
            table = csv.DictWriter(out, fieldnames=writer.metrics_keys)
            table.writeheader()
            table.writerows(kept)
            write_atomic(path, out.getvalue())


class LoggerError(UserError):
    """A logger could not start its run."""


def log_run_config(loggers: list[Logger], config: dict[str, Any]) -> None:
    """Give every logger the composed config (already resolved and redacted: `utils.config.to_container`).

    This is the first call that makes W&B and MLflow create their run (on global rank zero only: Lightning's
    loggers are rank-zero-only), so a logger that cannot start fails here, before any training.
    """
    for logger in loggers:
        try:
            logger.log_hyperparams(config)
        except Exception as err:
            package = type(err).__module__.split(".")[0]
            if package not in _HINTS:
                raise
            first = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
            raise LoggerError(
                f"{type(logger).__name__} could not start: {first[:300]}; {_HINTS[package]}"
            ) from err


def forget_steps_from(loggers: list[Logger], step: int) -> None:
    """On a resume from a checkpoint at global step `step`: what the interrupted run logged at that logging
    step and after is dropped, since the resumed run trains those batches again and logs them anew (bitwise
    the same values); else a run killed without a save (SIGKILL, a dead node) shows them twice. Lightning
    logs the batch that makes optimizer step N + 1 at step N, and an epoch's validation at its last batch's.

    TensorBoard: hidden as `SummaryWriter(purge_step=step)` hides them; CSV and the metric record
    (`metrics.jsonl`): their rows removed. W&B and MLflow have no call that removes a logged point: there a
    resumed run's repeated steps appear twice.
    """
    for logger in loggers:
        if isinstance(logger, TensorBoardLogger):
            tensorboard_purge_from(logger.experiment, step)
        elif isinstance(logger, CSVLogger | MetricRecord):
            logger.forget_steps_from(step)


def logger_runs(loggers: list[Logger]) -> dict[str, dict[str, Any]]:
    """The W&B and MLflow runs these loggers log to, once `log_run_config` has started them."""
    runs: dict[str, dict[str, Any]] = {}
    for logger in loggers:
        if isinstance(logger, WandbLogger):
            offline = bool(getattr(logger.experiment, "offline", False))
            runs["wandb"] = {"id": str(logger.version), "project": str(logger.name), "offline": offline}
        elif isinstance(logger, MLFlowLogger):
            # the server, as a log line would show it: no password of a `user:pass@` URI on disk
            runs["mlflow"] = {"run_id": str(logger.run_id), "tracking_uri": scrub(logger.tracking_uri)}
    return runs


@rank_zero_only
def record_logger_runs(loggers: list[Logger], run_dir: str | Path) -> None:
    """Write which W&B / MLflow runs this run logs to into `<run dir>/logger_runs.json`, for its resume.
    Kinds it does not log to now keep their entry: a resume without W&B, then one with it, continues it."""
    runs = logger_runs(loggers)
    if runs:
        path = Path(run_dir) / LOGGER_RUNS_FILE
        write_json(path, {**(read_json(path) or {}), **runs})


@rank_zero_only
def continue_logger_runs(loggers: list[Logger], run_dir: str | Path) -> None:
    """A resumed run logs into the W&B and MLflow runs its run dir logged to before, not into new ones.

    Not where the config names a run (`logger.wandb.id`, `logger.mlflow.run_id`), nor into another project
    or tracking server than the one recorded. W&B offline: a new run. W&B cannot resume an offline run, and
    `wandb sync` of a second offline folder with the same id replaces the first one's history (wandb issues
    2423, 3841). Call before the loggers start their runs (`log_run_config`).
    """
    recorded = read_json(Path(run_dir) / LOGGER_RUNS_FILE) or {}
    wandb_run, mlflow_run = recorded.get("wandb") or {}, recorded.get("mlflow") or {}
    for logger in loggers:
        if isinstance(logger, WandbLogger) and wandb_run and logger.version is None:
            continue_wandb_run(logger, wandb_run)
        elif (
            isinstance(logger, MLFlowLogger)
            and logger.configured_run_id is None
            and mlflow_run.get("tracking_uri") == scrub(logger.tracking_uri)
        ):
            logger.continue_run(mlflow_run["run_id"])


def continue_wandb_run(logger: WandbLogger, recorded: dict[str, Any]) -> None:
    """The recorded W&B run, when both it and this session are online and in the same project."""
    if recorded.get("project") != logger.name:
        return
    if recorded.get("offline") or wandb_offline(logger):
        log.info(
            "W&B: a new run for this session: W&B cannot continue a run offline (%s was %s); "
            "sync each offline-run folder as its own run",
            recorded["id"],
            "offline" if recorded.get("offline") else "online, this session is offline",
        )
        return
    set_wandb_run_id(logger, recorded["id"])
    log.info("W&B: continuing run %s (the run this resume continues)", recorded["id"])


def finish_runs(failed: bool = False) -> None:
    """End the process-wide W&B run, if one is open (W&B otherwise ends it only at exit)."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish(exit_code=1 if failed else 0)


class MLFlowLogger(_LightningMLFlowLogger):
    """Lightning's MLFlowLogger; `log_best_checkpoint=True` uploads the best checkpoint at the end of fit.

    Why not Lightning's `log_model=True`: it uploads the checkpoints of whichever ModelCheckpoint saved
    last (here the `last.ckpt` one), and fails on a sharded (FSDP) checkpoint, which is a folder.
    Without a tracking URI (argument or MLFLOW_TRACKING_URI) runs go to a local SQLite store under
    `save_dir`: MLflow 3 refuses Lightning's default, the `./mlruns` file store. `synchronous=False` (the
    config's default) queues metrics to a background thread, so the training loop does not wait on the
    server at every `log_every_n_steps`; they are flushed when the run ends (`finalize`).

    A run that existed before (`run_id`, or a resume: `continue_run`) is set running again and keeps its
    params: MLflow refuses to change one, so a value the resume changed (`ckpt_path`, `trainer.max_epochs`)
    goes to the tag `resumed/<key>` and new keys are added.
    """

    def __init__(
        self,
        *,
        tracking_uri: str | None = None,
        save_dir: str = "./mlruns",
        artifact_location: str | None = None,
        log_best_checkpoint: bool = False,
        **kwargs: Any,
    ) -> None:
        self._uri_before: str | None = os.environ.get("MLFLOW_TRACKING_URI")
        tracking_uri = tracking_uri or self._uri_before
        if not tracking_uri:  # a local store: a database and an artifact folder under `save_dir`
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            tracking_uri = f"sqlite:///{Path(save_dir).resolve() / 'mlflow.db'}"
            artifact_location = artifact_location or (Path(save_dir).resolve() / "artifacts").as_uri()
        super().__init__(tracking_uri=tracking_uri, artifact_location=artifact_location, **kwargs)
        self.tracking_uri: str = tracking_uri
        self.configured_run_id: str | None = kwargs.get("run_id")
        self.continues = self.configured_run_id is not None
        self.log_best_checkpoint = log_best_checkpoint
        self._best_callback: ModelCheckpoint | None = None
        self._uploaded: str | None = None

    def continue_run(self, run_id: str) -> bool:
        """Log into the existing run `run_id` (before this logger started one); False, with a warning, when
        the server no longer has it (deleted): then this logger starts a new run."""
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        try:
            gone = MlflowClient(self.tracking_uri).get_run(run_id).info.lifecycle_stage == "deleted"
        except MlflowException as err:
            gone = err.error_code == "RESOURCE_DOES_NOT_EXIST"  # else (unreachable): the start says so
        if gone:
            log.warning(
                "MLflow: run %s of this run dir is deleted on the server: logging to a new run", run_id
            )
            return False
        set_mlflow_run_id(self, run_id)
        self.continues = True
        log.info("MLflow: continuing run %s (the run this resume continues)", run_id)
        return True

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Namespace) -> None:
        """The params, always synchronously (with `synchronous=False` too): a server that refuses them fails
        the run's start, not a background thread later."""
        from mlflow.entities import Param

        client = self.experiment
        values = mlflow_params(vars(params) if isinstance(params, Namespace) else params)
        if self.continues:
            client.update_run(self.run_id, status="RUNNING")  # an interrupted run was marked FAILED or KILLED
            logged = client.get_run(self.run_id).data.params
            changed = {key: value for key, value in values.items() if key in logged and logged[key] != value}
            for key, value in changed.items():
                client.set_tag(self.run_id, f"resumed/{key}", value)
            if changed:
                log.info("MLflow: params the resume changed are tagged resumed/<key>: %s", ", ".join(changed))
            values = {key: value for key, value in values.items() if key not in logged}
        batch = [Param(key, value) for key, value in values.items()]
        for start in range(0, len(batch), 100):  # MLflow takes at most 100 params per call
            client.log_batch(self.run_id, params=batch[start : start + 100])

    def after_save_checkpoint(self, checkpoint_callback: ModelCheckpoint) -> None:
        super().after_save_checkpoint(checkpoint_callback)
        if checkpoint_callback.monitor is not None:  # the one that keeps the best, not `last`
            self._best_callback = checkpoint_callback

    @rank_zero_only
    def finalize(self, status: str = "success") -> None:
        import mlflow

        # `synchronous=False`: the queued metrics reach the run before it ends. `flush_async_logging` flushes
        # the store of the process's tracking URI, which the end of fit set back (below): finalize runs again
        # after test, and its flush then opened a store at MLflow's default, ./mlflow.db in the working dir
        mlflow.set_tracking_uri(self.tracking_uri)
        mlflow.flush_async_logging()
        if self.log_best_checkpoint and status == "success" and self._best_callback is not None:
            self.upload_best_checkpoint(self._best_callback.best_model_path)
        if status == "failed" and isinstance(sys.exc_info()[1], SIGTERMException):
            # Lightning finalizes in its handler of the exception: a stop on request (SIGTERM, Ctrl-C, SLURM's
            # signal) that saved `last` is MLflow's KILLED, not a failure; its resume sets it RUNNING again
            status = "KILLED"
        super().finalize(status)
        # Lightning's `experiment` calls `mlflow.set_tracking_uri`, which also writes MLFLOW_TRACKING_URI into
        # the environment: the next job of a multirun process would log to this job's store
        mlflow.set_tracking_uri(self._uri_before)

    def upload_best_checkpoint(self, path: str) -> None:
        """`path` (a file or a checkpoint folder) under the run's `checkpoints/` artifacts; once per path."""
        if not path or path == self._uploaded or not Path(path).exists():
            return
        if Path(path).is_dir():
            self.experiment.log_artifacts(self.run_id, path, f"checkpoints/{Path(path).name}")
        else:
            self.experiment.log_artifact(self.run_id, path, "checkpoints")
        self.experiment.set_tag(self.run_id, "best_checkpoint", Path(path).name)
        self._uploaded = path
        log.info("MLflow: uploaded the best checkpoint %s", path)
