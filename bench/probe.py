"""A passive Lightning callback the benchmarks add to a run: timestamps, step times, peak memory, metrics.

`python src/train.py ... +callbacks.bench_probe._target_=probe.BenchProbe +callbacks.bench_probe.out=f.json`
with `bench/` on PYTHONPATH. It changes nothing in the run: it only reads clocks and counters. Every rank
writes `out` with `__RANK__` replaced by its global rank (rank 0 writes `out` itself when there is no
`__RANK__`). Steps are timed on the host; on CUDA the clock is read after a synchronize only at the two ends
of the measured window, so the step loop itself is not serialised.
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import sys
import threading
import time
from collections import Counter
from typing import Any

import lightning as L
import torch
from common import synced_clock
from lightning.pytorch.callbacks import Callback

from vitrain.utils.atomic import write_atomic
from vitrain.utils.measuring import proc_status, reset_peak_rss

GB = 1024**3


class BenchProbe(Callback):
    """Records, for the benchmark that added it:

    - `first_step_unix`: wall-clock time (time.time) when the first optimizer step has finished;
    - `step_starts`, `step_ends`: perf_counter at the start and end of every training batch (up to `max_steps`);
    - `step_cpu`: the main thread's CPU time (thread_time) at the same moments: wall time beyond it is time
      the step waited (for other ranks, communication, the OS) or the backward's own thread worked;
    - `step_backward_cpu`, `backward_threads`: the same for torch's autograd device threads (`backward_threads`
      of them, found by the end of the warm-up): on a GPU the backward runs there while the main thread waits
      for it (`BACKWARD_THREAD_PREFIX`); on a CPU there is none, the backward runs on the main thread;
    - `step_ahead_cpu`, `ahead_threads`: the same for the threads that prepare batches ahead of the main thread
      (`AHEAD_THREAD_NAMES`: vitrain/data/decode_ahead.py), found by the end of the warm-up;
    - `fit_seconds`, `epochs`, `global_step`, `stopped_early`: how the fit went (max_time, max_epochs);
    - `rss_setup`, `param_bytes`, `peak_rss_train`: this process's memory at setup and its peak during
      training (VmHWM reset at train start); on CUDA `peak_cuda_allocated` instead;
    - `metrics`: the logged metrics after fit and after test (test/acc1 ...);
    - `window_end`: the index in `step_ends` of the last timed batch (the epoch's last, or the last before
      the profiled ones), and with `profile_steps` `kernels` (gpu_time_shares of the profiled batches);
    - with `stack_steps` and `stack_hz`, `stacks`: where the training thread's wall time goes over the
      `stack_steps` batches after the timed window, and what Python other threads run meanwhile
      (`StackSampler.summary`).
    """

    def __init__(
        self,
        out: str,
        max_steps: int = 100_000,
        warmup: int = 0,
        sample_gpu: bool = False,
        profile_steps: int = 0,
        stack_steps: int = 0,
        stack_hz: float | None = None,
    ) -> None:
        self.out = out
        # the `stack_steps` batches after the timed window (before the profiled ones) with the training
        # thread's Python stack sampled `stack_hz` times a second. Not in the timed window: the sampler
        # thread takes the GIL the training thread needs between its ops, and on a host-bound step (a 12-block
        # tiny ViT, on a 2-core Xeon) it made each step ~10 % longer (docs/benchmarks.md section 2,
        # `host_bound_step_ms_sampled`)
        self.stack_steps, self.stack_hz = int(stack_steps), float(stack_hz or STACK_HZ)
        self.stacks: StackSampler | None = None
        # the epoch's last `profile_steps` batches run under torch.profiler (host and GPU), after the timed
        # window has ended (a profiler slows the launches that follow it, so it never runs before the window),
        # recorded as `kernels` (gpu_time_shares; on a CPU only the host side)
        self.profile_steps = int(profile_steps)
        self._profiler: Any = None
        self._profile_t0 = 0.0
        # NVML utilisation samples of the GPU between the warm-up's end and the end of training
        self.sampler: GpuUtilSampler | None = None
        self.sample_gpu = sample_gpu
        self.max_steps = int(max_steps)
        self.warmup = int(warmup)  # on CUDA: synchronise after this batch and after the epoch's last one
        self.record: dict[str, Any] = {
            "step_starts": [],
            "step_ends": [],
            "step_cpu": [],
            "step_backward_cpu": [],
            "step_ahead_cpu": [],
            "metrics": {},
        }
        self._t_train_start: float | None = None
        self._backward_tids: list[int] = []
        self._ahead_tids: list[int] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.record.update(
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            threads=torch.get_num_threads(),
            rss_setup=proc_status("VmRSS"),
            param_bytes=sum(p.numel() * p.element_size() for p in pl_module.parameters()),
        )

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self.record["rss_train_start"] = proc_status("VmRSS")
        self.record["peak_reset"] = reset_peak_rss()
        self._t_train_start = synced_clock(device)
        self.record["train_start_unix"] = time.time()

    def _window_end(self, trainer: L.Trainer) -> int:
        """Index of the batch that ends the timed window: the epoch's last, or the last before the sampled
        and profiled ones."""
        return trainer.num_training_batches - 1 - self.profile_steps - self.stack_steps

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.profile_steps > 0 and batch_idx == self._window_end(trainer) + self.stack_steps + 1:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            if trainer.strategy.root_device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self._profiler = profile(activities=activities)
            self._profiler.start()
            self._profile_t0 = time.perf_counter()
        # the host's wait for the batch is the time from the previous batch's end to here
        if len(self.record["step_starts"]) < self.max_steps:
            self.record["step_starts"].append(time.perf_counter())

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        steps = self.record["step_ends"]
        device = trainer.strategy.root_device
        window_end = batch_idx == self._window_end(trainer)
        if device.type == "cuda" and (len(steps) == self.warmup or window_end):
            torch.cuda.synchronize(device)
            if self.sample_gpu and self.sampler is None and len(steps) == self.warmup:
                self.sampler = GpuUtilSampler(device)
                self.sampler.start()
            elif self.sampler is not None and window_end:
                self.sampler.stop.set()  # the timed window ends here: no validation or saving in it
        if self.stack_steps > 0 and self.stack_hz > 0 and window_end and self.stacks is None:
            self.stacks = StackSampler(threading.get_ident(), self.stack_hz)
            self.stacks.start()
        elif self.stacks is not None and batch_idx == self._window_end(trainer) + self.stack_steps:
            self.record["stacks"] = {"steps": self.stack_steps, **self.stacks.finish()}
        if self._profiler is not None and batch_idx == trainer.num_training_batches - 1:
            self._stop_profile(device)
        if not steps:
            self.record["first_step_unix"] = time.time()
        if len(steps) < self.max_steps:
            steps.append(time.perf_counter())
            self.record["step_cpu"].append(time.thread_time())
            if len(steps) <= self.warmup + 1:  # the set stays fixed over the timed window
                self._backward_tids, self._ahead_tids = backward_threads(), ahead_threads()
                self.record["backward_threads"] = len(self._backward_tids)
                self.record["ahead_threads"] = len(self._ahead_tids)
            self.record["step_backward_cpu"].append(threads_cpu_seconds(self._backward_tids))
            self.record["step_ahead_cpu"].append(threads_cpu_seconds(self._ahead_tids))
            if window_end:
                self.record["window_end"] = len(steps) - 1  # index in step_ends
        if len(steps) in (1, 2) or len(steps) % 8 == 0:  # peak RSS so far (cheap; on every 8th batch)
            self.record["peak_rss_train"] = proc_status("VmHWM")

    def _stop_profile(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall_us = (time.perf_counter() - self._profile_t0) * 1e6
        profiler, self._profiler = self._profiler, None
        try:
            profiler.stop()
            self.record["kernels"] = gpu_time_shares(profiler, self.profile_steps, wall_us)
        except Exception as err:  # the timed figures stand without the profile
            self.record["kernels"] = {"error": f"{type(err).__name__}: {err}"[:300]}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        device = trainer.strategy.root_device
        end = synced_clock(device)
        self.record.update(
            fit_seconds=end - (self._t_train_start or end),
            epochs=trainer.current_epoch,
            global_step=trainer.global_step,
            max_epochs=trainer.max_epochs,
            planned_steps=int(trainer.estimated_stepping_batches),
            # max_time (or a signal) ended the fit before the steps its LR schedule was sized for
            stopped_early=bool(trainer.global_step < trainer.estimated_stepping_batches),
            precision=str(trainer.precision),
            # where the LR schedule ended: 1.0 = its peak, the experiment's min_lr_ratio = fully decayed
            lr_end_ratio=_lr_ratio(trainer),
            peak_rss_train=proc_status("VmHWM"),
        )
        if self.sampler is not None:
            self.sampler.stop.set()
            self.record["gpu_util_samples"] = self.sampler.samples
        if self.stacks is not None and "stacks" not in self.record:  # the epoch ended early
            self.record["stacks"] = {"steps": self.stack_steps, **self.stacks.finish()}
        if device.type == "cuda":
            self.record["peak_cuda_allocated"] = torch.cuda.max_memory_allocated(device)
            self.record["peak_cuda_reserved"] = torch.cuda.max_memory_reserved(device)
        self.record["metrics"]["fit"] = _floats(trainer.callback_metrics)
        self._write()

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.record["metrics"]["test"] = _floats(trainer.callback_metrics)
        self._write()

    def _write(self) -> None:
        rank = self.record.get("rank", 0)
        if "__RANK__" not in self.out and rank != 0:
            return
        write_atomic(self.out.replace("__RANK__", str(rank)), json.dumps(self.record, indent=1))


#: torch's autograd engine runs the backward of GPU tensors on a worker thread of its own per device, named
#: `pt_autograd_<device>` (torch/csrc/autograd/engine.cpp, `Engine::thread_init`), while the thread that called
#: `backward()` waits for it: the host's work of a GPU step is that thread's CPU time plus the main thread's.
#: On a CPU the calling thread runs the backward itself.
BACKWARD_THREAD_PREFIX = "pt_autograd_"


def backward_threads() -> list[int]:
    """The Linux thread ids of this process's autograd device threads (none on a CPU-only run, or off Linux)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    found = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith(BACKWARD_THREAD_PREFIX):
                    found.append(int(tid))
        except OSError:  # the thread ended meanwhile
            continue
    return sorted(found)


