"""The LR schedule: warm-up + cosine by step, and by time under `trainer.max_time` (fake clocks, then a real run)."""

import io
import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Timer

from helpers import compose_cfg, tiny_overrides
from vitrain.models.schedules import TrainingClock, WarmupCosine, warmup_cosine, warmup_cosine_factor
from vitrain.tasks.precision import choose_precision, cpu_bf16_choice
from vitrain.tasks.training import train


def _optimizer(lrs: tuple[float, ...] = (1e-3,)) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups)


class FakeClock:
    """Seconds used, advanced by hand: the schedule's only source of time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(scheduler: WarmupCosine, clock: FakeClock | None, steps: int, dt: float = 0.0) -> list[float]:
    lrs = []
    for _ in range(steps):
        scheduler.optimizer.step()
        if clock is not None:
            clock.now += dt
        scheduler.step()
        lrs.append(scheduler.optimizer.param_groups[0]["lr"])
    return lrs


def test_factor_warms_up_then_decays_to_the_minimum():
    total, warmup = 100, 10  # warmup_fraction 0.1
    f = [warmup_cosine_factor(s / total, total, 0.1, 0.01) for s in range(total + 1)]
    assert f[0] == pytest.approx(1 / warmup)  # the first step already learns
    assert all(a < b for a, b in itertools.pairwise(f[: warmup + 1]))
    assert f[warmup] == pytest.approx(1.0)
    assert f[(total + warmup) // 2] == pytest.approx(0.01 + 0.99 * 0.5)  # half way through the cosine
    assert all(a >= b for a, b in itertools.pairwise(f[warmup:]))
    assert f[total] == pytest.approx(0.01)
    assert warmup_cosine_factor(1.0, total, 0.0, 0.01) == pytest.approx(0.01)
    assert warmup_cosine_factor(0.0, total, 0.0, 0.01) == pytest.approx(1.0)  # no warm-up


def test_steps_alone_without_a_time_budget():
    scheduler = warmup_cosine(
        _optimizer((1e-3, 1e-4)), total_steps=50, warmup_fraction=0.1, min_lr_ratio=0.01
    )
    assert scheduler.time_budget_s is None  # no trainer, no max_time
    _run(scheduler, None, 50)
    low, high = scheduler.optimizer.param_groups[1]["lr"], scheduler.optimizer.param_groups[0]["lr"]
    assert high == pytest.approx(1e-5) and low == pytest.approx(1e-6)  # per group: ratios kept
    _run(scheduler, None, 5)  # past the end: stays at the minimum
    assert scheduler.optimizer.param_groups[0]["lr"] == pytest.approx(1e-5)


def test_time_leads_when_the_machine_is_slow():
    """1000 planned steps, 100 s budget, 1 s per step: time sets the progress, the LR is down at step 100."""
    clock = FakeClock()
    scheduler = WarmupCosine(_optimizer(), 1000, 0.1, 0.01, clock=clock, time_budget_s=100)
    lrs = _run(scheduler, clock, 100, dt=1.0)
    assert lrs[4] == pytest.approx(1e-3 * warmup_cosine_factor(0.05, 1000, 0.1, 0.01))  # mid warm-up
    assert lrs[49] == pytest.approx(1e-3 * warmup_cosine_factor(0.5, 1000, 0.1, 0.01))
    assert lrs[-1] == pytest.approx(1e-5) and scheduler.progress == 1.0
    assert scheduler.time_used_s == pytest.approx(100)


def test_steps_lead_when_the_machine_is_fast():
    clock = FakeClock()
    scheduler = WarmupCosine(_optimizer(), 100, 0.1, 0.01, clock=clock, time_budget_s=1000)
    lrs = _run(scheduler, clock, 100, dt=1.0)  # 100 s of a 1000 s budget
    reference = WarmupCosine(_optimizer(), 100, 0.1, 0.01)
    assert lrs == pytest.approx(_run(reference, None, 100))
    assert lrs[-1] == pytest.approx(1e-5)


def test_resume_continues_exactly_and_never_goes_back():
    def make(clock):
        return WarmupCosine(_optimizer(), 400, 0.1, 0.01, clock=clock, time_budget_s=50)

    clock = FakeClock()
    straight = make(clock)
    _run(straight, clock, 30, dt=0.5)
    buffer = io.BytesIO()
    torch.save(straight.state_dict(), buffer)
    expected = _run(straight, clock, 40, dt=0.5)

    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)  # plain numbers: no clock, no trainer inside
    assert state["time_used_s"] == pytest.approx(15.0) and state["progress"] == pytest.approx(0.3)
    assert "_clock" not in state
    resumed_clock = FakeClock()
    resumed_clock.now = 15.0  # Lightning's Timer restores its elapsed time from the checkpoint
    resumed = make(resumed_clock)
    resumed.load_state_dict(state)
    assert _run(resumed, resumed_clock, 40, dt=0.5) == pytest.approx(expected)

    # a clock that restarts from zero (no Timer state) cannot rewind the schedule
    restarted = make(FakeClock())
    restarted.load_state_dict(state)
    first = _run(restarted, None, 1)[0]
    assert first == pytest.approx(1e-3 * warmup_cosine_factor(0.3, 400, 0.1, 0.01))


class FakeTimer:
    """Lightning Timer's public face: time_elapsed / time_remaining."""

    def __init__(self, budget: float, elapsed: float = 0.0) -> None:
        self.budget, self.elapsed = budget, elapsed

    def time_elapsed(self) -> float:
        return self.elapsed

    def time_remaining(self) -> float:
        return self.budget - self.elapsed


