"""Images/s and model FLOPs utilisation (MFU) in the logs, with Lightning's ThroughputMonitor.

Logged (TensorBoard: `train/device/samples_per_sec`, `train/device/mfu`, ...; `train/samples_per_sec` for all
processes together when there are several) once `window_size` batches have run. MFU = achieved FLOPs / the
device's dense peak for the dtype the matmuls run in. The peaks come from `PEAKS` below (one table, dense
figures, used by this callback and bench/gpu.py alike); names it does not list fall back to Lightning's
table; `peak_flops` in the config overrides both; if still unknown, images/s are logged and MFU is not.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.throughput import get_available_flops, measure_flops
from lightning.pytorch.utilities import rank_zero_only

from vitrain.compat import UnsyncedThroughputMonitor, plugin_compute_dtype

log = logging.getLogger(__name__)

T = 1e12
# Dense peak FLOP/s per GPU (no 2:4 sparsity) by compute dtype; "tf32" = fp32 matmuls on tensor cores.
# Sources, NVIDIA datasheets: H100 (SXM5, PCIe, NVL) "NVIDIA H100 Tensor Core GPU" datasheet (the with-
# sparsity figures halved: SXM bf16 1979 -> 989); H200 "NVIDIA H200 Tensor Core GPU" datasheet (SXM as H100
# SXM, NVL as H100 NVL); GH200 "NVIDIA GH200 Grace Hopper Superchip" datasheet (GPU as H100 SXM); A100 "NVIDIA
# A100 Tensor Core GPU" datasheet (312 bf16/fp16, 156 tf32, 19.5 fp32); L4, L40, L40S, A10 their datasheets;
# V100 and T4 have no bf16. Lightning's table lists H200 with sparsity (MFU would halve) and no GH200.
_HOPPER_SXM = {torch.bfloat16: 989 * T, torch.float16: 989 * T, "tf32": 494.7 * T, torch.float32: 67 * T}
_HOPPER_NVL = {torch.bfloat16: 835 * T, torch.float16: 835 * T, "tf32": 417.5 * T, torch.float32: 60 * T}
PEAKS: list[tuple[str, dict[Any, float]]] = [  # first match of the lower-cased device name wins
    (r"gh200", _HOPPER_SXM),
    (r"h200.*nvl", _HOPPER_NVL),
    (r"h200", _HOPPER_SXM),
    (r"h100.*nvl", _HOPPER_NVL),
    (
        r"h100.*(pcie|hbm2e)",
        {torch.bfloat16: 756 * T, torch.float16: 756 * T, "tf32": 378 * T, torch.float32: 51 * T},
    ),
    (r"h100", _HOPPER_SXM),
    (r"a100", {torch.bfloat16: 312 * T, torch.float16: 312 * T, "tf32": 156 * T, torch.float32: 19.5 * T}),
    (r"l40s", {torch.bfloat16: 362 * T, torch.float16: 362 * T, "tf32": 183 * T, torch.float32: 91.6 * T}),
    (r"l40\b", {torch.bfloat16: 181 * T, torch.float16: 181 * T, "tf32": 90.5 * T, torch.float32: 90.5 * T}),
    (r"\bl4\b", {torch.bfloat16: 121 * T, torch.float16: 121 * T, "tf32": 60 * T, torch.float32: 30.3 * T}),
    (
        r"a10g?\b",
        {torch.bfloat16: 125 * T, torch.float16: 125 * T, "tf32": 62.5 * T, torch.float32: 31.2 * T},
    ),
    (r"v100.*pcie", {torch.float16: 112 * T, torch.float32: 14 * T}),
    (r"v100", {torch.float16: 125 * T, torch.float32: 15.7 * T}),
    (r"\bt4\b", {torch.float16: 65 * T, torch.float32: 8.1 * T}),
]


def peak_flops(device_name: str, dtype: torch.dtype, tf32: bool | None = None) -> float | None:
    """Dense peak FLOP/s of the GPU called `device_name` for matmuls in `dtype`; fp32 counts as TF32 when
    `tf32` (default: torch's float32 matmul precision is not "highest"). None when unknown."""
    if tf32 is None:
        tf32 = torch.get_float32_matmul_precision() != "highest"
    key: Any = "tf32" if dtype is torch.float32 and tf32 else dtype
    name = device_name.lower()
    for pattern, peaks in PEAKS:
        if re.search(pattern, name):
            return peaks.get(key)
    if not torch.cuda.is_available():
        return None
    # a GPU our table does not list (GeForce, older parts): Lightning's table, looked up by this device's name
    for index in range(torch.cuda.device_count()):
        if torch.cuda.get_device_name(index) == device_name:
            found = get_available_flops(torch.device("cuda", index), "tfloat32" if key == "tf32" else dtype)
            return float(found) if found else None
    return None


def compute_dtype(precision_plugin: Any, strategy: Any = None) -> torch.dtype:
    """The dtype the matmuls run in: FSDP2's mixed-precision policy when it has one (the precision plugin
    then says fp32 although blocks compute in bf16: MFU would be 15x too high), else the plugin's."""
    from vitrain.distributed.fsdp import compute_dtype as fsdp_dtype

    options = getattr(strategy, "fsdp_options", None)
    if options is not None and fsdp_dtype(options.get("mixed_precision")) is not None:
        return fsdp_dtype(options["mixed_precision"])
    return plugin_compute_dtype(precision_plugin)


def batch_size(batch: Any) -> int:
    """Images in this process's batch: the first tensor's leading dimension."""
    while isinstance(batch, list | tuple | Mapping):
        batch = next(iter(batch.values())) if isinstance(batch, Mapping) else batch[0]
    return int(batch.shape[0])


def flops_per_image(
    pl_module: L.LightningModule, training: bool, shape: tuple[int, int] | None = None
) -> float | None:
    """FLOPs of one image (of `shape`, default the model's input size) through the network (forward, and
    backward when `training`), measured on a copy built on the meta device: nothing is allocated and the
    real model is not touched."""
    meta_net = getattr(pl_module, "meta_net", None)  # vitrain.models.classifier.ImageClassifier.meta_net
    spec = getattr(pl_module, "input_spec", None)
    if meta_net is None or spec is None:
        return None
    height, width = shape or (spec["img_size"], spec["img_size"])
    try:
        with torch.device("meta"):
            net = meta_net()
            x = torch.empty(1, 3, height, width)
        loss_fn = (lambda y: y.sum()) if training else None
        return float(measure_flops(net, lambda: net(x), loss_fn))
    except Exception as err:  # an exotic model: throughput is still logged, MFU is not
        log.info("FLOPs per image could not be measured (%s): no MFU", err)
        return None


class ImageThroughputMonitor(UnsyncedThroughputMonitor):
    """ThroughputMonitor for image classifiers: batch size from the batch, FLOPs from the model.

    `flops_per_batch` (what Lightning's monitor reads from the module) is set per stage: forward + backward
    for training batches, forward only for validation and test batches.
    """

    def __init__(self, window_size: int = 50, peak_flops: float | None = None, **kwargs: Any) -> None:
        super().__init__(batch_size_fn=batch_size, window_size=window_size, **kwargs)
        self.peak_flops = peak_flops
        self.device_name: str | None = None
        self.compute_dtype: torch.dtype | None = None
        self.train_flops: float | None = None
        self.eval_flops: float | None = None
        # training FLOPs per image at the smaller sizes progressive resizing trains at, by (height, width)
        self.resized_train_flops: dict[tuple[int, int], float | None] = {}
        #: the training window used: `window_size`, or half an epoch when an epoch is shorter than two windows
        self.train_window: int = int(window_size)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        with warnings.catch_warnings():  # "FLOPs not found for ...": our table decides below
            warnings.filterwarnings("ignore", message=".*FLOPs not found.*")
            super().setup(trainer, pl_module, stage)
        device = trainer.strategy.root_device
        self.device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        self.compute_dtype = compute_dtype(trainer.precision_plugin, trainer.strategy)
        peak = self.peak_flops or (
            peak_flops(self.device_name, self.compute_dtype) if device.type == "cuda" else None
        )
        self.set_available_flops(int(peak) if peak else None)
        if self.available_flops is None and self.train_flops is None and trainer.is_global_zero:
            log.info(
                "No peak FLOPs known for %s: images/s are logged, MFU is not "
                "(set callbacks.throughput.peak_flops to add it)",
                self.device_name,
            )
        if self.train_flops is None:
            self.train_flops = flops_per_image(pl_module, training=True)
            self.eval_flops = flops_per_image(pl_module, training=False)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        # figures are computed at log steps and at each epoch's last batch over the last `window` batches: a
        # window of half an epoch at most fills in a short run, and leaves its first steps (compile,
        # warm-up) out of the figure
        batches = trainer.num_training_batches
        configured = int(self.kwargs.get("window_size", self.train_window))
        self.train_window = (
            configured if batches == float("inf") else max(2, min(configured, int(batches) // 2))
        )
        self.fit_train_window(trainer, self.train_window)

    def _set_flops(self, pl_module: L.LightningModule, per_image: float | None, batch: Any) -> None:
        pl_module.flops_per_batch = per_image * batch_size(batch) if per_image else None

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, *_: Any
    ) -> None:
        self._set_flops(pl_module, self.train_flops, batch)

    @rank_zero_only  # as Lightning's: only rank 0 measures throughput
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, *args: Any
    ) -> None:
        # a step that progressive resizing (vitrain/models/resolution.py) ran at a smaller size: its FLOPs,
        # not the full size's, before Lightning's monitor reads them (images/s and MFU of this step)
        shape = getattr(pl_module, "train_input_shape", None)
        if shape is not None and self.train_flops is not None:
            if shape not in self.resized_train_flops:
                self.resized_train_flops[shape] = flops_per_image(pl_module, training=True, shape=shape)
            self._set_flops(pl_module, self.resized_train_flops[shape], batch)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, *args)

    def on_validation_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, *_: Any, **__: Any
    ) -> None:
        self._set_flops(pl_module, self.eval_flops, batch)

    def on_test_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, *_: Any, **__: Any
    ) -> None:
        self._set_flops(pl_module, self.eval_flops, batch)
