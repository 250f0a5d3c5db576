"""The training task: `train(cfg)` as a short list of named phases.

1. `search_batch_size`: `+tune=batch_size` only (vitrain/tasks/tuning.py), before anything is built;
2. `seed`, then `build` (vitrain/tasks/build.py) and `prepare`: the per-process batch, the checkpoint to
   resume from (`checkpoint_to_resume`, vitrain/tasks/runs.py), the loggers' runs (a resume continues its
   W&B / MLflow runs);
3. `fit`: from that checkpoint; the decisions global rank zero made travel to the processes Lightning starts
   (vitrain/tasks/decisions.py);
4. `test` the best checkpoint;
5. `finish_run`: report.md/json and plots, and the report files to S3.
"""

import logging
import os
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException
from omegaconf import DictConfig

from vitrain.checkpoints import CheckpointError, state_dict_mismatch
from vitrain.data.datamodules.base import ImageDataModule
from vitrain.errors import UserError
from vitrain.loggers import continue_logger_runs, finish_runs, log_run_config, record_logger_runs
from vitrain.reporting.report import write_report
from vitrain.tasks import tuning
from vitrain.tasks.build import RunObjects, build, use_tensor_cores_for_fp32
from vitrain.tasks.decisions import RESUME_FROM, decisions
from vitrain.tasks.runs import checkpoint_to_resume
from vitrain.utils.config import print_run_config
from vitrain.utils.measuring import metric_floats

log = logging.getLogger(__name__)

__all__ = ["RunObjects", "best_value", "finish_run", "train"]


def best_value(metric: str, metrics: dict[str, float], trainer: L.Trainer, warn: bool = True) -> float | None:
    """The best value of `metric` in the run: the score of the ModelCheckpoint that monitors it (the same on
    every rank), else, with a warning (`warn`), its last value. What a sweeper optimises (`optimized_metric`)."""
    for callback in trainer.checkpoint_callbacks:
        score = callback.best_model_score if isinstance(callback, ModelCheckpoint) else None
        if score is not None and callback.monitor == metric:
            return float(score)
    if metric in metrics and warn:
        log.warning(f"No ModelCheckpoint monitors {metric}: its last value stands for the run")
    return metrics.get(metric)


def train(cfg: DictConfig) -> tuple[dict[str, float], RunObjects]:
    """Fit (optionally resuming from `cfg.ckpt_path`), then test the best checkpoint; returns metrics."""
    search = tuning.search_batch_size(cfg)  # only with `+tune=batch_size`; applied to cfg
    seed(cfg)
    objects = build(cfg)
    if (cfg.get("extras") or {}).get("print_config"):  # once the run is built: a failed start prints one line
        print_run_config(cfg, Path(cfg.paths.output_dir) / "config_tree.log")
    objects.batch_size_search = search
    prepare(objects)
    if cfg.get("train"):
        fit(objects, carried=tuning.decision(search))
    metrics = metric_floats(objects.trainer.callback_metrics)
    objects.best_model_path = best_checkpoint(objects.trainer)
    stopped: SIGTERMException | None = None
    if cfg.get("test"):
        try:
            metrics.update(test(objects))
        except SIGTERMException as stop:  # the test stopped by hand (Ctrl-C): the report, then the exit
            stopped = stop
    finish_run(objects)  # rank zero: report.md/json and plots in the run dir
    if stopped is not None:
        raise stopped
    finish_runs()  # W&B's run is process-wide: the next job of a sweep needs its own
    return metrics, objects


def seed(cfg: DictConfig) -> None:
    if cfg.get("seed") is not None:
        # the same seed on every rank: identical initial weights everywhere
        L.seed_everything(cfg.seed, workers=True)


def prepare(objects: RunObjects) -> None:
    """What comes between building and fitting: in the launching process, before the other ranks start."""
    cfg, trainer, datamodule = objects.cfg, objects.trainer, objects.datamodule
    if isinstance(datamodule, ImageDataModule):  # before Lightning starts the other local ranks
        datamodule.split_batches(trainer.world_size)
    if cfg.get("train"):
        objects.resume_from = checkpoint_to_resume(cfg, trainer, objects.remote)
        if objects.resume_from:
            continue_logger_runs(objects.loggers, cfg.paths.output_dir)
    log_run_config(objects.loggers, objects.model.run_config)  # rank zero: W&B / MLflow start their run here
    record_logger_runs(objects.loggers, cfg.paths.output_dir)
    use_tensor_cores_for_fp32(trainer)
    compiles = getattr(objects.model, "compiles", None)
    if compiles is not None and compiles(trainer.strategy):
        # only then: every process the run starts inherits the variable, and a run that compiles nothing
        # leaves the environment as it found it
        keep_compiled_kernels(objects.cfg)