#: the Python threads that prepare training batches ahead of the training thread (vitrain/data/decode_ahead.py:
#: GPU decode, in-memory augmentation); their names are Python's, not the OS's, so they are found through
#: `threading` and read by their native ids
AHEAD_THREAD_NAMES = ("augment-ahead", "gpu-decode-ahead")


def ahead_threads() -> list[int]:
    """The Linux thread ids of this process's threads that prepare batches ahead (`AHEAD_THREAD_NAMES`)."""
    return sorted(t.native_id for t in threading.enumerate() if t.name in AHEAD_THREAD_NAMES and t.native_id)


def threads_cpu_seconds(tids: list[int]) -> float:
    """The CPU time threads `tids` of this process have used so far: the scheduler's run time of each
    (`/proc/self/task/<tid>/schedstat`, ns), the clock `time.thread_time` reads for its own thread; a thread
    whose file cannot be read counts 0."""
    total = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


def threads_cpu_by_name() -> dict[str, float]:
    """CPU seconds used so far by this process's threads, by Python thread name; the threads Python did not
    start (torch's autograd and intra-op threads, NCCL's) summed under one name."""
    named = {t.native_id: t.name for t in threading.enumerate() if t.native_id}
    try:
        tids = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return {}
    out: dict[str, float] = {}
    for tid in tids:
        name = named.get(tid, "threads torch started (autograd, intra-op)")
        out[name] = out.get(name, 0.0) + threads_cpu_seconds([tid])
    return out


