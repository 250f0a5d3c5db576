"""Callbacks for multi-process test runs: the collectives each training step issued, per rank, as recorded by
torch.profiler (c10d's ops), from one batch end to the next, written to `<out>/collectives_<rank>.json`; and a
time budget spent at a chosen step, whatever the machine's speed."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Timer
from torch.profiler import ProfilerActivity, profile


class CollectiveProbe(L.Callback):
    def __init__(self, out: str, first: int = 3, last: int = 14) -> None:
        self.out, self.first, self.last = Path(out), first, last
        self.profiler: Any = None
        self.per_step: dict[int, dict[str, int]] = {}

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            names = collections.Counter(e.name for e in self.profiler.events() if e.name.startswith("c10d::"))
            self.per_step[trainer.global_step] = dict(names)
            self.profiler = None
        if self.first <= trainer.global_step < self.last:
            self.profiler = profile(activities=[ProfilerActivity.CPU])
            self.profiler.__enter__()

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"collectives_{trainer.global_rank}.json").write_text(json.dumps(self.per_step))


class SpendBudgetAt(L.Callback):
    """At training step `step`, marks the run's `trainer.max_time` as used up, through the Timer's own resume
    path (the time a checkpoint says was spent): the budget then ends at that step on a fast machine and a slow
    one alike. (Sleeping until the budget ran out needed every machine to get there within the budget: a slow
    CI run did not, and stopped at the agreement before.)"""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            timer = next(c for c in trainer.callbacks if isinstance(c, Timer))
            spent = timer.time_elapsed() + (timer.time_remaining() or 0.0)  # the whole budget, before now
            timer.load_state_dict({"time_elapsed": {"train": spent}})
