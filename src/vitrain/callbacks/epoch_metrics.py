"""The training epoch's metrics across a mid-epoch resume.

Lightning restores weights, optimizer and loop counters, but torchmetrics' states are no part of a
checkpoint: a run stopped in the middle of an epoch and resumed logged `train/acc1`, `train/acc5` and
`train/loss_epoch` of that epoch over the batches after the resume only. A checkpoint saved with batches of
the epoch still to come (SIGTERM, step-interval saves) now carries the states so far, summed over the ranks
by torchmetrics' own sync; on resume rank 0 starts from them and the other ranks from zero, so the epoch's
figures, summed over the ranks when computed, cover every batch. A checkpoint saved at the epoch's end
carries none: its run goes on with the next epoch.

`ExactResume` (callbacks/resume.py) calls these; the module names its metrics (`training_epoch_metrics`).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torchmetrics import Metric, MetricCollection

#: the checkpoint's key for the states
CHECKPOINT_KEY = "training_epoch_metric_states"


def training_epoch_metrics(pl_module: L.LightningModule) -> dict[str, Metric]:
    """The metrics the module updates every training step and computes at the epoch's end, by name (members
    of a collection as `collection.member`); none for a module that does not say."""
    named = getattr(pl_module, "training_epoch_metrics", None)
    if named is None:
        return {}
    flat: dict[str, Metric] = {}
    for name, metric in named().items():
        if isinstance(metric, MetricCollection):
            flat.update({f"{name}.{k}": m for k, m in metric.items(keep_base=True, copy_state=True)})
        else:
            flat[name] = metric
    return flat


def epoch_in_progress(trainer: L.Trainer) -> bool:
    """Training batches of this epoch done and others to come (an epoch of unknown length never counts)."""
    if trainer.state.fn != TrainerFn.FITTING:
        return False
    total = trainer.num_training_batches
    done = trainer.fit_loop.epoch_loop.batch_progress.current.completed
    return total != float("inf") and 0 < done < total


def states_to_save(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, dict[str, torch.Tensor]]:
    """Every rank calls this (the sum over ranks is a collective): each metric's states summed over the
    ranks, as CPU tensors; the local states are left as they were. Metrics with list states are left out."""
    if not epoch_in_progress(trainer):
        return {}
    saved: dict[str, dict[str, torch.Tensor]] = {}
    for name, metric in training_epoch_metrics(pl_module).items():
        if not all(isinstance(v, torch.Tensor) for v in metric.metric_state.values()):
            continue
        with metric.sync_context(should_sync=trainer.world_size > 1):
            saved[name] = {k: v.detach().to("cpu", copy=True) for k, v in metric.metric_state.items()}
    return saved


def restore_states(pl_module: L.LightningModule, saved: dict[str, Any], global_rank: int) -> None:
    """Put the summed states into rank 0's metrics (the others keep their zeros); a metric whose states
    are not those saved (another model) starts from zero."""
    if global_rank != 0:
        return
    for name, metric in training_epoch_metrics(pl_module).items():
        states = saved.get(name)
        if states and set(states) == set(metric.metric_state):
            for key, value in states.items():
                setattr(metric, key, value.to(metric.device))