def _lr_ratio(trainer: L.Trainer) -> float | None:
    group = trainer.optimizers[0].param_groups[0] if trainer.optimizers else None
    if not group or not group.get("initial_lr"):
        return None
    return float(group["lr"]) / float(group["initial_lr"])


def _floats(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            continue
    return out


# first match wins: cuDNN's attention kernels have "wgmma" in their names too; Inductor's matmul templates
# are "triton_tem_..."; its fused kernels name the ops they fuse ("triton_per_fused__to_copy_add_..."), so
# "triton" comes before "copy" (until 2026-11-27 evening it came after: fused kernels with a dtype cast in
# them were counted as copies, 17-18 % of the seed's GPU time in section 7's tables)
KERNEL_KINDS = {
    "attention": ("flash", "fmha", "attention", "sdpa"),
    "matmul": ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "wgmma", "triton_tem"),
    "communication": ("nccl",),
    "triton (fused elementwise)": ("triton",),
    "copy": ("memcpy", "memset", "copy", "cast", "chunk_cat", "split_with_sizes"),
}


def kernel_kind(name: str) -> str:
    """The kind of a GPU kernel by its name (`KERNEL_KINDS`; "other" when none matches)."""
    low = name.lower()
    return next((k for k, words in KERNEL_KINDS.items() if any(w in low for w in words)), "other")


