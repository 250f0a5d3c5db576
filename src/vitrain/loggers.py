"""What the template adds to Lightning's loggers (configs/logger/).

- `MetricRecord`: the run's own record of every logged value, `<run dir>/metrics.jsonl`, whatever the
  configured loggers (none included): the report's metrics and curves come from it;
- every logger receives the composed config, resolved and with secrets redacted (the model saves its
  hyperparameters with `logger=False`: the config is the single source of truth);
- a logger that cannot start (W&B without a login, an unreachable MLflow server) ends the run with one
  line that says what to do;
- `MLFlowLogger(log_best_checkpoint=True)` uploads the best checkpoint;
- `CSVLogger` keeps the rows of the run a resumed run continues (Lightning's starts `metrics.csv` over);
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
from lightning.pytorch.loggers import Logger
from lightning.pytorch.loggers import MLFlowLogger as _LightningMLFlowLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only

from vitrain.errors import UserError
from vitrain.utils.run_files import METRICS_FILE

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


class CSVLogger(_LightningCSVLogger):
    """Lightning's CSVLogger, except that a run resumed in its run dir keeps the rows written before it.

    Lightning's writer deletes `metrics.csv` when its folder is not empty (it takes it for a new run in an
    old folder): a resumed run lost its curves up to the resume. Here the rows are put back and the new ones
    appended under the same header. Steps the interrupted run trained after its last checkpoint appear
    twice (the resumed run trains them again), as in TensorBoard.
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
    `save_dir`: MLflow 3 refuses Lightning's default, the `./mlruns` file store.
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
        tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not tracking_uri:  # a local store: a database and an artifact folder under `save_dir`
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            tracking_uri = f"sqlite:///{Path(save_dir).resolve() / 'mlflow.db'}"
            artifact_location = artifact_location or (Path(save_dir).resolve() / "artifacts").as_uri()
        super().__init__(tracking_uri=tracking_uri, artifact_location=artifact_location, **kwargs)
        self.log_best_checkpoint = log_best_checkpoint
        self._best_callback: ModelCheckpoint | None = None
        self._uploaded: str | None = None

    def after_save_checkpoint(self, checkpoint_callback: ModelCheckpoint) -> None:
        super().after_save_checkpoint(checkpoint_callback)
        if checkpoint_callback.monitor is not None:  # the one that keeps the best, not `last`
            self._best_callback = checkpoint_callback

    @rank_zero_only
    def finalize(self, status: str = "success") -> None:
        if self.log_best_checkpoint and status == "success" and self._best_callback is not None:
            self.upload_best_checkpoint(self._best_callback.best_model_path)
        super().finalize(status)

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
