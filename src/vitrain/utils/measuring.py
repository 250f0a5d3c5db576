"""Measuring a process: its peak memory (Linux /proc probes, CUDA counters), its GPU's utilisation (a
sampler thread), logged metrics as plain floats, and the device ops code issues. Used by the run-stats
callback, the batch-size search, the benchmarks' probe and the augmentation's tests."""

from __future__ import annotations

import os
import resource
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from vitrain.compat import TorchDispatchMode

GB = 1024**3


# --- memory ---------------------------------------------------------------------------------------------


def proc_status(field: str) -> int | None:
    """A /proc/self/status field in bytes (VmRSS, VmHWM); None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """The process's peak resident memory since the last `reset_peak_rss` (Linux VmHWM), else since start."""
    peak = proc_status("VmHWM")
    if peak is not None:
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def reset_peak_rss() -> bool:
    """Start a new peak-RSS window (Linux >= 4.0): the previous job of a sweep or a batch-size search must
    not count. False where the kernel does not allow it: the peak then covers the process's lifetime."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def reset_peak_memory(device: torch.device) -> bool:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return reset_peak_rss()


def device_memory(device: torch.device) -> dict[str, float]:
    """Peak memory of this process in GB: host RSS, and on a GPU what PyTorch allocated and reserved."""
    memory = {"peak_rss_gb": peak_rss_bytes() / GB}
    if device.type == "cuda":
        memory["max_allocated_gb"] = torch.cuda.max_memory_allocated(device) / GB
        memory["max_reserved_gb"] = torch.cuda.max_memory_reserved(device) / GB
    return memory


# --- GPU utilisation ------------------------------------------------------------------------------------


class UtilisationSampler:
    """Samples this process's GPU utilisation in a thread: NVML through `torch.cuda.utilization` (needs
    nvidia-ml-py), else `nvidia-smi`."""

    def __init__(self, device: torch.device, interval: float) -> None:
        self.device, self.interval = device, interval
        self.samples: list[tuple[float, float]] = []
        self.unavailable: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._read: Callable[[], float] | None = None
        if device.type != "cuda":
            self.unavailable = f"no GPU ({device.type})"
            return
        problems = []
        for read in (self._nvml, self._nvidia_smi):
            try:
                read()
                self._read = read
                return
            except Exception as err:
                problems.append(str(err))
        self.unavailable = "neither NVML nor nvidia-smi answered: " + "; ".join(problems)

    def _nvml(self) -> float:
        return float(torch.cuda.utilization(self.device))

    def _nvidia_smi(self) -> float:
        # nvidia-smi numbers GPUs physically; CUDA_VISIBLE_DEVICES may renumber them for this process
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
        index = self.device.index or 0
        physical = visible[index].strip() if index < len(visible) and visible[index].strip() else str(index)
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-i", physical],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        return float(out.stdout.strip().splitlines()[0])

    def start(self) -> None:
        if self.unavailable is None and self._thread is None:
            self._t0 = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="gpu-utilisation", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 5)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.samples.append((round(time.monotonic() - self._t0, 1), self._read()))
            except Exception as err:
                self.unavailable = f"GPU utilisation could not be read: {err}"
                return

    def summary(self) -> list[float]:
        values = [u for _, u in self.samples]
        return [
            sum(values) / len(values) if values else float("nan"),
            max(values, default=float("nan")),
            len(values),
        ]


# --- metrics --------------------------------------------------------------------------------------------


def metric_floats(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Lightning's `callback_metrics` (tensors) as floats, those under `prefix`; a value that is not a
    number is left out."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key.startswith(prefix):
            try:
                out[key] = float(value)
            except (TypeError, ValueError, RuntimeError):
                continue
    return out


# --- device ops ---------------------------------------------------------------------------------------------


class DeviceOps(TorchDispatchMode):
    """Counts, by name, the ops that compute on the "meta" device while active: run with its tensors on
    "meta", code shows the kernels it would launch on a GPU, each a few microseconds of the launching
    thread, without one. Views and allocations launch none and are left out; ops on CPU tensors (the host's
    share of the work) are not counted. A torch dispatch mode: no profiler tells meta ops apart."""

    # allocations, and in-place views (a view's metadata set on the tensor itself): no kernel
    FREE = frozenset(
        {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::_unsafe_view"}
        | {f"aten::{view}_" for view in ("unsqueeze", "squeeze", "transpose", "t", "as_strided", "detach")}
    )

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, tuple | list) else [out]
        on_device = any(isinstance(o, torch.Tensor) and o.device.type == "meta" for o in outs)
        name = func._schema.name
        if on_device and not func.is_view and name not in self.FREE:
            self.ops[name] = self.ops.get(name, 0) + 1
        return out

    @property
    def total(self) -> int:
        return sum(self.ops.values())