def gpu_time_shares(prof: Any, steps: int, wall_us: float) -> dict[str, Any]:
    """Where `steps` steps' GPU time went, from a torch.profiler run over them: the share of matmul,
    attention, communication, copy, Triton-fused and other kernels, the share of the wall time the GPU was
    busy (kernels may overlap: an estimate), the top kernels in ms per step; with the host profiled too, the
    host ops that took the most of its own time (the profiler's overhead included)."""
    rows = [
        (e.key, e.self_device_time_total)
        for e in prof.key_averages()
        if e.device_type == torch.autograd.DeviceType.CUDA
        and e.self_device_time_total > 0
        # a user annotation (Lightning's "Optimizer.step#AdamW.step" spans the whole step) is no kernel
        and not getattr(e, "is_user_annotation", False)
    ]
    busy = sum(t for _, t in rows)
    shares = dict.fromkeys([*KERNEL_KINDS, "other"], 0.0)
    for name, t in rows:
        shares[kernel_kind(name)] += t / busy if busy else 0.0
    top = sorted(rows, key=lambda r: -r[1])[:30]
    return {
        "gpu_busy_share_of_wall": busy / wall_us if wall_us else None,
        "gpu_ms_per_step": round(busy / 1e3 / steps, 3),
        "wall_ms_per_step": round(wall_us / 1e3 / steps, 3),
        "shares_of_gpu_time": {k: round(v, 4) for k, v in shares.items()},
        "top": [
            {"kernel": name[:120], "kind": kernel_kind(name), "ms_per_step": round(t / 1e3 / steps, 3)}
            for name, t in top
        ],
        "host_top": host_top(prof, steps),
        "gpu_idle": _or_error(gpu_idle, prof.events(), steps),
    }


def _or_error(fn: Any, *args: Any) -> Any:
    """An extra figure that fails says why and leaves the others standing."""
    try:
        return fn(*args)
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"[:300]}


