"""The training task: build everything from the config, fit, test the best checkpoint."""

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, open_dict

from vitrain.checkpoints import CheckpointError, state_dict_mismatch
from vitrain.data.base import ImageDataModule
from vitrain.errors import DataError
from vitrain.loggers import MetricRecord, finish_runs, log_run_config
from vitrain.models.timm_net import check_pretrained_available
from vitrain.precision import resolve_precision
from vitrain.reporting.files import STATS_FILE, read_json, write_json
from vitrain.reporting.measuring import metric_floats
from vitrain.reporting.report import write_report
from vitrain.reporting.run_stats import checkpoint_paths
from vitrain.resume import DECIDED_ENV, checkpoint_to_resume
from vitrain.tuning import search_batch_size
from vitrain.utils.config import instantiate_dict, print_run_config, to_container
from vitrain.utils.secrets import redact

log = logging.getLogger(__name__)


@dataclass
class RunObjects:
    """What `build` makes from the config, and what the run adds: the training task's second result."""

    cfg: DictConfig
    datamodule: L.LightningDataModule
    model: L.LightningModule
    callbacks: list[Callback]
    loggers: list[Logger]
    trainer: L.Trainer
    #: the best checkpoint after fit (None: none was saved)
    best_model_path: str | None = None
    #: the batch-size search's result (`+tune=batch_size`, vitrain/tuning.py)
    batch_size_search: dict[str, Any] | None = None


def build(cfg: DictConfig) -> RunObjects:
    """Datamodule, model, callbacks, loggers and trainer, exactly as the config says."""
    # weights that cannot be had fail in seconds, before any data is decoded
    check_pretrained_available(cfg.model.net, cfg.model.get("weights_file"))
    datamodule: L.LightningDataModule = hydra.utils.instantiate(cfg.datamodule)
    model: L.LightningModule = build_model(cfg, datamodule)
    model.run_config = to_container(cfg)
    callbacks = instantiate_dict(cfg.get("callbacks"))
    loggers = instantiate_dict(cfg.get("logger"))
    # the run's own metric record (metrics.jsonl), beside any logger or none: what the report reads
    record = MetricRecord(cfg.paths.output_dir)
    time_budget_wins(cfg.trainer)
    warn_shared_checkpoint_dir(cfg)
    trainer: L.Trainer = hydra.utils.instantiate(
        cfg.trainer, callbacks=callbacks, logger=[*loggers, record], precision=resolve_precision(cfg.trainer)
    )
    if hasattr(model, "check_strategy"):  # options the strategy cannot honour stop before the ranks start
        model.check_strategy(trainer.strategy, fitting=bool(cfg.get("train")))
    return RunObjects(cfg, datamodule, model, callbacks, loggers, trainer)


def warn_shared_checkpoint_dir(cfg: DictConfig) -> None:
    """Checkpoints written outside the run's own directory are shared by every run that writes there: one
    run's `last.ckpt` replaces another's, and `ckpt_path=last` / `resume=auto` read whichever came last."""
    node = (cfg.get("callbacks") or {}).get("model_checkpoint") or {}
    dirpath = node.get("dirpath") if hasattr(node, "get") else None
    if not dirpath:
        return
    run_dir = Path(str(cfg.paths.output_dir)).resolve()
    if not Path(str(dirpath)).resolve().is_relative_to(run_dir):
        log.warning(
            f"callbacks.model_checkpoint.dirpath={dirpath} is outside this run's directory ({run_dir}): every "
            "run writing there shares one last.ckpt, and ckpt_path=last resumes whichever wrote it last. "
            "Leave dirpath at its default (<run dir>/checkpoints) to keep runs apart"
        )


def time_budget_wins(trainer_cfg: DictConfig) -> None:
    """Under `trainer.max_time`, drop `trainer.min_epochs` (with a warning): Lightning ignores every stop
    request, its own time limit's included, until min_epochs have run, so on a slow machine the budget would
    not hold inside the first epoch."""
    if trainer_cfg.get("max_time") and trainer_cfg.get("min_epochs"):
        log.warning(
            f"trainer.min_epochs={trainer_cfg.min_epochs} is ignored under trainer.max_time="
            f"{trainer_cfg.max_time}: the run stops at the time limit, also inside an epoch"
        )
        with open_dict(trainer_cfg):
            trainer_cfg.min_epochs = None


def build_model(cfg: DictConfig, datamodule: L.LightningDataModule) -> L.LightningModule:
    """The model with its head sized to the classes the datamodule found (written into `cfg`, so the config
    a checkpoint stores has the number); the datamodule learns the model's input spec in return."""
    classes = list(datamodule.classes)
    with open_dict(cfg):
        cfg.model.net.num_classes = head_size(cfg.model.net.get("num_classes"), classes)
    model: L.LightningModule = hydra.utils.instantiate(cfg.model)
    model.class_names = classes
    datamodule.set_input_spec(**model.input_spec)
    return model


def head_size(configured: int | None, classes: list[str]) -> int:
    """`model.net.num_classes` when given (it must match the data), else the data's class count."""
    if configured is not None and int(configured) != len(classes):
        shown = ", ".join(classes[:5]) + (f", ... ({len(classes) - 5} more)" if len(classes) > 5 else "")
        raise DataError(
            f"model.net.num_classes={configured} but the data has {len(classes)} classes ({shown}): "
            "leave model.net.num_classes=null to follow the data"
        )
    return len(classes)


