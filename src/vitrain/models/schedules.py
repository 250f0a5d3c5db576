"""Learning-rate schedules that follow the run's progress in steps and, under `trainer.max_time`, in time.

With a time budget the progress is the larger of steps done / total steps and training time used / budget:
a machine slower than the one the epochs were sized for still warms up, decays and ends at the minimum LR
when Lightning stops the run at `max_time`, instead of being cut mid-warm-up. torch's own schedulers
(LinearLR + CosineAnnealingLR in a SequentialLR) count steps only, hence our own class.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Timer
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler


def warmup_cosine_factor(
    progress: float, total_steps: int, warmup_fraction: float, min_lr_ratio: float
) -> float:
    """LR / base LR at `progress` in [0, 1]: linear warm-up over `warmup_fraction`, then cosine decay to
    `min_lr_ratio` (torch's LinearLR + CosineAnnealingLR in closed form). Warm-up starts at 1/warmup_steps,
    not 0, so the first step already learns."""
    steps = progress * total_steps  # progress in step units, fractional when time leads
    warmup = min(max(math.ceil(total_steps * warmup_fraction), 1), total_steps) if warmup_fraction > 0 else 0
    if steps < warmup:
        return 1 / warmup + (1 - 1 / warmup) * steps / warmup
    decay = min((steps - warmup) / max(total_steps - warmup, 1), 1.0)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * decay))


class TrainingClock:
    """Training seconds used so far, equal on every rank, from Lightning's Timer (the one `max_time` makes,
    which also stops the run).

    Each rank's own clock differs by milliseconds, and ranks whose LRs differ drift apart silently (DDP
    averages gradients, not weights). So rank 0's reading is broadcast every `sync_every_n_steps` calls and
    held in between: one small collective per N steps (none in a single process, where broadcast is a no-op).
    """

    def __init__(self, trainer: L.Trainer, timer: Timer, sync_every_n_steps: int = 10) -> None:
        self.trainer, self.timer = trainer, timer
        self.sync_every_n_steps = max(int(sync_every_n_steps), 1)
        # elapsed + remaining = Timer's duration, through its public methods
        self.budget_s = float(timer.time_elapsed() + (timer.time_remaining() or 0.0))
        self._calls = 0
        self._agreed = 0.0

    @classmethod
    def of(cls, trainer: L.Trainer | None, sync_every_n_steps: int = 10) -> TrainingClock | None:
        """The clock of `trainer`'s time budget, or None when `trainer.max_time` is not set."""
        timers = [c for c in getattr(trainer, "callbacks", []) if isinstance(c, Timer)]
        if not timers or timers[0].time_remaining() is None:
            return None
        return cls(trainer, timers[0], sync_every_n_steps)

    def __call__(self) -> float:
        # the first call is the scheduler's construction, before training: no collective there
        if self._calls and self._calls % self.sync_every_n_steps == 0:
            self._agreed = float(self.trainer.strategy.broadcast(self.timer.time_elapsed(), src=0))
        self._calls += 1
        return self._agreed


class WarmupCosine(LRScheduler):
    """Linear warm-up over `warmup_fraction` of the run, then cosine decay to `min_lr_ratio` x each group's LR.

    `clock` (seconds used, the same on every rank) with `time_budget_s` makes the progress
    max(steps / total_steps, time / budget); progress never goes back, and it is saved with the time used,
    so a resumed run continues where it stopped. Per parameter group, so groups with their own LR (layer
    decay) keep their ratios.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        warmup_fraction: float = 0.05,
        min_lr_ratio: float = 0.01,
        clock: Callable[[], float] | None = None,
        time_budget_s: float | None = None,
        last_epoch: int = -1,
    ) -> None:
        self.total_steps = max(int(total_steps), 1)
        self.warmup_fraction, self.min_lr_ratio = float(warmup_fraction), float(min_lr_ratio)
        self.time_budget_s = float(time_budget_s) if time_budget_s else None
        self._clock = clock if self.time_budget_s else None
        self.time_used_s = 0.0
        self.progress = 0.0
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        progress = self.last_epoch / self.total_steps
        if self._clock is not None:
            self.time_used_s = max(self.time_used_s, float(self._clock()))
            progress = max(progress, self.time_used_s / self.time_budget_s)
        self.progress = min(max(self.progress, progress), 1.0)
        factor = warmup_cosine_factor(
            self.progress, self.total_steps, self.warmup_fraction, self.min_lr_ratio
        )
        return [base_lr * factor for base_lr in self.base_lrs]

    def state_dict(self) -> dict[str, Any]:
        # plain numbers only (the clock holds the trainer): loads with torch.load(weights_only=True)
        return {k: v for k, v in super().state_dict().items() if k != "_clock"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # the resumed run's own length and budget (its trainer.max_epochs / max_time) apply from here on;
        # progress and time used continue from the saved ones
        keep = {"total_steps": self.total_steps, "time_budget_s": self.time_budget_s}
        super().load_state_dict(state_dict)
        self.__dict__.update(keep)


def warmup_cosine(
    optimizer: Optimizer,
    total_steps: int,
    warmup_fraction: float = 0.05,
    min_lr_ratio: float = 0.01,
    follow_max_time: bool = True,
    time_sync_every_n_steps: int = 10,
    trainer: L.Trainer | None = None,
) -> WarmupCosine:
    """`model.scheduler`'s target: WarmupCosine over `total_steps`, following `trainer.max_time` when set
    (and `follow_max_time`); ranks agree on the time used every `time_sync_every_n_steps` steps."""
    clock = TrainingClock.of(trainer, time_sync_every_n_steps) if follow_max_time else None
    return WarmupCosine(
        optimizer,
        total_steps,
        warmup_fraction,
        min_lr_ratio,
        clock=clock,
        time_budget_s=clock.budget_s if clock else None,
    )