def gpu_idle(events: Any, steps: int, n: int = 15, min_gap_us: float = 5.0) -> dict[str, Any]:
    """Where a step that is not GPU-bound waits: the gaps between the GPU's kernels (all streams merged) and
    the host ops that overlapped them, in ms per step by op name, the most first. An op that covers most of
    the idle time is the host's bottleneck in those steps (a sync call shows by its name, `cudaStreamSynchronize`
    and the like; Python work between ops shows as the annotation around it, Lightning's `Optimizer.step#...`);
    nested ops each count. `host_top` says where the host's time goes, this says which of it the GPU waits
    for. torch.profiler has no such view of its own (the trace viewer shows it, for a reader with a GPU trace)."""
    kernels = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    )
    if not kernels:
        return {}
    busy = _merge(kernels)
    gaps = [(a[1], b[0]) for a, b in itertools.pairwise(busy) if b[0] - a[1] >= min_gap_us]
    starts = [g[0] for g in gaps]
    overlap: dict[str, float] = {}
    for e in events if gaps else []:
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        lo, hi = e.time_range.start, e.time_range.end
        i = max(bisect.bisect_right(starts, lo) - 1, 0)
        total = 0.0
        while i < len(gaps) and gaps[i][0] < hi:
            total += max(0.0, min(hi, gaps[i][1]) - max(lo, gaps[i][0]))
            i += 1
        if total > 0:
            overlap[e.name] = overlap.get(e.name, 0.0) + total
    idle = sum(end - start for start, end in gaps)
    span = busy[-1][1] - busy[0][0]
    return {
        "idle_ms_per_step": round(idle / 1e3 / steps, 3),
        "idle_share_of_span": round(idle / span, 4) if span else None,
        "gaps_per_step": round(len(gaps) / steps, 1),
        "host_ops_during_idle": [
            {"op": name[:100], "ms_per_step": round(t / 1e3 / steps, 3)}
            for name, t in sorted(overlap.items(), key=lambda kv: -kv[1])[:n]
        ],
        "threads_during_idle": _threads_during_idle(events, gaps, steps),
    }


def _threads_during_idle(events: Any, gaps: list[tuple[float, float]], steps: int) -> list[dict[str, Any]]:
    """Per host thread, how much of the GPU's idle time it was inside an op, and the op it spends most time
    in (its name says which thread it is: Lightning's `Optimizer.step#...` on the training thread, the
    autograd engine's `autograd::engine::evaluate_function: ...` on the thread that runs a GPU backward).
    Idle time that no thread's op covers is Python between ops or a wait outside any op."""
    spans: dict[Any, list[tuple[float, float]]] = {}
    own: dict[Any, dict[str, float]] = {}
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU or getattr(e, "cpu_parent", None) is not None:
            continue  # top-level host ops only: their children lie inside them
        thread = getattr(e, "thread", None)
        lo, hi = e.time_range.start, e.time_range.end
        spans.setdefault(thread, []).append((lo, hi))
        own.setdefault(thread, {})
        own[thread][e.name] = own[thread].get(e.name, 0.0) + hi - lo
    covered_by_any: list[tuple[float, float]] = []
    rows = []
    for thread, intervals in spans.items():
        merged = _merge(intervals)
        covered_by_any += merged
        idle = _overlap(merged, gaps)
        if idle > 0:
            busiest = max(own[thread].items(), key=lambda kv: kv[1])[0]
            rows.append(
                {"busiest_op": busiest[:100], "idle_covered_ms_per_step": round(idle / 1e3 / steps, 3)}
            )
    rows.sort(key=lambda r: -r["idle_covered_ms_per_step"])
    uncovered = sum(end - start for start, end in gaps) - _overlap(_merge(covered_by_any), gaps)
    rows.append({"busiest_op": "(no host op)", "idle_covered_ms_per_step": round(uncovered / 1e3 / steps, 3)})
    return rows


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, non-overlapping union of `intervals`."""
    out: list[list[float]] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted, non-overlapping interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def host_top(prof: Any, steps: int, n: int = 12) -> list[dict[str, Any]]:
    """The host ops with the most self CPU time, in ms per step; an annotation's self time (Lightning's
    "Optimizer.step#...", which wraps the training step) is the Python work between its ops."""
    rows = [
        (e.key, e.self_cpu_time_total, e.count)
        for e in prof.key_averages()
        if e.device_type == torch.autograd.DeviceType.CPU and e.self_cpu_time_total > 0
    ]
    rows.sort(key=lambda r: -r[1])
    return [
        {"op": name[:100], "ms_per_step": round(t / 1e3 / steps, 3), "calls_per_step": round(c / steps, 1)}
        for name, t, c in rows[:n]
    ]


def step_periods(step_ends: list[float], warmup: int) -> list[float]:
    """Seconds per step after `warmup` steps: differences of consecutive batch-end times."""
    ends = step_ends[warmup:]
    return [b - a for a, b in itertools.pairwise(ends)]


class GpuUtilSampler(threading.Thread):
    """NVML utilisation of the training GPU every 0.25 s while running (bench/probe.py starts it)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(daemon=True)
        self.device, self.samples, self.stop = device, [], threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.25):
            try:
                self.samples.append(float(torch.cuda.utilization(self.device)))
            except Exception:  # NVML missing: no samples, the figure reads "—"
                return


