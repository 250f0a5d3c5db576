"""The largest batch size that fits, for the run's model and precision: `+tune=batch_size`.

Lightning's batch-size finder (`Tuner.scale_batch_size`) does the search: it doubles the batch size (then
bisects, in `binsearch` mode) until a step runs out of memory. It refuses distributed strategies, so the
search runs on ONE device of the run's accelerator; the per-device figure is multiplied by the run's world
size for the global `datamodule.batch_size` (DDP keeps a full model per device: that figure holds; FSDP
shards parameters and optimizer state, so more fits: it is a lower bound there).

`margin` (head-room below the largest size that ran) is applied by Lightning in `binsearch` mode only. In
`power` mode (the default) the answer is the largest power of two that ran `steps_per_trial` steps: at most
the true limit, often well below it; a long run also holds validation buffers and fragments memory, so keep
some head-room when the answer is right at the limit (docs/gpu.md).

A CPU never runs "out of memory" the way a GPU does: the machine swaps or the kernel kills the process.
So a memory cap (`max_memory_gb`, by default half the RAM) stops the growth: a trial fails when the
process's peak RSS exceeds it, or before it starts when the peak extrapolated from the previous trials
would. Lightning sees such a failure as an out-of-memory error and reacts as it does to a real one.

The search runs before the run is built, on a datamodule and model of its own (`vitrain.tasks.build`), so
the run's objects are never touched. The result goes to `<run dir>/batch_size_search.json` and into the run
report. With `apply: true` it is written in one place, the config's `datamodule.batch_size`, from which the
run is then built (and which its checkpoints store); processes that Lightning starts for the other local
ranks get it as a rank-zero decision (`BATCH_SIZE_SEARCH`, vitrain/tasks/decisions.py).
"""

from __future__ import annotations

import copy
import gc
import json
import logging
import time
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import psutil
import torch
from lightning.pytorch.tuner import Tuner
from omegaconf import DictConfig, open_dict

from vitrain.distributed.ranks import devices_per_node, global_rank_from_env
from vitrain.errors import UserError
from vitrain.tasks.build import build_model
from vitrain.tasks.decisions import BATCH_SIZE_SEARCH, decisions
from vitrain.tasks.precision import resolve_precision
from vitrain.utils.measuring import GB, peak_rss_bytes, reset_peak_memory
from vitrain.utils.run_files import SEARCH_FILE

log = logging.getLogger(__name__)


class MemoryCapExceeded(RuntimeError):
    """Raised inside a trial; its message is the one Lightning's `is_oom_error` knows for CPU memory."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"DefaultCPUAllocator: can't allocate memory: {detail}")


def peak_bytes(device: torch.device) -> int:
    """This process's peak memory on `device` since the last reset."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device)
    return peak_rss_bytes()


def extrapolate(trials: list[tuple[int, int]], batch: int) -> float | None:
    """Peak memory expected at `batch` from the last two trials (memory grows linearly with the batch)."""
    smaller = sorted(dict(t for t in trials if t[0] < batch).items())  # the latest trial of each size
    if len(smaller) < 2:
        return None
    (b1, m1), (b2, m2) = smaller[-2:]
    per_image = max(m2 - m1, 0) / (b2 - b1)
    return m2 + per_image * (batch - b2)


