"""What Lightning leaves out of a checkpoint for an exact resume, and a checkpoint on SIGTERM."""

import logging
from pathlib import Path
from typing import Any

import lightning as L
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger(__name__)


class ExactResume(Callback):
    """Saves the random number generators with each checkpoint and restores them on resume.

    Lightning restores weights, optimizer, schedule and loop counters but not the global RNGs that drive
    our on-device augmentation and drop-path: without them a resumed run draws other crops than the run it
    continues. Only training draws from them (our loaders have private generators), so the state after
    the last completed batch is the one to continue from — also for a SIGTERM save, which happens after
    the next batch was already fetched and augmented. Restored when training starts (Lightning does not call
    `on_train_epoch_start` again for an epoch it resumes in the middle).
    """

    def __init__(self) -> None:
        self._pending: dict[str, Any] | None = None
        self._after_last_batch: dict[str, Any] | None = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._after_last_batch = _collect_rng_states()  # a few KB copied: microseconds a step

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        checkpoint["rng_states"] = self._after_last_batch or _collect_rng_states()

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self._pending = checkpoint.get("rng_states")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._pending is not None:
            _set_rng_states(self._pending)
            self._pending = None


class CheckpointOnSigterm(Callback):
    """On SIGTERM (spot reclaim, `kill`, SLURM), every rank stops at the same step and `last` is saved.

    Lightning already catches SIGTERM, agrees across ranks and raises SIGTERMException at a step boundary;
    it does not save. We save through the trainer (a collective: all ranks take part, as FSDP needs) into
    the ModelCheckpoint's `last` path, so `ckpt_path=last` resumes from it mid-epoch.
    """

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        # with several processes Lightning stops at this point itself (after agreeing across ranks); alone,
        # it would train on to the end of the epoch first
        if trainer.received_sigterm and trainer.world_size == 1:
            raise SIGTERMException

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException) or trainer.state.fn != TrainerFn.FITTING:
            return
        checkpoint = trainer.checkpoint_callback
        if not isinstance(checkpoint, ModelCheckpoint) or checkpoint.dirpath is None:
            log.warning("SIGTERM: no ModelCheckpoint configured, nothing saved")
            return
        path = Path(checkpoint.dirpath) / f"{checkpoint.CHECKPOINT_NAME_LAST}{checkpoint.FILE_EXTENSION}"
        trainer.save_checkpoint(path)
        if trainer.is_global_zero:
            log.warning(f"SIGTERM: saved {path} at step {trainer.global_step}; relaunch with ckpt_path=last")
