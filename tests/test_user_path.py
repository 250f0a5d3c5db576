"""What a new user meets on the way (issue 31): time budgets that hold, honest messages, one-line errors."""

import time
from pathlib import Path

import lightning as L

from helpers import compose_cfg, tiny_overrides
from vitrain.training import train


class SlowStep(L.Callback):
    """Makes every training step take at least `seconds`: a slow machine, in a test."""

    def __init__(self, seconds: float = 0.05) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, *args) -> None:
        time.sleep(self.seconds)


def test_max_time_holds_inside_the_first_epoch(tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    """`trainer.max_time` stops a run whose first epoch cannot fit the budget, even with `min_epochs=1` (the
    seed's command line): mid-epoch, then the final weights are validated, tested and reported once."""
    overrides = [
        *tiny_overrides(tiny_cifar, data_cache, batch_size=2),  # 112 steps an epoch
        "trainer.max_epochs=1000",
        "trainer.min_epochs=1",
        "trainer.max_time=00:00:00:01",
        "trainer.num_sanity_val_steps=0",
        "logger=none",
        "+callbacks.slow_step._target_=test_user_path.SlowStep",
    ]
    metrics, objects = train(compose_cfg("train", overrides, tmp_path))
    steps_per_epoch = objects.trainer.num_training_batches
    assert 0 < objects.trainer.global_step < steps_per_epoch / 2, (
        objects.trainer.global_step,
        steps_per_epoch,
    )
    assert "val/acc1" in metrics and "test/acc1" in metrics
    assert (tmp_path / "report.md").is_file()