def use_tensor_cores_for_fp32(trainer: L.Trainer) -> None:
    """On GPUs, fp32 matmuls (32-true runs, fp32 parts of mixed precision) run as TF32 on tensor cores:
    about 8x the fp32 peak on an A100/H100, a 10-bit mantissa for the products, fp32 accumulation. An
    explicit `torch.set_float32_matmul_precision` in the environment's code wins (only "highest" is
    replaced)."""
    if trainer.strategy.root_device.type == "cuda" and torch.get_float32_matmul_precision() == "highest":
        torch.set_float32_matmul_precision("high")


def best_value(metric: str, metrics: dict[str, float], trainer: L.Trainer) -> float | None:
    """The best value of `metric` in the run: the score of the ModelCheckpoint that monitors it (the same on
    every rank), else, with a warning, its last value. What a sweeper optimises (`optimized_metric`)."""
    for callback in trainer.checkpoint_callbacks:
        score = callback.best_model_score if isinstance(callback, ModelCheckpoint) else None
        if score is not None and callback.monitor == metric:
            return float(score)
    if metric in metrics:
        log.warning(f"No ModelCheckpoint monitors {metric}: its last value stands for the run")
    return metrics.get(metric)


def train(cfg: DictConfig) -> tuple[dict[str, float], RunObjects]:
    """Fit (optionally resuming from `cfg.ckpt_path`), then test the best checkpoint; returns metrics."""
    if cfg.get("seed") is not None:
        # the same seed on every rank: identical initial weights everywhere
        L.seed_everything(cfg.seed, workers=True)
    objects = build(cfg)
    if (cfg.get("extras") or {}).get("print_config"):
        print_run_config(cfg, Path(cfg.paths.output_dir) / "config_tree.log")
    trainer, model, datamodule = objects.trainer, objects.model, objects.datamodule
    if isinstance(datamodule, ImageDataModule):  # before Lightning starts the other local ranks
        datamodule.split_batches(trainer.world_size)
    log_run_config(objects.loggers, model.run_config)  # rank zero: W&B / MLflow start their run here
    use_tensor_cores_for_fp32(trainer)
    search_batch_size(cfg, objects)  # only with `+tune=batch_size`

    if cfg.get("train"):
        ckpt_path = checkpoint_to_resume(cfg, trainer)
        decided = os.environ.get(DECIDED_ENV)
        os.environ[DECIDED_ENV] = ckpt_path or ""  # the local ranks Lightning starts follow this decision
        try:
            trainer.fit(model=model, datamodule=datamodule, ckpt_path=ckpt_path)
        except SIGTERMException:
            finish_run(objects)  # report.md of what ran, marked interrupted, and how to resume it
            raise
        except RuntimeError as err:
            detail = state_dict_mismatch(err)
            if detail is None:
                raise
            raise CheckpointError(
                f"ckpt_path={cfg.ckpt_path} does not fit model {cfg.model.net.model_name}: {detail}"
            ) from err
        finally:
            if decided is None:
                os.environ.pop(DECIDED_ENV, None)
    metrics = metric_floats(trainer.callback_metrics)

    checkpoint = trainer.checkpoint_callback
    best = checkpoint.best_model_path if isinstance(checkpoint, ModelCheckpoint) else ""
    objects.best_model_path = best or None
    if cfg.get("test"):
        if best:
            # the path agrees on every rank (the monitored metric is synced); a rank that cannot read
            # it (no shared filesystem) fails loudly instead of testing other weights than its peers
            log.info(f"Testing the best checkpoint: {best}")
            trainer.test(model=model, datamodule=datamodule, ckpt_path=best)
        else:
            log.warning("No best checkpoint found: testing the current weights")
            trainer.test(model=model, datamodule=datamodule)
        metrics.update(metric_floats(trainer.callback_metrics))
    finish_run(objects)  # rank zero: report.md/json and plots in the run dir
    finish_runs()  # W&B's run is process-wide: the next job of a sweep needs its own
    return metrics, objects


def finish_run(objects: RunObjects) -> dict[str, Any] | None:
    """The end of a training task, on global rank zero: checkpoint paths and S3 keys into run_stats.json,
    then the report, then (when an S3 upload callback is there) the report files to S3.

    A failure here is logged, never raised: the run itself has succeeded."""
    trainer = objects.trainer
    if not trainer.is_global_zero:
        return None
    run_dir = Path(objects.cfg.paths.output_dir)
    try:
        from vitrain.callbacks.s3_upload import S3CheckpointUpload  # boto3: only once a run is over

        stats = read_json(run_dir / STATS_FILE) or {}
        # recorded at the end of fit: testing the best checkpoint restores ModelCheckpoint's state from it
        stats["checkpoints"] = stats.get("checkpoints") or checkpoint_paths(trainer)
        uploaders = [c for c in trainer.callbacks if isinstance(c, S3CheckpointUpload)]
        if uploaders:
            stats["s3"] = {"uploaded": uploaders[0].uploaded, "failures": uploaders[0].failures}
        write_json(run_dir / STATS_FILE, redact(stats))
        report = write_report(run_dir)
        log.info("Run report: %s", run_dir / "report.md")
        for uploader in uploaders:
            uploader.upload_run_files(trainer)
        return report
    except Exception:
        log.exception("Writing the run report failed (the run itself succeeded)")
        return None