#: how often `StackSampler` reads the training thread's stack by default
STACK_HZ = 300
#: where a Python thread waits for work or for its next tick (`Event.wait`, `Queue.get`, `select`)
IDLE_FILES = ("threading.py", "queue.py", "selectors.py")


class StackSampler(threading.Thread):
    """A sampling profiler of one thread's Python stack, in process: `hz` times a second it reads the stack
    the target thread is in (`sys._current_frames`) and counts it. A thread inside a torch op counts at the
    Python line that called the op (ops let the GIL go, so the sampler gets it meanwhile); one waiting (for
    the backward's thread, a lock, a synchronising call) counts where it waits: the samples spread as the
    thread's wall time does. Threads other than the target are counted too whenever they run Python then
    (hooks on torch's autograd thread, the threads that prepare batches ahead). py-spy would do this from
    outside, but needs ptrace, which a lent machine's container may not allow."""

    def __init__(self, target: int, hz: float, depth: int = 80) -> None:
        super().__init__(daemon=True, name="bench-stack-sampler")
        self.target, self.interval, self.depth = target, 1.0 / hz, depth
        # a sample's key: its innermost line and the ids of its frames' code objects (a code object's own hash
        # reads its contents: hashing 80 of them made a sample ~5x dearer); the objects kept by id
        self.stacks: Counter[tuple[int, tuple[int, ...]]] = Counter()
        self.codes: dict[int, Any] = {}
        self.others: Counter[tuple[str, int, int]] = Counter()
        self.samples = 0
        self.stop = threading.Event()
        self._cpu_start = threads_cpu_by_name()
        self._t0 = time.perf_counter()
        self.threads_cpu: dict[str, float] = {}

    def run(self) -> None:
        # the other threads, whenever they are not waiting in threading or queue (for work, for their next
        # tick): a thread running Python holds the GIL the training thread needs between its ops
        names = {t.ident: t.name for t in threading.enumerate()}
        own = threading.get_ident()
        while not self.stop.wait(self.interval):
            frames = sys._current_frames()
            self.samples += 1
            for ident, frame in frames.items():
                if ident == self.target:
                    self.stacks[self._stack(frame)] += 1
                elif ident != own and not frame.f_code.co_filename.endswith(IDLE_FILES):
                    name = names.get(ident) or "a thread torch started (autograd)"
                    self.codes.setdefault(id(frame.f_code), frame.f_code)
                    self.others[(name, id(frame.f_code), frame.f_lineno)] += 1
            del frames

    def _stack(self, frame: Any) -> tuple[int, tuple[int, ...]]:
        line, ids, codes = frame.f_lineno, [], self.codes
        while frame is not None and len(ids) < self.depth:
            code = frame.f_code
            key = id(code)
            if key not in codes:
                codes[key] = code
            ids.append(key)
            frame = frame.f_back
        return line, tuple(ids)  # innermost first

    def finish(self, n: int = 25) -> dict[str, Any]:
        wall = time.perf_counter() - self._t0
        end = threads_cpu_by_name()  # while the sampler still runs: its own CPU counted
        self.stop.set()
        self.threads_cpu = {
            name: round((cpu - self._cpu_start.get(name, 0.0)) / wall, 3)
            for name, cpu in sorted(end.items(), key=lambda kv: -(kv[1] - self._cpu_start.get(kv[0], 0.0)))
            if wall > 0
        }
        self.join(timeout=5)
        return self.summary(n)

    def summary(self, n: int = 25) -> dict[str, Any]:
        """Shares of the samples: `self`, the line each sample of the training thread was at (the Python
        line that called into torch, or waits); `inclusive`, the functions on its stack, those on (nearly)
        every sample left out (the loop that runs the step); `template`, those of them in vitrain's code;
        `other_threads`, the lines other threads were at when not waiting in threading or queue (a thread
        in `time.sleep` counts too: `threads_cpu_share` tells whether it ran)."""
        samples = self.samples or 1
        leaf: Counter[str] = Counter()
        inclusive: Counter[str] = Counter()
        stages: Counter[str] = Counter()
        for (line, ids), count in self.stacks.items():
            stack = tuple((self.codes[key], line if depth == 0 else 0) for depth, key in enumerate(ids))
            stages[stage_of(stack)] += count
            if stack:
                leaf[_where(*stack[0])] += count
            for key in {_where(code, None) for code, _ in stack}:
                inclusive[key] += count
        on_stack = sum(self.stacks.values())
        inclusive = Counter({k: c for k, c in inclusive.items() if c < 0.98 * on_stack})
        others: Counter[str] = Counter()
        for (name, code, line), count in self.others.items():
            others[f"{name}: {_where(self.codes[code], line)}"] += count

        def top(counter: Counter[str]) -> list[dict[str, Any]]:
            return [{"where": k, "share": round(c / samples, 3)} for k, c in counter.most_common(n)]

        ours = Counter({k: c for k, c in inclusive.items() if k.startswith("vitrain/")})
        return {
            "hz": round(1.0 / self.interval, 1),
            "samples": self.samples,
            # the share of samples that found the training thread (all, while it runs the step)
            "training_thread_share": round(on_stack / samples, 3),
            "stages": {k: round(c / samples, 3) for k, c in stages.most_common()},
            "self": top(leaf),
            "inclusive": top(inclusive),
            "template": top(ours),
            "other_threads": top(others),
            # each thread's CPU time over the window as a share of its wall time, by name (the sampler's own
            # included; those torch started have no Python name and are summed)
            "threads_cpu_share": self.threads_cpu,
        }


