"""The report of one run, as one dict (report.json) and as report.md with plots/, from the run dir alone.

Inputs, all inside the run dir: the metric record `metrics.jsonl` (curves, best/final/test values; written
with any logger or none),
`run_stats.json` (timings, memory, world size... written by `callbacks.run_stats.RunStats`),
`batch_size_search.json` (`+tune=batch_size`) and `.hydra/` (overrides, choices).
"""

from __future__ import annotations

import statistics
from datetime import datetime
from pathlib import Path
from typing import Any

from vitrain.reporting.markdown import render_markdown
from vitrain.reporting.plots import plot_curves
from vitrain.utils.atomic import write_atomic
from vitrain.utils.run_files import (
    CONFIG_KEYS,
    PLOTS_DIR,
    REPORT_JSON,
    REPORT_MD,
    SEARCH_FILE,
    STATS_FILE,
    Scalars,
    read_hydra,
    read_json,
    read_scalars,
    select_key,
    to_json,
)
from vitrain.utils.secrets import REDACTED, is_secret_key, redact, scrub


def mask_override(override: str) -> str:
    """`key=value` with the value hidden when the key names a secret, and secret values scrubbed. A flag
    (`model.net.class_token=false`) is no credential: shown as typed, as the config tree shows it."""
    key, sep, value = override.partition("=")
    if (
        sep
        and is_secret_key(key.lstrip("+~").split(".")[-1])
        and value.lower() not in ("", "null", "true", "false")
    ):
        return f"{key}={REDACTED}"
    return scrub(override)


def _is_loss(tag: str) -> bool:
    return "loss" in tag.split("/")[-1]


# what Lightning's ThroughputMonitor logs under each stage's prefix: not model metrics
THROUGHPUT_KEYS = {"time", "batches", "samples", "lengths"}


def _is_model_metric(tag: str) -> bool:
    name = tag.partition("/")[2]
    return not (name in THROUGHPUT_KEYS or name.endswith("_per_sec") or name.startswith("device/"))


def metric_summary(scalars: Scalars, stats: dict[str, Any]) -> dict[str, Any]:
    """Best and final validation values (with their step), final training values, test values.

    From the metric record when there is one, else from what the callback recorded."""
    best: dict[str, Any] = {}
    final: dict[str, Any] = {}
    test: dict[str, float] = {}
    if scalars:
        for tag, points in scalars.items():
            if not _is_model_metric(tag):
                continue
            if tag.startswith("test/"):
                test[tag] = points[-1][1]
            elif tag.startswith("val/"):
                pick = min if _is_loss(tag) else max
                step, value = pick(points, key=lambda p: p[1])
                best[tag] = {"value": value, "step": step}
                final[tag] = {"value": points[-1][1], "step": points[-1][0]}
            elif tag in ("train/loss_epoch", "train/acc1", "train/acc5"):
                final[tag] = {"value": points[-1][1], "step": points[-1][0]}
    else:
        history = stats.get("val_history") or []
        for tag in sorted({k for row in history for k in row if k.startswith("val/")}):
            rows = [r for r in history if tag in r]
            pick = min if _is_loss(tag) else max
            top = pick(rows, key=lambda r: r[tag])
            best[tag] = {"value": top[tag], "step": top["step"]}
            final[tag] = {"value": rows[-1][tag], "step": rows[-1]["step"]}
        test = {k: v for k, v in (stats.get("test") or {}).items() if k.startswith("test/")}
    return {"best": best, "final": final, "test": test}


def _last(scalars: Scalars, tag: str) -> float | None:
    return scalars[tag][-1][1] if scalars.get(tag) else None


