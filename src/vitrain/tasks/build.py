"""What a run is made of, built from the config alike for training, evaluation and the batch-size search:
the datamodule, the model (its head sized to the data's classes), callbacks, loggers and the trainer."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig, open_dict

from vitrain.errors import DataError
from vitrain.loggers import MetricRecord
from vitrain.tasks.precision import resolve_precision
from vitrain.tasks.runs import RemoteCopy
from vitrain.utils.config import instantiate_dict, to_container


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
    #: the best checkpoint after fit (None: none was saved)
    best_model_path: str | None = None
    #: the batch-size search's result (`+tune=batch_size`, vitrain/tasks/tuning.py)
    batch_size_search: dict[str, Any] | None = None
    #: evaluation: the checkpoint evaluated (a local path) and the accuracy per class
    checkpoint_path: Path | None = None
    per_class_acc: dict[str, float] = field(default_factory=dict)


def build(cfg: DictConfig) -> RunObjects:
    """Datamodule, model, callbacks, loggers and trainer, exactly as the config says."""
    datamodule: L.LightningDataModule = hydra.utils.instantiate(cfg.datamodule)
    model: L.LightningModule = build_model(cfg, datamodule)
    model.describe_run(to_container(cfg), list(datamodule.classes))
    callbacks = instantiate_dict(cfg.get("callbacks"))
    loggers = instantiate_dict(cfg.get("logger"))
    # the run's own metric record (metrics.jsonl), beside any logger or none: what the report reads
    trainer = build_trainer(cfg, callbacks, [*loggers, MetricRecord(cfg.paths.output_dir)])
    if hasattr(model, "check_strategy"):  # options the strategy cannot honour stop before the ranks start
        model.check_strategy(trainer.strategy, fitting=bool(cfg.get("train")))
    remote = next((c for c in callbacks if isinstance(c, RemoteCopy)), None)
    return RunObjects(cfg, datamodule, model, callbacks, loggers, trainer, remote=remote)


def build_trainer(cfg: DictConfig, callbacks: list[Callback], loggers: list[Logger] | bool) -> L.Trainer:
    """`cfg.trainer` with these callbacks and loggers, and `trainer.precision=auto` chosen for this machine."""
    trainer: L.Trainer = hydra.utils.instantiate(
        cfg.trainer, callbacks=callbacks, logger=loggers, precision=resolve_precision(cfg.trainer)
    )
    return trainer


def build_model(cfg: DictConfig, datamodule: L.LightningDataModule) -> L.LightningModule:
    """The model with its head sized to the classes the datamodule found (written into `cfg`, so the config
    a checkpoint stores has the number); the datamodule learns the model's input spec in return."""
    classes = list(datamodule.classes)
    with open_dict(cfg):
        cfg.model.net.num_classes = head_size(cfg.model.net.get("num_classes"), classes)
    model: L.LightningModule = hydra.utils.instantiate(cfg.model)
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
