"""What a run is made of, built from the config alike for training, evaluation and the batch-size search:
the datamodule, the model (its head sized to the data's classes), callbacks, loggers and the trainer."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.errors import InstantiationException
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger, WandbLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, open_dict

from vitrain.callbacks.empty_epoch import EmptyEpochCheck
from vitrain.callbacks.resume import CheckpointOnSigterm
from vitrain.callbacks.run_stats import RunStats
from vitrain.callbacks.time_limit import TimeLimit
from vitrain.compat import drop_wandb_anonymous
from vitrain.errors import DataError, ModelError, UserError, argument_error
from vitrain.loggers import MetricRecord
from vitrain.models.timm_net import check_pretrained_available
from vitrain.tasks.precision import resolve_precision
from vitrain.tasks.runs import RemoteCopy, configured_last, resolve_checkpoint, resume_hint, stable_run_id
from vitrain.utils.config import instantiate_dict, instantiate_node, plain, to_container

log = logging.getLogger(__name__)


@dataclass
class RunObjects:
    """What `build` makes from the config, and what the run adds: the second result of every task."""

    cfg: DictConfig
    datamodule: L.LightningDataModule
    model: L.LightningModule
    callbacks: list[Callback]
    loggers: list[Logger]
    trainer: L.Trainer
    #: where the run keeps a copy of its checkpoints off this machine (the S3 upload callback), if anywhere
    remote: RemoteCopy | None = None
    #: the checkpoint `fit` starts from (None: from scratch), decided before the loggers start their runs
    resume_from: str | None = None
    #: the best checkpoint after fit (None: none was saved)
    best_model_path: str | None = None
    #: the batch-size search's result (`+tune=batch_size`, vitrain/tasks/tuning.py)
    batch_size_search: dict[str, Any] | None = None
    #: evaluation: the checkpoint evaluated (a local path) and the accuracy per class
    checkpoint_path: Path | None = None
    per_class_acc: dict[str, float] = field(default_factory=dict)
    #: images of each class evaluated (eval.py)
    per_class_images: dict[str, int] = field(default_factory=dict)


def build(cfg: DictConfig) -> RunObjects:
    """Datamodule, model, callbacks, loggers and trainer, exactly as the config says."""
    # weights that cannot be had fail in seconds, before any data is decoded
    start_from = None
    try:
        check_pretrained_available(cfg.model.net, cfg.model.get("weights_file"))
    except ModelError as err:
        start_from = resumed_instead(cfg, err)
    datamodule: L.LightningDataModule = instantiate_node(cfg.datamodule, "datamodule")
    model: L.LightningModule = build_model(cfg, datamodule, start_from)
    run_config = to_container(cfg)
    # the images' normalisation, recorded in the checkpoints (a datamodule of yours may not say it)
    mean, std = getattr(datamodule, "mean", None), getattr(datamodule, "std", None)
    normalisation = {"mean": mean, "std": std} if mean and std else None
    model.describe_run(run_config, list(datamodule.classes), normalisation)
    callbacks = instantiate_dict(cfg.get("callbacks"))
    launched_as = stable_run_id()  # before the strategy's launcher adds its variables to the environment
    for callback in callbacks:
        if isinstance(callback, RunStats | CheckpointOnSigterm):  # an interrupted run says how to resume it
            callback.resume_hint = partial(resume_hint, run_config, cfg.paths.output_dir, launched_as)
    loggers = instantiate_dict(cfg.get("logger"))
    for logger in loggers:
        if isinstance(logger, WandbLogger):
            drop_wandb_anonymous(logger)
    time_budget_wins(cfg.trainer)
    warn_shared_checkpoint_dir(cfg)
    # the run's own metric record (metrics.jsonl), beside any logger or none: what the report reads
    trainer = build_trainer(cfg, callbacks, [*loggers, MetricRecord(cfg.paths.output_dir)])
    if hasattr(model, "check_strategy"):  # options the strategy cannot honour stop before the ranks start
        model.check_strategy(trainer.strategy, fitting=bool(cfg.get("train")))
    remote = next((c for c in callbacks if isinstance(c, RemoteCopy)), None)
    return RunObjects(cfg, datamodule, model, callbacks, loggers, trainer, remote=remote)


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


def build_trainer(
    cfg: DictConfig, callbacks: list[Callback], loggers: list[Logger] | bool, float8: bool | None = None
) -> L.Trainer:
    """`cfg.trainer` with these callbacks and loggers, and `trainer.precision=auto` chosen for this machine;
    `float8`: whether the model computes in float8 (default: `cfg.model.float8`)."""
    extra = {}
    if float8 is None:
        float8 = bool((cfg.get("model") or {}).get("float8"))
    if float8:
        # torchao's float8 tensors cannot run under torch.inference_mode with autocast (an unsupported
        # aten.to): evaluation runs under no_grad instead, as FSDP's does
        extra["inference_mode"] = False
    if cfg.trainer.get("max_time"):
        # Lightning's Timer broadcasts its decision after every batch under DDP/FSDP (a sync per step on
        # GPUs); ours agrees every few steps (vitrain/callbacks/time_limit.py) and takes its place
        callbacks = [*callbacks, TimeLimit(duration=plain(cfg.trainer.max_time))]
        extra["max_time"] = None
    callbacks = [*callbacks, EmptyEpochCheck()]
    precision = resolve_precision(cfg.trainer)
    try:
        trainer: L.Trainer = hydra.utils.instantiate(
            cfg.trainer, callbacks=callbacks, logger=loggers, precision=precision, **extra
        )
    except InstantiationException as err:
        # Lightning checks its arguments as it starts (`max_steps` must be a non-negative integer or -1):
        # one line naming the key, not Hydra's three-line wrapper; errors of ours inside it pass through
        cause = err.__cause__
        if isinstance(
            cause, MisconfigurationException | ValueError | TypeError | ImportError
        ) and not isinstance(cause, UserError):
            raise argument_error("trainer", cfg.trainer, cause) from err
        raise
    return trainer


def resumed_instead(cfg: DictConfig, unavailable: ModelError) -> str:
    """The checkpoint a training run resumes from, to build its model from where its pretrained weights
    cannot be had (offline, not in the hub's cache): the checkpoint's weights replace them as fit starts,
    and it records the normalisation they were trained with. A named one, or the `last` that `ckpt_path=last`
    or a relaunch (`resume=auto`: SLURM's requeue on a node without the hub) finds in the run's checkpoint
    folder. Else the error: there is nothing to stand in."""
    ckpt_path = cfg.get("ckpt_path")
    if cfg.get("train") and (not ckpt_path or ckpt_path == "last"):
        ckpt_path = configured_last(cfg)
        if ckpt_path is None and cfg.get("ckpt_path") == "last":  # kept off this machine only (S3)
            raise ModelError(
                f"{unavailable}; to resume without them, name the checkpoint: ckpt_path=<run dir>/checkpoints/"
                "last.ckpt or its s3:// copy (its weights replace them)"
            ) from None
    if not cfg.get("train") or not ckpt_path:
        raise unavailable
    log.warning(f"{unavailable}; the model starts from {ckpt_path} instead, which the run resumes")
    return str(ckpt_path)


def build_model(
    cfg: DictConfig, datamodule: L.LightningDataModule, start_from: str | None = None
) -> L.LightningModule:
    """The model with its head sized to the classes the datamodule found (written into `cfg`, so the config
    a checkpoint stores has the number); the datamodule learns the model's input spec in return.
    `start_from`: a checkpoint to take the weights from in place of the configured ones (`resumed_instead`)."""
    classes = list(datamodule.classes)
    with open_dict(cfg):
        cfg.model.net.num_classes = head_size(cfg.model.net.get("num_classes"), classes)
    configured = cfg.model.get("weights_file")
    weights_file = start_from or configured
    local = {}
    if weights_file and (start_from or str(weights_file).startswith("s3://")):
        # an s3:// one fetched (verified, cached: one download per machine) as ckpt_path is
        local["weights_file"] = str(resolve_checkpoint(str(weights_file), cfg.paths.cache_dir))
    model: L.LightningModule = instantiate_node(cfg.model, "model", **local)
    if local:  # the checkpoint's hyperparameters name what the config does, not the cache or a stand-in
        model.hparams.weights_file = configured
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