def build_report(run_dir: Path, scalars: Scalars | None = None) -> dict[str, Any]:
    """Everything report.md shows, as one JSON-able dict."""
    run_dir = Path(run_dir)
    scalars = read_scalars(run_dir) if scalars is None else scalars
    stats = read_json(run_dir / STATS_FILE) or {}
    search = read_json(run_dir / SEARCH_FILE)
    hydra = read_hydra(run_dir) or stats.get("hydra") or {}
    config = stats.get("config") or _config_from_hydra(run_dir)
    fit = stats.get("fit") or {}
    epochs = fit.get("epochs") or []
    world = stats.get("world_size")
    memory = stats.get("memory") or {}
    per_device = memory.get("per_device") or []
    peak_key = "max_reserved_gb" if memory.get("device_type") == "cuda" else "peak_rss_gb"
    flops = stats.get("flops") or {}
    mfu = _last(scalars, "train/device/mfu")
    whole = [e["wall_time_s"] for e in epochs if not e.get("partial")]
    monitor_ips = _last(scalars, "train/samples_per_sec") or (
        _last(scalars, "train/device/samples_per_sec") * (world or 1)
        if _last(scalars, "train/device/samples_per_sec")
        else None
    )
    report: dict[str, Any] = {
        "run_dir": str(run_dir.resolve()),
        "generated": datetime.now().astimezone().isoformat(timespec="seconds"),
        "experiment": (hydra.get("choices") or {}).get("experiment"),
        "overrides": [mask_override(o) for o in hydra.get("overrides") or []],
        "config": config,
        "model": stats.get("model"),
        "strategy": stats.get("strategy"),
        "code": stats.get("code"),
        "software": stats.get("software"),
        "accelerator": stats.get("accelerator"),
        "world_size": world,
        "num_nodes": stats.get("num_nodes"),
        "devices_per_node": stats.get("devices_per_node"),
        "precision": stats.get("precision"),
        "batch_size": {
            **(stats.get("batch_size") or {}),
            "accumulate_grad_batches": stats.get("accumulate_grad_batches"),
        },
        "data": stats.get("data"),
        # epochs trained in all (a resumed run's session ran the last of them)
        "epochs": epochs[-1]["epoch"] + 1 if epochs else None,
        "resumed_at": fit.get("resumed_at"),
        "global_step": fit.get("global_step"),
        "wall_time_s": fit.get("wall_time_s"),
        "train_time_s": fit.get("train_time_s"),
        # whole epochs only: the one a session resumed in the middle of ran partly in another process
        "time_per_epoch_s": round(statistics.mean(whole), 3) if whole else None,
        "epoch_times_s": [e["wall_time_s"] for e in epochs],
        "throughput_images_per_s": fit.get("images_per_s"),
        "throughput_monitor_images_per_s": monitor_ips,
        "mfu": mfu,
        "first_step_s": fit.get("first_step_s"),
        "images_per_s_after_first_step": fit.get("images_per_s_after_first_step"),
        "mfu_note": None if mfu is not None else mfu_note(flops, stats, config),
        "stopped": stats.get("stopped") or _fit_end(config, stats, search),
        "flops": flops or None,
        "metrics": metric_summary(scalars, stats),
        "memory": memory or None,
        "peak_memory_gb": max((d.get(peak_key, 0.0) for d in per_device), default=None),
        "gpu_utilization": stats.get("gpu_utilization") or {"available": False, "reason": "not recorded"},
        "max_batch_size": search,
        "checkpoints": {
            **_checkpoints_on_disk(run_dir),
            **{k: v for k, v in (stats.get("checkpoints") or {}).items() if v is not None},
        },
        "s3": stats.get("s3"),
        "test_wall_time_s": (stats.get("test") or {}).get("wall_time_s"),
        # the test after fit stopped by hand: by what, and the checkpoint it was testing
        "test_stopped": {k: stats["test"].get(k) for k in ("stopped_by", "ckpt_path")}
        if (stats.get("test") or {}).get("stopped_by")
        else None,
        "sources": {"metric_record": bool(scalars), "run_stats": bool(stats), "hydra": bool(hydra)},
    }
    return redact(report)


def _fit_end(config: dict[str, Any], stats: dict[str, Any], search: dict[str, Any] | None) -> dict[str, Any]:
    """How a run that recorded no stop ended: completed ({}), or without a training step."""
    if not stats.get("fit"):
        return _without_fit(config, search)
    limit = zero_training_limit(config, stats)
    return {"by": "no training", "why": limit} if limit else {}


