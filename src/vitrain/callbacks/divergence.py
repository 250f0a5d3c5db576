"""A run whose training loss stays NaN or infinite stops, and its report says so.

Without it a diverged run (a learning rate far too high, a bad batch that poisoned the weights) trains on to
its last epoch: hours of GPU time on NaN weights, `stopped: completed` in the report, and its loss rows
missing (JSON has no NaN). Lightning's `EarlyStopping(check_finite=True)` looks at a validation metric once an
epoch, and only in runs with early stopping.

The check reads the loss the module already copies to the host on the steps the loggers write
(`log_every_n_steps`): no host sync of its own. A single non-finite loss is not divergence under
`16-mixed`, whose gradient scaler skips a step that overflowed and trains on: the run stops when `patience`
log steps in a row saw one. Ranks decide together (one all-reduce on log steps, under DDP/FSDP): the rank
whose batch overflowed may be the only one to see it at that step, and a rank that stopped alone would leave
the others waiting in their next collective.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from vitrain.compat import should_update_logs

log = logging.getLogger(__name__)

#: how run_stats.json and the report name the stop
DIVERGED = "a NaN or infinite training loss (diverged)"


class StopOnDivergence(Callback):
    """Stop fit when the training loss was NaN or infinite at `patience` log steps in a row (on any rank)."""

    def __init__(self, patience: int = 2) -> None:
        if int(patience) < 1:
            raise ValueError(f"patience={patience} must be at least 1")
        self.patience = int(patience)
        self._seen, self._checked_step = 0, -1
        #: where the run stopped: {"step": ..., "epoch": ...} (vitrain/callbacks/run_stats.py records it)
        self.stopped: dict[str, Any] | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._seen, self._checked_step, self.stopped = 0, -1, None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        # once a step: the micro-batches of an accumulated step all log (and see the same global_step)
        if not should_update_logs(trainer) or trainer.global_step == self._checked_step:
            return
        self._checked_step = trainer.global_step
        loss = getattr(pl_module, "logged_train_loss", None)  # this step's, on the host (classifier.py)
        bad = loss is not None and not math.isfinite(loss)
        if trainer.world_size > 1:
            bad = trainer.strategy.reduce_boolean_decision(bad, all=False)
        self._seen = self._seen + 1 if bad else 0
        if self._seen < self.patience:
            return
        self.stopped = {"step": trainer.global_step, "epoch": trainer.current_epoch}
        trainer.should_stop = True
        if trainer.is_global_zero:
            log.error(
                "The training loss was NaN or infinite at %d log steps in a row (step %d, epoch %d): the run "
                "diverged and stops. Lower model.optimizer.lr, lengthen the warm-up "
                "(model.scheduler.warmup_fraction) or clip the gradients (trainer.gradient_clip_val=1.0); "
                "last.ckpt holds the diverged weights, the best checkpoint those of its best validation",
                self.patience,
                trainer.global_step,
                trainer.current_epoch,
            )