def keep_compiled_kernels(cfg: DictConfig) -> None:
    """torch.compile's caches (Inductor's kernels and graphs) in `paths.cache_dir/torch_compile` unless the
    environment names a place: the next run of the same model compiles in seconds (the default, /tmp, is
    lost at reboot and on a new container). The ranks Lightning starts inherit the variable."""
    cache = cfg.get("paths", {}).get("cache_dir")
    if cache:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(cache).expanduser() / "torch_compile"))


def fit(objects: RunObjects, carried: dict[str, str]) -> None:
    """`trainer.fit`, from the checkpoint to resume from (if any, `prepare` found it). The processes
    Lightning's launcher starts follow global rank zero's decisions: `carried` and the resume."""
    cfg, trainer, ckpt_path = objects.cfg, objects.trainer, objects.resume_from
    with decisions.holding({RESUME_FROM: ckpt_path or "", **carried}):
        try:
            trainer.fit(model=objects.model, datamodule=objects.datamodule, ckpt_path=ckpt_path)
        except SIGTERMException:
            finish_run(objects)  # report.md of what ran, marked interrupted, and how to resume it
            raise
        except (ValueError, MisconfigurationException) as err:
            message = validation_interval_error(cfg, trainer, err)
            if message is None:
                raise
            raise UserError(message) from err
        except RuntimeError as err:
            detail = state_dict_mismatch(err)
            if detail is None:
                raise
            raise CheckpointError(
                f"ckpt_path={cfg.ckpt_path} does not fit model {cfg.model.net.model_name}: {detail}"
            ) from err


def validation_interval_error(cfg: DictConfig, trainer: L.Trainer, err: Exception) -> str | None:
    """One line, in our config keys, for Lightning's refusal of `val_check_interval` once it knows the
    epoch's batches (a traceback from its fit loop before); None for any other error."""
    if "val_check_interval" not in str(err):
        return None
    interval = cfg.trainer.get("val_check_interval")
    batches = trainer.num_training_batches
    if isinstance(interval, int) and batches < interval:
        return (
            f"trainer.val_check_interval={interval}: more than the {batches} training batches of an epoch; "
            f"give at most {batches} (or a fraction of the epoch, e.g. 0.25), or count batches across epochs "
            "with trainer.check_val_every_n_epoch=null"
        )
    first = str(err).strip().split(". ")[0].replace("`", "")
    return f"trainer.val_check_interval={interval}: {first}"


def best_checkpoint(trainer: L.Trainer) -> str | None:
    checkpoint = trainer.checkpoint_callback
    best = checkpoint.best_model_path if isinstance(checkpoint, ModelCheckpoint) else ""
    return best or None


def test(objects: RunObjects) -> dict[str, float]:
    """Test the best checkpoint (the current weights when none was saved); returns the test metrics."""
    trainer, model, datamodule, best = (
        objects.trainer,
        objects.model,
        objects.datamodule,
        objects.best_model_path,
    )
    if best:
        # the path agrees on every rank (the monitored metric is synced); a rank that cannot read
        # it (no shared filesystem) fails loudly instead of testing other weights than its peers
        log.info(f"Testing the best checkpoint: {best}")
        trainer.test(model=model, datamodule=datamodule, ckpt_path=best)
    else:
        log.warning("No best checkpoint found: testing the current weights")
        trainer.test(model=model, datamodule=datamodule)
    return metric_floats(trainer.callback_metrics)


def finish_run(objects: RunObjects) -> dict[str, Any] | None:
    """The end of a training task, on global rank zero: the report from the run dir (run_stats.json is the
    RunStats callback's, complete by now), then (with an S3 upload callback) the report files to S3.

    A report that cannot be written (disk full, a file it reads damaged) or uploaded is logged, not raised:
    the run itself has succeeded. Other errors are bugs and raise."""
    trainer = objects.trainer
    if not trainer.is_global_zero:
        return None
    run_dir = Path(objects.cfg.paths.output_dir)
    try:
        report = write_report(run_dir)
        log.info("Run report: %s", run_dir / "report.md")
        if objects.remote is not None:
            objects.remote.upload_run_files(trainer)
        return report
    except (OSError, ValueError, UserError):
        log.exception("Writing or uploading the run report failed (the run itself succeeded)")
        return None