class PerDeviceBatch(L.LightningDataModule):
    """The run's datamodule as the finder sees it: a `batch_size` attribute it can scale.

    The search runs on one process, so the datamodule's (global) batch size is the per-device one. Setting
    it runs the datamodule's `setup` again, which recomputes its loaders' batch size. Every batch first
    checks the memory cap. The datamodule's batch hooks run as in the run (a GPU decoder turns encoded
    bytes into images before the transfer); the model's own batch hooks would not (ours has none).
    """

    def __init__(
        self, datamodule: L.LightningDataModule, device: torch.device, cap_bytes: float | None
    ) -> None:
        super().__init__()
        self.datamodule, self.device, self.cap = datamodule, device, cap_bytes
        self.trials: list[tuple[int, int]] = []  # (batch size, peak bytes) of every trial that ran
        self.stopped_by: str | None = None
        self._started = False

    @property
    def batch_size(self) -> int:
        return int(self.datamodule.hparams.batch_size)

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        self._close_trial()
        self.datamodule.hparams.batch_size = int(value)
        self.datamodule.setup("fit")

    def _close_trial(self) -> None:
        if self._started:
            self.trials.append((self.batch_size, peak_bytes(self.device)))
        self._started = False
        reset_peak_memory(self.device)

    def prepare_data(self) -> None:
        self.datamodule.prepare_data()

    def setup(self, stage: str) -> None:
        self.datamodule.trainer = self.trainer
        self.datamodule.setup(stage)

    def train_dataloader(self) -> Any:
        return self.datamodule.train_dataloader()

    def val_dataloader(self) -> Any:
        return self.datamodule.val_dataloader()

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return self.datamodule.on_before_batch_transfer(batch, dataloader_idx)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        return self.datamodule.transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self._check_cap()
        return self.datamodule.on_after_batch_transfer(batch, dataloader_idx)

    def _check_cap(self) -> None:
        self._started = True
        if self.cap is None:
            return
        batch = self.batch_size
        peak = peak_bytes(self.device)
        expected = extrapolate(self.trials, batch)
        if peak > self.cap:
            self.stopped_by = f"memory cap: batch {batch} reached {peak / GB:.2f} GB"
        elif expected is not None and expected > self.cap:
            self.stopped_by = f"memory cap: batch {batch} would need about {expected / GB:.2f} GB"
        else:
            return
        self.trials.append((batch, max(peak, int(expected or 0))))
        self._started = False
        log.info("Batch size %d: %s", batch, self.stopped_by)
        raise MemoryCapExceeded(f"{self.stopped_by} > max_memory_gb={self.cap / GB:.2f}")


def memory_cap_bytes(max_memory_gb: float | None, device: torch.device) -> float | None:
    """The cap in bytes: the configured one; on CPU half the RAM when none is configured; on GPU none (the
    device's own out-of-memory error stops the search)."""
    if max_memory_gb is not None:
        return float(max_memory_gb) * GB
    return psutil.virtual_memory().total / 2 if device.type == "cpu" else None


def first_device(devices: Any) -> int | list[int]:
    """`Trainer(devices=...)` for the search: the run's first device (GPU 2 of `devices=[2,3]`, not GPU 0,
    which may belong to another job), or one device when the run names none in particular."""
    if isinstance(devices, str) and "," in devices:
        devices = [d for d in devices.split(",") if d.strip()]
    if isinstance(devices, list | tuple) or (hasattr(devices, "__iter__") and not isinstance(devices, str)):
        items = list(devices)
        return [int(items[0])] if items else 1
    return 1


def search_batch_size(cfg: DictConfig) -> dict[str, Any] | None:
    """Run the search if `tune.batch_size` is configured (`+tune=batch_size`) and, with `apply: true`, set
    `cfg.datamodule.batch_size` to its result: call it before the run is built. Returns the result."""
    options = (cfg.get("tune") or {}).get("batch_size")
    if not options or not options.get("enabled", True):
        return None
    run_dir = Path(cfg.paths.output_dir)
    per_node = devices_per_node(cfg.trainer.get("devices", 1), cfg.trainer.get("accelerator"))
    world = per_node * int(cfg.trainer.get("num_nodes", 1))
    if global_rank_from_env(per_node) != 0:
        if not options.get("apply"):
            return None
        result = _decided_result()  # global rank zero searched before it launched this process
    else:
        datamodule: L.LightningDataModule = hydra.utils.instantiate(cfg.datamodule)
        model = build_model(cfg, datamodule)  # the search's own: the run is built afterwards
        result = find_max_batch_size(model, datamodule, cfg, world, run_dir, options)
        del model, datamodule
        (run_dir / SEARCH_FILE).write_text(json.dumps(result, indent=2) + "\n")
        log.info(
            "Largest batch size that fits: %d per device, %d global (%d processes); see %s",
            result["per_device"],
            result["global"],
            world,
            run_dir / SEARCH_FILE,
        )
    if options.get("apply"):
        with open_dict(cfg):
            cfg.datamodule.batch_size = result["global"]
    return result


def decision(result: dict[str, Any] | None) -> dict[str, str]:
    """The search's result as the rank-zero decision the processes Lightning starts read."""
    return {BATCH_SIZE_SEARCH: json.dumps(result)} if result else {}


def _decided_result() -> dict[str, Any]:
    result = decisions.get_json(BATCH_SIZE_SEARCH)
    if result is None:
        raise UserError(
            "tune.batch_size: this process was not started by the one that searched; with torchrun, SLURM or "
            "several nodes, run the search first (one process), then train with datamodule.batch_size=<global>"
        )
    return result