#: a sampled stack in none of `STAGES`: the loop between them (hooks' dispatch, progress, the batch's end)
REST = "the rest of Lightning's loop"
#: the parts of a Lightning training step, matched on a sampled stack from its innermost frame out, the first
#: match naming the part: (part, path fragment, function names or None for any)
STAGES: tuple[tuple[str, str, tuple[str, ...] | None], ...] = (
    ("FSDP2 hooks", "torch/distributed/fsdp/", None),
    ("compiled code (guards, wrappers, launches)", "torch/_dynamo/", None),
    ("compiled code (guards, wrappers, launches)", "torch/_inductor/", None),
    ("compiled code (guards, wrappers, launches)", "torch/_functorch/", None),
    ("compiled code (guards, wrappers, launches)", "torchinductor", None),
    ("backward (on a GPU: waiting for its thread)", "torch/autograd/", ("backward", "_engine_run_backward")),
    ("optimizer step", "torch/optim/", None),
    ("optimizer step", "vitrain/distributed/local_step.py", None),
    ("forward and loss (eager)", "", ("training_step",)),
    ("callbacks", "lightning/pytorch/trainer/call.py", ("_call_callback_hooks",)),
    ("batch to device (on-device augmentation)", "lightning/pytorch/core/module.py",
     ("_apply_batch_transfer_handler",)),
    ("next batch (data loader)", "lightning/pytorch/loops/fetchers.py", None),
    ("logging", "lightning/pytorch/core/module.py", ("log", "log_dict")),
)  # fmt: skip


def stage_of(stack: tuple[tuple[Any, int], ...]) -> str:
    """Which part of the training step a sampled stack (innermost frame first) is in (`STAGES`)."""
    for code, _ in stack:
        path = code.co_filename
        for stage, fragment, functions in STAGES:
            if fragment in path and (functions is None or code.co_name in functions):
                return stage
    return REST


def _where(code: Any, line: int | None) -> str:
    """`package/module.py:line function`, the path from the package root (site-packages or src/)."""
    path = code.co_filename
    for marker in ("site-packages/", "dist-packages/", "/src/", "/bench/"):
        if marker in path:
            path = path.rsplit(marker, 1)[1]
            break
    return f"{path}{'' if line is None else f':{line}'} {code.co_name}"