def test_clock_uses_rank_zeros_time_every_n_steps():
    """Every rank's LR comes from rank 0's reading, broadcast every N steps: never from its own clock."""
    rank0_time = [0.0]
    broadcasts = []

    def broadcast(value, src=0):
        broadcasts.append(value)
        return rank0_time[0]  # what rank 0 sent, whatever this rank measured

    timer = FakeTimer(budget=100.0)
    trainer = SimpleNamespace(strategy=SimpleNamespace(broadcast=broadcast), callbacks=[])
    clock = TrainingClock(trainer, timer, sync_every_n_steps=5)
    assert clock.budget_s == 100.0
    scheduler = WarmupCosine(_optimizer(), 10_000, 0.0, 0.01, clock=clock, time_budget_s=clock.budget_s)
    assert broadcasts == []  # construction: no collective
    readings = []
    for step in range(1, 21):
        timer.elapsed = step + 0.123  # this rank's own clock: never used
        rank0_time[0] = float(step)
        scheduler.step()
        readings.append(scheduler.time_used_s)
    assert len(broadcasts) == 4  # steps 5, 10, 15, 20
    assert readings[:4] == [0.0] * 4 and readings[4:9] == [5.0] * 5 and readings[-1] == 20.0
    lr = scheduler.optimizer.param_groups[0]["lr"]
    assert lr == pytest.approx(1e-3 * warmup_cosine_factor(0.2, 10_000, 0.0, 0.01))


def test_no_clock_without_max_time():
    assert TrainingClock.of(SimpleNamespace(callbacks=[])) is None
    assert TrainingClock.of(None) is None


class TimerAtStepStart(L.Callback):
    """The Timer's training time (what the schedule's clock reads) when each training step starts."""

    def __init__(self) -> None:
        self.elapsed: list[float] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:
        self.elapsed.append(next(c for c in trainer.callbacks if isinstance(c, Timer)).time_elapsed())


def test_budgeted_run_stops_at_max_time_with_the_lr_at_its_minimum(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path
):
    """A real run whose epochs cannot fit its 6 s budget: Lightning stops it at max_time, the LR has decayed,
    the final weights are validated and tested. `precision=auto` is resolved for this machine and reported.
    Nothing here assumes how long a step takes: a fast machine makes thousands, a loaded one a few long ones."""
    overrides = [
        *tiny_overrides(tiny_cifar, data_cache, batch_size=2),  # 112 steps an epoch
        "trainer.precision=auto",
        "trainer.max_epochs=1000",
        "trainer.min_epochs=0",  # may stop inside the first epoch
        "trainer.max_time=00:00:00:06",
        "trainer.num_sanity_val_steps=0",
        "model.scheduler.warmup_fraction=0.1",
        "model.scheduler.min_lr_ratio=0.01",
        "model.scheduler.time_sync_every_n_steps=1",
        "logger=none",
        "+callbacks.step_starts._target_=test_schedules.TimerAtStepStart",
    ]
    metrics, objects = train(compose_cfg("train", overrides, tmp_path))
    trainer = objects.trainer
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert isinstance(scheduler, WarmupCosine) and scheduler.time_budget_s == 6.0
    # time, not steps, ended it: the Timer ran out, long before the epochs did
    timer = next(c for c in trainer.callbacks if isinstance(c, Timer))
    assert timer.time_elapsed() >= 6.0 and 0 < trainer.global_step < trainer.estimated_stepping_batches
    # the last LR was set from the clock inside the last step (when the step started at the latest: a loaded
    # machine makes that step long); the progress is that time's share of the budget (steps count for nothing)
    (step_starts,) = (c for c in trainer.callbacks if isinstance(c, TimerAtStepStart))
    assert len(step_starts.elapsed) == trainer.global_step
    last_start = step_starts.elapsed[-1]
    assert scheduler.time_used_s >= last_start, (last_start, scheduler.state_dict())
    assert scheduler.progress == pytest.approx(min(1.0, scheduler.time_used_s / 6.0)), scheduler.state_dict()
    group = trainer.optimizers[0].param_groups[0]
    # the factor the schedule itself computes at its final progress (its own steps, warm-up and floor): down
    # the cosine to the last step's start at least, near the 1 % floor when steps are short
    factor = warmup_cosine_factor(
        scheduler.progress, scheduler.total_steps, scheduler.warmup_fraction, scheduler.min_lr_ratio
    )
    assert group["lr"] / group["initial_lr"] <= factor + 1e-9
    assert "test/acc1" in metrics and "val/acc1" in metrics

    expected = choose_precision("cpu", cpu_bf16=cpu_bf16_choice()[0])
    assert str(trainer.precision) == expected
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["precision"] == expected
    assert f"{expected} (auto)" in (tmp_path / "report.md").read_text()