def zero_training_limit(config: dict[str, Any] | None, stats: dict[str, Any]) -> str | None:
    """`trainer.max_epochs=0` (or max_steps, limit_train_batches) where it left the fit without a training
    step: the run tested the weights it started with and measured no speed (it read "completed" before)."""
    fit = stats.get("fit") or {}
    if not fit or fit.get("images") or fit.get("epochs"):
        return None
    keys = ("trainer.max_epochs", "trainer.max_steps", "trainer.limit_train_batches")
    limits = [f"{key}=0" for key in keys if (config or {}).get(key) == 0]
    return ", ".join(limits) or None


def _without_fit(config: dict[str, Any], search: dict[str, Any] | None) -> dict[str, Any]:
    """How a run without a record of its fit ended: it was not meant to train (`train=false`: a test of a
    checkpoint, a batch-size search alone), or it stopped before the end of fit (killed, or still running)."""
    if config.get("train") is False:
        why = "a batch-size search only (tune.batch_size.apply=false)" if search else "train=false"
        return {"by": "no training", "why": why}
    return {"by": "unknown", "interrupted": True}


def mfu_note(flops: dict[str, Any], stats: dict[str, Any], config: dict[str, Any] | None = None) -> str:
    """Why a run's report has no MFU: the real reason, from what the run recorded."""
    if (config or {}).get("train") is False:
        return "no training in this run (train=false)"
    limit = zero_training_limit(config, stats)
    if limit:
        return f"no training step in this run ({limit})"
    if not flops:
        if not stats:
            return "not measured (no run_stats.json: the run ended before its statistics were written)"
        return "not measured (no ImageThroughputMonitor in the callbacks)"
    device = flops.get("device") or "this device"
    if flops.get("train_flops_per_image") is None:
        return f"the model's FLOPs per image could not be counted (images/s only) on {device}"
    if not flops.get("peak_flops_per_device"):
        return f"no peak FLOPs known for {device} (set callbacks.throughput.peak_flops)"
    window = flops.get("window_batches")
    steps = (stats.get("fit") or {}).get("global_step")
    return f"the run trained {steps} steps, fewer than the throughput window ({window} batches)"


def _config_from_hydra(run_dir: Path) -> dict[str, Any]:
    """The report's config entries from the `.hydra/config.yaml` Hydra wrote at the start: for a run that
    never wrote its run_stats.json (killed before the end of fit, a batch-size search alone). Interpolations
    within the file are resolved (`train: ${tune.batch_size.apply}`); one that needs the run (Hydra's
    resolvers) stays as written."""
    from omegaconf import OmegaConf

    path = run_dir / ".hydra" / "config.yaml"
    try:
        config = OmegaConf.load(path) if path.is_file() else None
    except Exception:  # unreadable YAML
        config = None
    if not OmegaConf.is_dict(config):
        return {}
    raw = OmegaConf.to_container(config, resolve=False)
    entries = {}
    for key in CONFIG_KEYS:
        try:
            value = OmegaConf.select(config, key, default=None)
            value = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
        except Exception:  # an interpolation that needs the run
            value = select_key(raw, key)
        entries[key] = value
    return entries


def _checkpoints_on_disk(run_dir: Path) -> dict[str, Any]:
    ckpt_dir = run_dir / "checkpoints"
    files = sorted(p.resolve() for p in ckpt_dir.glob("*.ckpt")) if ckpt_dir.is_dir() else []
    last = next((str(p) for p in files if p.name == "last.ckpt"), None)
    best = next((str(p) for p in files if p.name != "last.ckpt"), None)
    return {"dir": str(ckpt_dir.resolve()), "best": best, "last": last} if files else {}


def write_report(run_dir: str | Path) -> dict[str, Any]:
    """Write report.json, report.md and plots/ into `run_dir`; returns the report."""
    run_dir = Path(run_dir)
    scalars = read_scalars(run_dir)
    report = build_report(run_dir, scalars)
    report["plots"] = plot_curves(scalars, run_dir / PLOTS_DIR)
    write_atomic(run_dir / REPORT_JSON, scrub(to_json(report)))
    write_atomic(run_dir / REPORT_MD, render_markdown(report))
    return report
