"""What a run's report needs and cannot re-read later from the run dir: the `RunStats` callback writes it
to `run_stats.json`.

The metric record (metrics.jsonl, vitrain.loggers.MetricRecord) holds the metric curves; this callback adds
timings, images/s, peak memory of every device, GPU utilisation samples, how the run was set up (strategy,
world size, precision, batch sizes, Hydra overrides) and the data (classes, images per split, unreadable
files skipped). `vitrain.reporting.report` turns both into report.md / report.json. Every rank measures
its own device; the figures are gathered to global rank zero, which alone writes.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, Timer
from lightning.pytorch.utilities.exceptions import SIGTERMException

from vitrain.callbacks.divergence import DIVERGED, StopOnDivergence
from vitrain.callbacks.epoch_metrics import epoch_in_progress
from vitrain.callbacks.throughput import ImageThroughputMonitor, batch_size
from vitrain.utils.measuring import UtilisationSampler, device_memory, metric_floats, reset_peak_memory
from vitrain.utils.provenance import code_version, software_versions
from vitrain.utils.run_files import CONFIG_KEYS, STATS_FILE, read_json, select_key, write_json
from vitrain.utils.secrets import redact

log = logging.getLogger(__name__)
# what a session that had nothing left to train keeps of the sessions that trained
KEPT_AFTER_THE_END = ("fit", "val_history", "gpu_utilization", "memory", "flops", "stopped")


class RunStats(Callback):
    """Writes `<run_dir>/run_stats.json` on global rank zero after fit and after test."""

    def __init__(self, run_dir: str, gpu_sample_interval: float = 5.0) -> None:
        self.run_dir = Path(run_dir)
        self.gpu_sample_interval = gpu_sample_interval
        self.stats: dict[str, Any] = {}
        self._sampler: UtilisationSampler | None = None
        self._stretch: float | None = None  # start of the current run of training batches
        self._epoch_t0 = 0.0
        self._epoch = {"train_time": 0.0, "images": 0}
        self._memory_reset = False
        self._kept_earlier = False  # a relaunch after the end of training: the earlier sessions' figures
        #: the task's words for how to resume this run (vitrain/tasks/runs.resume_hint), set when it is built
        self.resume_hint: Callable[[], str] | None = None

    # -- set-up --

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        device = trainer.strategy.root_device
        if not self.stats:
            self.stats = {"created": _now(), "host": socket.gethostname(), **_run_info(trainer, pl_module)}
            if trainer.is_global_zero:  # what produced the numbers (the only rank that writes them)
                self.stats.update(code=code_version(), software=software_versions())
            # a batch-size search or the previous job of a sweep must not count in this run's peak
            self._memory_reset = reset_peak_memory(device)
        if stage == "fit":
            self.stats["fit"] = {"started": _now(), "epochs": [], "images": 0, "train_time_s": 0.0}
            self.stats["val_history"] = []
            self._fit_t0 = time.perf_counter()
            self._sampler = UtilisationSampler(device, self.gpu_sample_interval)
            self._sampler.start()

    # -- timing: training batches only (validation and checkpoint saving excluded) --
    # A stretch of training batches is timed from its first batch's start to the validation (or epoch end)
    # that closes it. On CUDA the clock is read after a synchronize only there, a few times per epoch: a
    # synchronize per batch would stall the host every step and the GPU would wait for the next launch.

    def _sync(self, trainer: L.Trainer) -> float:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)
        return time.perf_counter()

    def _close_stretch(self, trainer: L.Trainer) -> None:
        if self._stretch is not None:
            self._epoch["train_time"] += self._sync(trainer) - self._stretch
            self._stretch = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # a run resumed in the middle of an epoch gets no `on_train_epoch_start` for it: its clock starts here
        self._epoch_t0 = self._sync(trainer)
        if trainer.global_step > 0:  # restored from a checkpoint: this process's figures are this session's
            self.stats["fit"]["resumed_at"] = {
                "epoch": trainer.current_epoch,
                "step": trainer.global_step,
                "mid_epoch": epoch_in_progress(trainer),
            }

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_t0 = self._sync(trainer)
        self._epoch = {"train_time": 0.0, "images": 0}
        self._stretch = None

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, *_: Any
    ) -> None:
        if self._stretch is None:
            self._stretch = self._sync(trainer)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, *_: Any
    ) -> None:
        images = batch_size(batch)
        self.stats["batch_size"].setdefault("per_device_observed", images)
        self._epoch["images"] += images * trainer.world_size  # equal shards on every rank (drop_last)
        fit = self.stats["fit"]
        if "first_step_s" not in fit and self._stretch is not None:
            # the fit's first step: torch.compile's compile time (model.compile), cuDNN/cuBLAS warm-up and
            # the loader's start, kept apart from the steady-state figures (one synchronize, once)
            fit["first_step_s"] = round(self._sync(trainer) - self._stretch, 3)
            fit["first_step_images"] = images * trainer.world_size

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close_stretch(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        self.stats["val_history"].append(
            {
                "epoch": trainer.current_epoch,
                "step": trainer.global_step,
                **metric_floats(trainer.callback_metrics, "val/"),
            }
        )

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close_stretch(trainer)
        wall = self._sync(trainer) - self._epoch_t0
        train_time, images = self._epoch["train_time"], self._epoch["images"]
        fit = self.stats["fit"]
        resumed = fit.get("resumed_at") or {}
        fit["epochs"].append(
            {
                "epoch": trainer.current_epoch,
                "wall_time_s": round(wall, 3),
                "train_time_s": round(train_time, 3),
                "images": images,
                "images_per_s": round(images / train_time, 2) if train_time > 0 else None,
                # the epoch this session resumed in the middle of: its times cover the batches after that
                **(
                    {"partial": True}
                    if resumed.get("mid_epoch") and resumed["epoch"] == trainer.current_epoch
                    else {}
                ),
            }
        )
        fit["images"] += images
        fit["train_time_s"] = round(fit["train_time_s"] + train_time, 3)
        self._stretch = None

    # -- end of fit / test: gather from every rank, write on rank zero --

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._end_fit(trainer)
        timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
        if (
            timer is not None
            and timer.time_remaining("train") is not None
            and timer.time_remaining("train") <= 0
        ):
            self.stats["stopped"] = {
                "by": "trainer.max_time",
                "step": trainer.global_step,
                "epoch": trainer.current_epoch,
            }
        diverged = next((c.stopped for c in trainer.callbacks if isinstance(c, StopOnDivergence)), None)
        if diverged:
            self.stats["stopped"] = {"by": DIVERGED, **diverged}

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        """A run stopped by SIGTERM (every rank stops at the same step): what it did, marked interrupted,
        for the report the training task writes before it exits. A test after fit stopped (Ctrl-C): which
        checkpoint it was testing, and by what."""
        if isinstance(exception, SIGTERMException) and trainer.state.fn == "test":
            by = getattr(exception, "by", "SIGTERM")
            self.stats["test"] = {"stopped_by": by, "ckpt_path": trainer.ckpt_path}
            if trainer.is_global_zero:
                self.save()
            return
        if (
            not isinstance(exception, SIGTERMException)
            or trainer.state.fn != "fit"
            or "fit" not in self.stats
        ):
            return
        self._close_stretch(trainer)
        fit = self.stats["fit"]
        fit["images"] += self._epoch["images"]  # the epoch it stopped in, so far
        fit["train_time_s"] = round(fit["train_time_s"] + self._epoch["train_time"], 3)
        self._epoch = {"train_time": 0.0, "images": 0}
        self._end_fit(trainer)
        self.stats["stopped"] = {
            "by": getattr(exception, "by", "SIGTERM"),
            "interrupted": True,
            "step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "resume": self.resume_hint() if self.resume_hint else None,
        }
        if trainer.is_global_zero:
            self.save()

    def _end_fit(self, trainer: L.Trainer) -> None:
        fit = self.stats["fit"]
        fit["wall_time_s"] = round(time.perf_counter() - self._fit_t0, 3)
        fit["global_step"] = trainer.global_step
        if fit["train_time_s"] > 0:
            fit["images_per_s"] = round(fit["images"] / fit["train_time_s"], 2)
        rest = fit["train_time_s"] - fit.get("first_step_s", 0.0)
        if "first_step_s" in fit and fit["images"] > fit["first_step_images"] and rest > 0:
            fit["images_per_s_after_first_step"] = round((fit["images"] - fit["first_step_images"]) / rest, 2)
        if self._sampler is not None:
            self._sampler.stop()
            self.stats["gpu_utilization"] = self._gather_utilisation(trainer)
        self.stats["memory"] = self._gather_memory(trainer)
        self._add_throughput_info(trainer)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if "global_step" not in self.stats["fit"] and trainer.global_step > 0:
            self._keep_sessions_that_trained(trainer)
        self.stats["checkpoints"] = checkpoint_paths(trainer)
        if trainer.is_global_zero:
            self.save(trainer)

    def _keep_sessions_that_trained(self, trainer: L.Trainer) -> None:
        """Resumed from a checkpoint whose training had ended (a finished job of a relaunched sweep, the same
        VITRAIN_RUN_ID again): Lightning skips the training loop, and this session's empty figures would
        replace those of the sessions that trained (the report's epochs, times, images/s). Those stay."""
        earlier = read_json(self.run_dir / STATS_FILE) or {}
        if not trainer.is_global_zero or not (earlier.get("fit") or {}).get("epochs"):
            return
        for key in KEPT_AFTER_THE_END:
            if key in earlier:
                self.stats[key] = earlier[key]
        self.stats["fit"]["relaunched_after_the_end"] = _now()
        self._kept_earlier = True
        log.info(
            "nothing left to train: this run ended its training at step %d (trainer.max_epochs=%s, "
            "max_steps=%s); its report keeps the figures of the sessions that trained. Raise "
            "trainer.max_epochs or trainer.max_steps to train on",
            trainer.global_step,
            trainer.max_epochs,
            trainer.max_steps,
        )

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._test_t0 = self._sync(trainer)

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.stats["test"] = {
            "wall_time_s": round(self._sync(trainer) - self._test_t0, 3),
            "ckpt_path": trainer.ckpt_path,
            **metric_floats(trainer.callback_metrics, "test/"),
        }
        memory = self._gather_memory(trainer)  # the peak now covers fit and test
        if not self._kept_earlier:  # a test-only session's peak is not the run's
            self.stats["memory"] = memory
        if trainer.is_global_zero:
            self.save(trainer)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._sampler is not None:
            self._sampler.stop()
        if stage in ("fit", "test") and trainer.is_global_zero:
            self.save(trainer)  # the other callbacks' parts as they stand once theirs have ended (S3 uploads)

    def save(self, trainer: L.Trainer | None = None) -> Path:
        """run_stats.json, with the part of every callback that has one (`run_stats_entry()`: S3 uploads)."""
        for callback in trainer.callbacks if trainer is not None else []:
            if callback is not self and callable(entry := getattr(callback, "run_stats_entry", None)):
                self.stats.update(entry())
        return write_json(self.run_dir / STATS_FILE, redact(self.stats))

    # -- helpers --

    def _gather_memory(self, trainer: L.Trainer) -> dict[str, Any]:
        device = trainer.strategy.root_device
        mine = device_memory(device)
        keys = list(mine)
        gathered = trainer.strategy.all_gather(
            torch.tensor([mine[k] for k in keys], dtype=torch.float64, device=device)
        )
        rows = gathered.reshape(trainer.world_size, len(keys)).cpu().tolist()
        return {
            "device_type": device.type,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "peak_window": "since the start of this run" if self._memory_reset else "process lifetime",
            "per_device": [
                {"rank": rank, **{k: round(v, 4) for k, v in zip(keys, row, strict=True)}}
                for rank, row in enumerate(rows)
            ],
        }

    def _gather_utilisation(self, trainer: L.Trainer) -> dict[str, Any]:
        sampler = self._sampler
        assert sampler is not None
        # every rank takes part in the collective, whatever it has to say
        summary = torch.tensor(
            sampler.summary() if sampler.unavailable is None else [float("nan")] * 3,
            dtype=torch.float64,
            device=trainer.strategy.root_device,
        )
        rows = trainer.strategy.all_gather(summary).reshape(trainer.world_size, 3).cpu().tolist()
        if sampler.unavailable is not None:
            return {"available": False, "reason": sampler.unavailable}
        return {
            "available": True,
            "interval_s": sampler.interval,
            "per_device": [
                {"rank": r, "mean_pct": round(m, 1), "max_pct": mx, "samples": int(n)}
                for r, (m, mx, n) in enumerate(rows)
            ],
            "rank0_samples": sampler.samples,
        }

    def _add_throughput_info(self, trainer: L.Trainer) -> None:
        monitor = next((c for c in trainer.callbacks if isinstance(c, ImageThroughputMonitor)), None)
        if monitor is None:
            return
        self.stats["flops"] = {
            "train_flops_per_image": monitor.train_flops,
            "eval_flops_per_image": monitor.eval_flops,
            # progressive resizing: the smaller sizes trained at (`train/img_size`), per image
            "resized_train_flops_per_image": {
                f"{h}x{w}": flops for (h, w), flops in sorted(monitor.resized_train_flops.items())
            }
            or None,
            "peak_flops_per_device": monitor.available_flops,
            "device": monitor.device_name,
            "window_batches": monitor.train_window,
        }


def checkpoint_paths(trainer: L.Trainer) -> dict[str, Any]:
    """Best (the monitored ModelCheckpoint) and last: a `save_last` path, or the newest file of an
    unmonitored ModelCheckpoint (configs/callbacks/default.yaml keeps `last.ckpt` that way)."""
    callbacks = trainer.checkpoint_callbacks
    best = next((c for c in callbacks if c.monitor), None)
    last = next((c.last_model_path for c in callbacks if c.last_model_path), None) or next(
        (c.best_model_path for c in callbacks if not c.monitor and c.best_model_path), None
    )
    if best is None and last is None:
        return {}
    score = best.best_model_score if best is not None else None
    return {
        "dir": (best or callbacks[0]).dirpath,
        "best": (best.best_model_path or None) if best is not None else None,
        "best_score": float(score) if score is not None else None,
        "monitor": best.monitor if best is not None else None,
        "last": last,
    }


def _run_info(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
    datamodule = trainer.datamodule
    global_batch = getattr(datamodule, "hparams", {}).get("batch_size")
    info: dict[str, Any] = {
        "strategy": type(trainer.strategy).__name__,
        "accelerator": trainer.strategy.root_device.type,
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "devices_per_node": trainer.num_devices,
        "precision": str(trainer.precision),
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "batch_size": {
            "global": global_batch,
            "per_device": global_batch // trainer.world_size if global_batch else None,
        },
        "hydra": _hydra_info(),
    }
    facts = getattr(datamodule, "data_facts", None)
    if callable(facts):
        info["data"] = facts()  # classes, images per split, unreadable files skipped
    run_config = getattr(pl_module, "run_config", None)
    if run_config:
        info["config"] = {key: select_key(run_config, key) for key in CONFIG_KEYS}
        net = select_key(run_config, "model.net")
        if isinstance(net, dict):
            parameters = sum(p.numel() for p in pl_module.parameters())
            info["model"] = describe_net(net, parameters, select_key(run_config, "model.weights_file"))
    return info


# keywords that change a timm architecture's shape from the one its name describes
ARCHITECTURE_KEYS = (
    "img_size",
    "patch_size",
    "embed_dim",
    "depth",
    "num_heads",
    "mlp_ratio",
    "class_token",
    "global_pool",
)


def describe_net(net: dict[str, Any], parameters: int | None = None, weights_file: str | None = None) -> str:
    """The model as built: the timm name, and what the config changed in its architecture (a conv-stem
    hybrid built from `vit_tiny_patch16_224` is not a ViT-Tiny/16), with its parameter count and the weights
    it started from (a fine-tuned run's accuracy is not a from-scratch one's)."""
    changes = [f"{key}={net[key]}" for key in ARCHITECTURE_KEYS if net.get(key) is not None]
    layer = net.get("embed_layer")
    if isinstance(layer, dict):
        target = (layer.get("backbone") or {}).get("_target_") or layer.get("_target_") or "custom"
        changes.insert(0, f"patch embedding {str(target).rsplit('.', 1)[-1]}")
    text = str(net.get("model_name"))
    if changes:
        text += f" architecture with {', '.join(changes)}"
    if parameters:
        text += f" ({parameters / 1e6:.2f} M parameters)"
    if weights_file:
        return f"{text}, started from the weights in {weights_file}"
    if net.get("pretrained"):
        return f"{text}, started from timm's pretrained weights{_hub_id(str(net.get('model_name')))}"
    return f"{text}, from scratch"


def _hub_id(model_name: str) -> str:
    """` (hf-hub:<repo>)`: where timm takes the model's pretrained weights from; '' when it does not say."""
    try:
        import timm

        repo = timm.models.get_pretrained_cfg(model_name).hf_hub_id
    except Exception:  # no pretrained config for this name
        return ""
    return f" (hf-hub:{repo})" if repo else ""


def _hydra_info() -> dict[str, Any] | None:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    choices = OmegaConf.to_container(hydra_cfg.runtime.choices)
    return {
        "overrides": list(hydra_cfg.overrides.task),
        "choices": {k: v for k, v in choices.items() if not k.startswith("hydra/")},
        "mode": str(hydra_cfg.mode),
        "job_num": hydra_cfg.job.get("num"),
    }


def _now() -> str:
    return datetime.now().astimezone().isoformat(timespec="seconds")
