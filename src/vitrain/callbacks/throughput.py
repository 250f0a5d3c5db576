"""Images/s and model FLOPs utilisation (MFU) in the logs, with Lightning's ThroughputMonitor.

Logged (TensorBoard: `train/device/samples_per_sec`, `train/device/mfu`, ...; `train/samples_per_sec` for all
processes together when there are several) once `window_size` batches have run. MFU needs the device's peak
FLOPs: Lightning's table covers the common NVIDIA GPUs but not every name a driver reports (a plain
`NVIDIA H200`), nor CPUs. Unknown peaks are looked up in `PEAK_ALIASES`, or taken from `peak_flops`; if
still unknown, images/s are logged and MFU is not.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.throughput import _CUDA_FLOPS, measure_flops
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype
from lightning.pytorch.trainer.states import RunningStage

log = logging.getLogger(__name__)

# device names Lightning does not map to its table: lower-cased substring -> Lightning's chip key
PEAK_ALIASES: dict[str, str] = {
    "h200 nvl": "h200 nvl1",
    "h200": "h200 sxm1",  # "NVIDIA H200" is the SXM part (141 GB)
}


def batch_size(batch: Any) -> int:
    """Images in this process's batch: the first tensor's leading dimension."""
    while isinstance(batch, list | tuple | Mapping):
        batch = next(iter(batch.values())) if isinstance(batch, Mapping) else batch[0]
    return int(batch.shape[0])


def alias_peak_flops(device_name: str, dtype: torch.dtype) -> float | None:
    """Peak FLOPs for a device name Lightning does not recognise, from `PEAK_ALIASES`."""
    name = device_name.lower()
    for alias, chip in PEAK_ALIASES.items():
        if alias in name and chip in _CUDA_FLOPS:
            peaks = _CUDA_FLOPS[chip]
            if dtype is torch.float32 and torch.get_float32_matmul_precision() != "highest":
                return peaks.get("tfloat32")
            return peaks.get(dtype)
    return None


def flops_per_image(pl_module: L.LightningModule, training: bool) -> float | None:
    """FLOPs of one image through the network (forward, and backward when `training`), measured on a
    copy built on the meta device: nothing is allocated and the real model is not touched."""
    net_cfg = getattr(pl_module, "hparams", {}).get("net")
    spec = getattr(pl_module, "input_spec", None)
    if net_cfg is None or spec is None:
        return None
    import timm

    try:
        with torch.device("meta"):
            net = timm.create_model(**{**dict(net_cfg), "pretrained": False})
            x = torch.empty(1, 3, spec["img_size"], spec["img_size"])
        loss_fn = (lambda y: y.sum()) if training else None
        return float(measure_flops(net, lambda: net(x), loss_fn))
    except Exception as err:  # an exotic model: throughput is still logged, MFU is not
        log.info("FLOPs per image could not be measured (%s): no MFU", err)
        return None


class ImageThroughputMonitor(ThroughputMonitor):
    """ThroughputMonitor for image classifiers: batch size from the batch, FLOPs from the model.

    `flops_per_batch` (what Lightning's monitor reads from the module) is set per stage: forward + backward
    for training batches, forward only for validation and test batches.
    """

    def __init__(self, window_size: int = 50, peak_flops: float | None = None, **kwargs: Any) -> None:
        super().__init__(batch_size_fn=batch_size, window_size=window_size, **kwargs)
        self.peak_flops = peak_flops
        self.device_name: str | None = None
        self.train_flops: float | None = None
        self.eval_flops: float | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        with warnings.catch_warnings():  # "FLOPs not found for ...": handled below
            warnings.filterwarnings("ignore", message=".*FLOPs not found.*")
            super().setup(trainer, pl_module, stage)
        device = trainer.strategy.root_device
        self.device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        if self.available_flops is None:
            dtype = _plugin_to_compute_dtype(trainer.precision_plugin)
            peak = self.peak_flops or (
                alias_peak_flops(self.device_name, dtype) if device.type == "cuda" else None
            )
            self.available_flops = int(peak) if peak else None
            for throughput in self._throughputs.values():
                throughput.available_flops = self.available_flops
        if self.available_flops is None and self.train_flops is None and trainer.is_global_zero:
            log.info(
                "No peak FLOPs known for %s: images/s are logged, MFU is not "
                "(set callbacks.throughput.peak_flops to add it)",
                self.device_name,
            )
        if self.train_flops is None:
            self.train_flops = flops_per_image(pl_module, training=True)
            self.eval_flops = flops_per_image(pl_module, training=False)

    def _set_flops(self, pl_module: L.LightningModule, per_image: float | None, batch: Any) -> None:
        pl_module.flops_per_batch = per_image * batch_size(batch) if per_image else None

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, *_: Any
    ) -> None:
        self._set_flops(pl_module, self.train_flops, batch)

    def on_validation_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, *_: Any, **__: Any
    ) -> None:
        self._set_flops(pl_module, self.eval_flops, batch)

    def on_test_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, *_: Any, **__: Any
    ) -> None:
        self._set_flops(pl_module, self.eval_flops, batch)

    @torch.inference_mode()
    def _update(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, iter_num: int) -> None:
        """Lightning's `_update` without its `torch.cuda.synchronize()` on every batch.

        A synchronize per step stalls the host until the GPU is idle, so the next step's kernels are queued
        late: the monitor itself slows the training it measures. The logged figures are rates over a window
        of `window_size` batches ending at a logged step, so the clock needs to be exact there only: we
        synchronise on those steps (every `log_every_n_steps`) and outside training, as Lightning does.
        """
        stage = trainer.state.stage
        exact = stage != RunningStage.TRAINING or trainer._logger_connector.should_update_logs
        if trainer.strategy.root_device.type == "cuda" and exact:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - self._t0s[stage]
        if self.length_fn is not None:
            self._lengths[stage] += self.length_fn(batch)
        self._samples[stage] += self.batch_size_fn(batch)
        self._batches[stage] += 1
        self._throughputs[stage].update(
            time=elapsed,
            batches=self._batches[stage],
            samples=self._samples[stage],
            lengths=None if self.length_fn is None else self._lengths[stage],
            flops=getattr(pl_module, "flops_per_batch", None),
        )
