"""`trainer.max_time` with the ranks' stop decision agreed every few steps, not after every batch.

Lightning's Timer (what `Trainer(max_time=...)` adds) checks the time after every training batch and,
under DDP/FSDP, broadcasts rank 0's decision: a collective per step, and on GPUs a host sync per step (the
broadcast of a Python object goes through a GPU tensor and back), which drains the GPU's queue before the
next step is queued. `TimeLimit` is that Timer with the check, and its broadcast, every
`check_every_n_steps` optimizer steps when there are several processes: the step count is the same on every
rank, so every rank stops at the same step, at most n - 1 steps past the budget. A single process checks
after every batch, as before (no collective there). `vitrain.tasks.build.build_trainer` puts it in the
place of Lightning's; the LR schedule's clock and the progress lines find it as the run's Timer.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning as L
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Timer

from vitrain.errors import UserError

#: the cadence of the other agreements between ranks (the SIGTERM check, the LR schedule's clock)
CHECK_EVERY_N_STEPS = 10


class TimeLimit(Timer):
    """Lightning's Timer (interval "step"), its stop decision agreed every `check_every_n_steps` steps."""

    def __init__(
        self, duration: str | timedelta | dict[str, int], check_every_n_steps: int = CHECK_EVERY_N_STEPS
    ) -> None:
        try:
            super().__init__(duration=duration, interval="step")
        except MisconfigurationException:
            raise UserError(
                f"trainer.max_time={duration!r} is no duration: use DD:HH:MM:SS (e.g. 00:12:00:00 for 12 hours), "
                "a dict such as {hours: 12}, or null for no limit"
            ) from None
        remaining = self.time_remaining()  # the duration, before any start
        if remaining is not None and remaining <= 0:  # no step ran, and the run said "completed"
            raise UserError(
                f"trainer.max_time={duration!r}: a run of no time trains nothing; give a positive duration "
                "(DD:HH:MM:SS, e.g. 00:12:00:00 for 12 hours) or null for no limit"
            )
        self.check_every_n_steps = max(int(check_every_n_steps), 1)

    @property
    def state_key(self) -> str:
        # Lightning's Timer's key: a checkpoint written with either resumes the time used
        return "Timer"

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        if trainer.world_size > 1 and trainer.global_step % self.check_every_n_steps:
            return
        super().on_train_batch_end(trainer, *args, **kwargs)
