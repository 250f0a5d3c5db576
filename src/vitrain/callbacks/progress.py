"""Progress where people look: plain lines in log files, Rich's bar and summary without what means nothing here.

Rich's bar draws only in a terminal: piped to a file (nohup, SLURM, `tee`) it shows its last frame at the
end. `ProgressLog` writes a plain line (step, epoch, loss, images/s, ETA) every `interval_s` when stdout is
not a terminal, and one line per epoch always (in `train.log` as well as on the console); the same for a
test, a prediction (src/predict.py) and a validation outside fit (`src/eval.py split=val`): a line per
`interval_s` (batches, images/s, ETA), and one when it is done (images of all processes, time, images/s).
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, RichModelSummary, Timer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_only

from vitrain.callbacks.epoch_metrics import epoch_in_progress
from vitrain.callbacks.throughput import batch_size
from vitrain.compat import EpochsFromOneBar

log = logging.getLogger("vitrain.progress")


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class ProgressLog(Callback):
    """A plain progress line every `interval_s` seconds of training when stdout is not a terminal (or
    always, with `always=true`), and a summary line per epoch in every case. Global rank zero only; the loss
    is read from the device once per line, not per step."""

    def __init__(self, interval_s: float = 30.0, always: bool = False) -> None:
        self.interval_s = float(interval_s)
        self.always = always
        self._lines = False
        self._epoch_loss: Any = None
        self._epoch_batches = 0
        self._epoch_images = 0
        self._epoch_t0 = 0.0
        self._resumed_mid_epoch = False
        # an evaluation pass (test, predict, validate outside fit): start, last line, images here, since then
        self._pass_t0 = self._pass_last = 0.0
        self._pass_images = self._pass_since = 0

    @rank_zero_only
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._lines = self.always or not sys.stdout.isatty()
        self._t0 = self._last_t = self._epoch_t0 = time.perf_counter()
        self._step0 = self._last_step = trainer.global_step
        self._images_since = 0
        # resumed in the middle of an epoch: no on_train_epoch_start for it, and its line covers the rest only
        self._resumed_mid_epoch = epoch_in_progress(trainer)

    @rank_zero_only
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_loss, self._epoch_batches, self._epoch_images = None, 0, 0
        self._epoch_t0 = time.perf_counter()
        self._resumed_mid_epoch = False

    @rank_zero_only
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None:
            loss = loss.detach()
            self._epoch_loss = loss if self._epoch_loss is None else self._epoch_loss + loss
        self._epoch_batches += 1
        images = batch_size(batch) * trainer.world_size
        self._epoch_images += images
        self._images_since += images
        now = time.perf_counter()
        if not self._lines or now - self._last_t < self.interval_s:
            return
        step, total = trainer.global_step, trainer.estimated_stepping_batches
        rate = self._images_since / max(now - self._last_t, 1e-9)
        per_step = (now - self._t0) / max(step - self._step0, 1)
        eta = (total - step) * per_step if total and total != float("inf") else None
        timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
        left = timer.time_remaining("train") if timer is not None else None
        if left is not None:
            eta = left if eta is None else min(eta, left)
        max_epochs = trainer.max_epochs if trainer.max_epochs not in (None, -1) else "?"
        parts = [
            f"epoch {trainer.current_epoch + 1}/{max_epochs} batch {batch_idx + 1}/{trainer.num_training_batches}"
            f" step {step}/{int(total) if total != float('inf') else '?'}"
        ]
        if loss is not None:
            parts.append(f"loss {float(loss):.4f}")
        parts += [f"{rate:.1f} images/s", f"ETA {_duration(eta) if eta is not None else '?'}"]
        log.info(" | ".join(parts))
        self._last_t, self._images_since = now, 0

    @rank_zero_only
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._epoch_batches:
            return
        seconds = time.perf_counter() - self._epoch_t0
        since = " (time, train loss and images/s since the resume)" if self._resumed_mid_epoch else ""
        parts = [
            f"epoch {trainer.current_epoch + 1} done in {_duration(seconds)}{since}",
            f"step {trainer.global_step}",
        ]
        if self._epoch_loss is not None:
            parts.append(f"train loss {float(self._epoch_loss) / self._epoch_batches:.4f}")
        metrics = trainer.callback_metrics
        for key in ("val/loss", "val/acc1"):
            if key in metrics:
                parts.append(f"{key} {float(metrics[key]):.4f}")
        parts.append(f"{self._epoch_images / max(seconds, 1e-9):.1f} images/s")
        log.info(" | ".join(parts))

    # --- evaluation passes: the test after fit or of eval.py, predict.py, eval.py split=val --------------------

    def _pass_start(self) -> None:
        self._lines = self.always or not sys.stdout.isatty()
        self._pass_t0 = self._pass_last = time.perf_counter()
        self._pass_images = self._pass_since = 0

    def _pass_batch(self, trainer: L.Trainer, stage: str, batch: Any, batch_idx: int, total: Any) -> None:
        images = batch_size(batch)
        self._pass_images += images
        self._pass_since += images * trainer.world_size
        now = time.perf_counter()
        if not trainer.is_global_zero or not self._lines or now - self._pass_last < self.interval_s:
            return
        total = sum(total) if isinstance(total, list | tuple) else total  # batches per dataloader
        known = isinstance(total, int | float) and 0 < total < float("inf")
        total = int(total) if known else total
        rate = self._pass_since / max(now - self._pass_last, 1e-9)
        eta = (total - batch_idx - 1) * (now - self._pass_t0) / (batch_idx + 1) if known else None
        log.info(
            f"{stage} batch {batch_idx + 1}/{total if known else '?'} | {rate:.1f} images/s | "
            f"ETA {_duration(eta) if eta is not None else '?'}"
        )
        self._pass_last, self._pass_since = now, 0

    def _pass_end(self, trainer: L.Trainer, stage: str) -> None:
        """The pass's line, on rank zero: the images of all processes (one sum over the ranks, as every rank
        ends the pass here; they may have had different numbers of batches)."""
        seconds = time.perf_counter() - self._pass_t0
        images = self._pass_images
        if trainer.world_size > 1:
            here = torch.tensor(images, device=trainer.strategy.root_device)
            images = int(trainer.strategy.reduce(here, reduce_op="sum"))
        if trainer.is_global_zero and images:
            log.info(
                f"{stage} done in {_duration(seconds)} | {images} images | {images / max(seconds, 1e-9):.1f} images/s"
            )

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pass_start()

    def on_test_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None:  # fmt: skip
        self._pass_batch(trainer, "test", batch, batch_idx, trainer.num_test_batches)

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pass_end(trainer, "test")

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pass_start()

    def on_predict_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                             batch_idx: int, dataloader_idx: int = 0) -> None:  # fmt: skip
        self._pass_batch(trainer, "predict", batch, batch_idx, trainer.num_predict_batches)

    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pass_end(trainer, "predict")

    # validation inside fit is in the epoch's line; on its own (eval.py split=val) it is a pass of its own
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.VALIDATING:
            self._pass_start()

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                                batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:  # fmt: skip
        if trainer.state.fn == TrainerFn.VALIDATING:
            self._pass_batch(trainer, "validation", batch, batch_idx, trainer.num_val_batches)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.VALIDATING:
            self._pass_end(trainer, "validation")


class ProgressBar(EpochsFromOneBar):
    """Rich's bar with epochs numbered from 1 (`EpochsFromOneBar`), without `v_num` (the logger's version:
    `_0` and meaningless in a run directory of its own)."""

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items


class ModelSummary(RichModelSummary):
    """Rich's model summary without its FLOPs column and `Total FLOPs: 0` when FLOPs were not measured
    (Lightning measures them only with an `example_input_array`; images/s and MFU: callbacks/throughput.py)."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning warns on every `*-mixed` run that it sizes the parameters at 32 bits, as if that were
        # wrong: mixed precision keeps fp32 parameters, so the size it prints is right
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=r"Precision \S+-mixed is not supported by the model summary"
            )
            super().on_fit_start(trainer, pl_module)

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        if total_flops:
            RichModelSummary.summarize(
                summary_data,
                total_parameters,
                trainable_parameters,
                model_size,
                total_training_modes,
                total_flops,
                **summarize_kwargs,
            )
            return
        from lightning.pytorch.utilities.model_summary import (
            get_formatted_model_size,
            get_human_readable_count,
        )
        from rich import get_console
        from rich.table import Table

        console = get_console()
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        kept = [(name, values) for name, values in summary_data if name != "FLOPs"]
        table.add_column(" ", style="dim")
        for name, _ in kept[1:]:
            table.add_column(name, justify="right" if "Params" in name or "sizes" in name else "left")
        for row in zip(*(values for _, values in kept), strict=True):
            table.add_row(*row)
        console.print(table)
        grid = Table.grid(expand=True)
        grid.add_column()
        grid.add_row(f"[bold]Trainable params[/]: {get_human_readable_count(int(trainable_parameters))}")
        grid.add_row(
            f"[bold]Non-trainable params[/]: {get_human_readable_count(int(total_parameters - trainable_parameters))}"
        )
        grid.add_row(f"[bold]Total params[/]: {get_human_readable_count(int(total_parameters))}")
        grid.add_row(
            f"[bold]Total estimated model params size (MB)[/]: {get_formatted_model_size(model_size)}"
        )
        grid.add_row(f"[bold]Modules in train mode[/]: {total_training_modes['train']}")
        grid.add_row(f"[bold]Modules in eval mode[/]: {total_training_modes['eval']}")
        console.print(grid)