def search_copy(model: L.LightningModule) -> L.LightningModule:
    """The model the search trains: a copy, at the data's full size. With progressive resizing the trials
    (progress 0) would run at its start size, a fraction of the memory of the full-size steps to come."""
    probe = copy.deepcopy(model)
    if getattr(probe, "resize", None) is not None:
        probe.resize = None
    return probe


def find_max_batch_size(
    model: L.LightningModule,
    datamodule: L.LightningDataModule,
    cfg: DictConfig,
    world_size: int,
    run_dir: Path,
    options: DictConfig | dict[str, Any],
) -> dict[str, Any]:
    """Search on one device with a copy of `model` and with `datamodule` (the search's own: its `setup` is
    made for this one process, not for the run's ranks)."""
    trainer_cfg = cfg.trainer
    precision = resolve_precision(trainer_cfg)  # the run's own, `auto` resolved alike
    tuner_trainer = L.Trainer(
        accelerator=trainer_cfg.get("accelerator", "auto"),
        devices=first_device(trainer_cfg.get("devices", 1)),
        precision=precision,
        gradient_clip_val=trainer_cfg.get("gradient_clip_val"),
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        default_root_dir=str(run_dir),
    )
    device = tuner_trainer.strategy.root_device
    cap = memory_cap_bytes(options.get("max_memory_gb"), device)
    reset_peak_memory(device)
    if cap is not None and peak_bytes(device) > cap:
        raise UserError(
            f"tune.batch_size.max_memory_gb={cap / GB:.2f} is below what the process already uses "
            f"({peak_bytes(device) / GB:.2f} GB) before any batch: raise it"
        )
    # Lightning builds the first trial's loader before it sets `init_val`: start from it already
    datamodule.hparams.batch_size = int(options.get("init_val", 2))
    scaled = PerDeviceBatch(datamodule, device, cap)
    t0 = time.perf_counter()
    try:
        found = Tuner(tuner_trainer).scale_batch_size(
            search_copy(model),
            datamodule=scaled,
            method="fit",
            mode=options.get("mode", "power"),
            steps_per_trial=int(options.get("steps_per_trial", 3)),
            init_val=int(options.get("init_val", 2)),
            max_trials=int(options.get("max_trials", 25)),
            margin=float(options.get("margin", 0.05)),
            max_val=int(options.get("max_val", 8192)),
        )
        train_set = getattr(datamodule, "train_set", None)
        train_size = len(train_set) if train_set is not None else None
    finally:
        scaled._close_trial()
        del tuner_trainer
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    per_device, max_val = int(found or 0), int(options.get("max_val", 8192))
    tried = {b for b, _ in scaled.trials}
    if scaled.stopped_by:
        stopped_by = scaled.stopped_by
    elif train_size is not None and per_device >= train_size:
        per_device, stopped_by = min(per_device, train_size), f"the training set's size ({train_size} images)"
    elif per_device >= max_val:
        stopped_by = f"max_val={max_val}" + (
            "" if max_val in tried else " (Lightning stops there without trying it)"
        )
    else:
        stopped_by = "out of memory" if device.type == "cuda" else "max_trials"
    if per_device < 1:
        raise UserError(
            "tune.batch_size: not even one image per device fits; lower the model size or precision"
        )
    return {
        "per_device": per_device,
        "global": per_device * world_size,
        "world_size": world_size,
        "accelerator": device.type,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "device_index": device.index,
        "precision": str(precision),
        "strategy": _strategy_name(trainer_cfg),
        "model": cfg.model.net.get("model_name"),
        "img_size": getattr(model, "input_spec", {}).get("img_size"),
        "mode": options.get("mode", "power"),
        "max_memory_gb": round(cap / GB, 3) if cap is not None else None,
        "trials": [{"batch_size": b, "peak_gb": round(m / GB, 3)} for b, m in scaled.trials],
        "stopped_by": stopped_by,
        "seconds": round(time.perf_counter() - t0, 1),
        "applied": bool(options.get("apply")),
    }


def _strategy_name(trainer_cfg: DictConfig) -> str:
    strategy = trainer_cfg.get("strategy")
    if isinstance(strategy, DictConfig | dict):
        return str(strategy.get("_target_", "custom")).rsplit(".", 1)[-1]
    return str(strategy or "auto")
