"""What global rank zero decides for the other ranks of one launch, in one place.

A run launched as one process that Lightning fans out (its launcher re-runs the command for local ranks
1..N-1) must not let every rank decide on its own: the checkpoint to resume from, the CPU's bf16 speed-up
and the batch-size search's result are each decided once, by the launching process, before the others start.
They travel in the environment, which the started processes inherit: one variable per decision, all named
`VITRAIN_<NAME>`, holding text (plain, or JSON for structured values).

- `decide(name, make)`: the value already decided (by the launching process, or by an earlier call in this
  one), else `make()`'s, kept for the rest of the launch (the CPU probe: measured once per launch).
- `holding({name: value})`: the values for the duration of one phase (fit), then the variable is as it was: a
  second run in the same process (tests, a sweep) decides anew.
- `get(name)` / `get_json(name)`: what rank zero decided, None when it decided nothing.

A user may set a variable to decide for the run (`VITRAIN_CPU_BF16_SPEEDUP=0.5`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any

PREFIX = "VITRAIN_"
# the decisions, by name (the environment variable is PREFIX + name)
RESUME_FROM = "RESUME_FROM"  # the checkpoint `trainer.fit` starts from ("" = from scratch)
CPU_BF16_SPEEDUP = "CPU_BF16_SPEEDUP"  # bf16 / fp32 matmul speed of this CPU (trainer.precision=auto)
BATCH_SIZE_SEARCH = "BATCH_SIZE_SEARCH"  # the batch-size search's result, JSON (`+tune=batch_size`)


class RankZeroDecisions:
    """Decisions global rank zero hands to the processes it launches, through their environment."""

    def __init__(self, env: MutableMapping[str, str] | None = None) -> None:
        self.env = os.environ if env is None else env

    @staticmethod
    def variable(name: str) -> str:
        return PREFIX + name

    def get(self, name: str) -> str | None:
        return self.env.get(self.variable(name))

    def get_json(self, name: str) -> Any:
        value = self.get(name)
        return None if value is None else json.loads(value)

    def decide(self, name: str, make: Callable[[], str]) -> str:
        """The decided value, or `make()`'s, stored (as this launch's decision) and returned as stored."""
        value = self.get(name)
        if value is None:
            value = self.env[self.variable(name)] = make()
        return value

    @contextmanager
    def holding(self, values: Mapping[str, str]) -> Iterator[None]:
        """These decisions (name: value) while the block runs (the processes started in it inherit them);
        afterwards each variable is as it was."""
        before = {name: self.get(name) for name in values}
        self.env.update({self.variable(name): value for name, value in values.items()})
        try:
            yield
        finally:
            for name, value in before.items():
                if value is None:
                    self.env.pop(self.variable(name), None)
                else:
                    self.env[self.variable(name)] = value


decisions = RankZeroDecisions()
