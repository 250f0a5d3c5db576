"""A run's log book: `report.md`, `report.json` and `plots/*.png`, built from the run dir alone.

Inputs, all inside the run dir: the metric record `metrics.jsonl` (curves, best/final/test values; written
with any logger or none),
`run_stats.json` (timings, memory, world size... written by `vitrain.callbacks.report.RunReport`),
`batch_size_search.json` (`+tune=batch_size`) and `.hydra/` (overrides, choices). So the report can be
rebuilt at any time:

    python -m vitrain.report logs/train/runs/<run id>          # or: make report RUN=<dir>
    python -m vitrain.report logs/train/multiruns/<sweep id>   # every job's report, then the sweep summary
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from vitrain.utils.secrets import REDACTED, is_secret_key, redact, scrub

log = logging.getLogger(__name__)

# written by vitrain.callbacks.report.RunReport and vitrain.tuning (this module imports neither: the CLI
# needs no torch)
STATS_FILE = "run_stats.json"
METRICS_FILE = "metrics.jsonl"  # written by vitrain.loggers.MetricRecord
SEARCH_FILE = "batch_size_search.json"
PLOTS = {
    "loss": ("Loss", ["train/loss_step", "train/loss_epoch", "val/loss"]),
    "accuracy": ("Accuracy", ["train/acc1", "val/acc1", "val/acc5", "test/acc1"]),
}


# --- inputs ---------------------------------------------------------------------------------------------


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every value of the run's metric record (`metrics.jsonl`, `vitrain.loggers.MetricRecord`): tag ->
    [(step, value)], by step, last write wins (a resumed run logs some steps twice). Written whatever the
    loggers, so the report does not depend on TensorBoard or any other logger."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return {}
    merged: dict[str, dict[int, float]] = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line cut short by a crash
            continue
        step = row.pop("step", None)
        row.pop("epoch", None)  # Lightning adds the epoch to every call
        for tag, value in row.items():
            if step is not None and value is not None:
                merged.setdefault(tag, {})[int(step)] = float(value)
    return {tag: sorted(points.items()) for tag, points in merged.items()}


def read_hydra(run_dir: Path) -> dict[str, Any] | None:
    """Overrides and config-group choices from the `.hydra/` folder Hydra wrote into the run dir."""
    hydra_dir = run_dir / ".hydra"
    if not (hydra_dir / "overrides.yaml").is_file():
        return None
    overrides = yaml.safe_load((hydra_dir / "overrides.yaml").read_text()) or []
    choices: dict[str, Any] = {}
    if (hydra_dir / "hydra.yaml").is_file():
        runtime = (yaml.safe_load((hydra_dir / "hydra.yaml").read_text()) or {}).get("hydra", {})
        choices = {
            k: v
            for k, v in (runtime.get("runtime", {}).get("choices") or {}).items()
            if not k.startswith("hydra/")
        }
    return {"overrides": overrides, "choices": choices}


def mask_override(override: str) -> str:
    """`key=value` with the value hidden when the key names a secret, and secret values scrubbed."""
    key, sep, value = override.partition("=")
    if sep and is_secret_key(key.lstrip("+~").split(".")[-1]) and value not in ("", "null"):
        return f"{key}={REDACTED}"
    return scrub(override)


# --- the report -----------------------------------------------------------------------------------------


def _is_loss(tag: str) -> bool:
    return "loss" in tag.split("/")[-1]


# what Lightning's ThroughputMonitor logs under each stage's prefix: not model metrics
THROUGHPUT_KEYS = {"time", "batches", "samples", "lengths"}


def _is_model_metric(tag: str) -> bool:
    name = tag.partition("/")[2]
    return not (name in THROUGHPUT_KEYS or name.endswith("_per_sec") or name.startswith("device/"))


def metric_summary(scalars: dict[str, list[tuple[int, float]]], stats: dict[str, Any]) -> dict[str, Any]:
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


def _last(scalars: dict[str, list[tuple[int, float]]], tag: str) -> float | None:
    return scalars[tag][-1][1] if scalars.get(tag) else None


def build_report(run_dir: Path, scalars: dict[str, list[tuple[int, float]]] | None = None) -> dict[str, Any]:
    """Everything report.md shows, as one JSON-able dict."""
    run_dir = Path(run_dir)
    scalars = read_scalars(run_dir) if scalars is None else scalars
    stats = read_json(run_dir / STATS_FILE) or {}
    search = read_json(run_dir / SEARCH_FILE)
    hydra = read_hydra(run_dir) or stats.get("hydra") or {}
    fit = stats.get("fit") or {}
    epochs = fit.get("epochs") or []
    world = stats.get("world_size")
    memory = stats.get("memory") or {}
    per_device = memory.get("per_device") or []
    peak_key = "max_reserved_gb" if memory.get("device_type") == "cuda" else "peak_rss_gb"
    flops = stats.get("flops") or {}
    mfu = _last(scalars, "train/device/mfu")
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
        "config": stats.get("config") or {},
        "strategy": stats.get("strategy"),
        "accelerator": stats.get("accelerator"),
        "world_size": world,
        "num_nodes": stats.get("num_nodes"),
        "devices_per_node": stats.get("devices_per_node"),
        "precision": stats.get("precision"),
        "batch_size": {
            **(stats.get("batch_size") or {}),
            "accumulate_grad_batches": stats.get("accumulate_grad_batches"),
        },
        "epochs": len(epochs) or None,
        "global_step": fit.get("global_step"),
        "wall_time_s": fit.get("wall_time_s"),
        "train_time_s": fit.get("train_time_s"),
        "time_per_epoch_s": round(statistics.mean(e["wall_time_s"] for e in epochs), 3) if epochs else None,
        "epoch_times_s": [e["wall_time_s"] for e in epochs],
        "throughput_images_per_s": fit.get("images_per_s"),
        "throughput_monitor_images_per_s": monitor_ips,
        "mfu": mfu,
        "mfu_note": None
        if mfu is not None
        else (
            f"no peak FLOPs known for {flops.get('device') or 'this device'}"
            if flops
            else "not measured (no ImageThroughputMonitor)"
        ),
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
        "sources": {"metric_record": bool(scalars), "run_stats": bool(stats), "hydra": bool(hydra)},
    }
    return redact(report)


def _checkpoints_on_disk(run_dir: Path) -> dict[str, Any]:
    ckpt_dir = run_dir / "checkpoints"
    files = sorted(p.resolve() for p in ckpt_dir.glob("*.ckpt")) if ckpt_dir.is_dir() else []
    last = next((str(p) for p in files if p.name == "last.ckpt"), None)
    best = next((str(p) for p in files if p.name != "last.ckpt"), None)
    return {"dir": str(ckpt_dir.resolve()), "best": best, "last": last} if files else {}


# --- plots ----------------------------------------------------------------------------------------------


def plot_curves(scalars: dict[str, list[tuple[int, float]]], out_dir: Path) -> dict[str, str]:
    """plots/loss.png and plots/accuracy.png against the global step; names relative to the run dir."""
    from matplotlib.figure import Figure  # no pyplot: no global state, the Agg canvas, no display needed

    written: dict[str, str] = {}
    for name, (title, tags) in PLOTS.items():
        present = [t for t in tags if scalars.get(t)]
        if not present:
            continue
        fig = Figure(figsize=(7, 4), dpi=100, layout="constrained")
        ax = fig.add_subplot()
        for tag in present:
            steps, values = zip(*scalars[tag], strict=True)
            if len(steps) == 1:
                ax.plot(steps, values, "o", label=tag)
            else:
                thin = tag.endswith("_step")
                ax.plot(
                    steps,
                    values,
                    label=tag,
                    linewidth=0.8 if thin else 1.8,
                    alpha=0.5 if thin else 1.0,
                    marker=None if thin else ".",
                )
        ax.set(title=title, xlabel="step", ylabel=title.lower())
        ax.grid(alpha=0.3)
        ax.legend()
        out_dir.mkdir(parents=True, exist_ok=True)
        fig.savefig(out_dir / f"{name}.png")
        written[name] = f"{out_dir.name}/{name}.png"
    return written


# --- markdown -------------------------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _precision(report: dict[str, Any]) -> str:
    """`bf16-mixed (auto)` when `trainer.precision=auto` chose it for the machine."""
    asked = (report.get("config") or {}).get("trainer.precision")
    return _fmt(report.get("precision")) + (" (auto)" if asked == "auto" else "")


def _table(header: Iterable[str], rows: Iterable[Iterable[Any]]) -> list[str]:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    bs = report["batch_size"]
    procs = report["world_size"]
    layout = (
        f"{procs} process{'es' if procs != 1 else ''} ({report['num_nodes']} node(s) x "
        f"{report['devices_per_node']} device(s))"
        if procs
        else "-"
    )
    search = report["max_batch_size"]
    mfu = _fmt(report["mfu"]) if report["mfu"] is not None else f"n/a: {report['mfu_note']}"
    lines = [
        f"# Run report: `{Path(report['run_dir']).name}`",
        "",
        f"Run dir `{report['run_dir']}`; generated {report['generated']}. "
        "Rebuild with `python -m vitrain.report <run dir>`.",
        "",
        *_table(
            ["", ""],
            [
                ["experiment", report["experiment"]],
                ["overrides", " ".join(f"`{o}`" for o in report["overrides"]) or "-"],
                ["model", report["config"].get("model.net.model_name")],
                ["strategy", f"{_fmt(report['strategy'])} on {_fmt(report['accelerator'])}, {layout}"],
                ["precision", _precision(report)],
                [
                    "batch size",
                    f"{_fmt(bs.get('global'))} global, {_fmt(bs.get('per_device'))} per device"
                    f" (accumulate {_fmt(bs.get('accumulate_grad_batches'))})",
                ],
                ["epochs", report["epochs"]],
                [
                    "training wall time",
                    f"{_fmt(report['wall_time_s'])} s (fit), {_fmt(report['time_per_epoch_s'])} s per epoch",
                ],
                [
                    "throughput",
                    f"{_fmt(report['throughput_images_per_s'])} images/s (training batches, all devices)",
                ],
                ["MFU", mfu],
                ["peak memory", f"{_fmt(report['peak_memory_gb'])} GB (largest device)"],
                [
                    "max batch size",
                    f"{search['global']} global, {search['per_device']} per device"
                    if search
                    else "not searched (`+tune=batch_size`)",
                ],
            ],
        ),
        "",
        "## Metrics",
        "",
    ]
    metrics = report["metrics"]
    rows = [
        [tag, b["value"], b["step"], metrics["final"].get(tag, {}).get("value")]
        for tag, b in sorted(metrics["best"].items())
    ]
    rows += [
        [tag, None, None, f["value"]]
        for tag, f in sorted(metrics["final"].items())
        if tag not in metrics["best"]
    ]
    lines += _table(["metric", "best", "at step", "final"], rows) if rows else ["No validation metrics."]
    lines += [
        "",
        *(
            _table(["test metric", "value"], sorted(metrics["test"].items()))
            if metrics["test"]
            else ["No test metrics."]
        ),
    ]

    lines += ["", "## Memory (peak per device)", ""]
    memory = report["memory"] or {}
    devices = memory.get("per_device") or []
    if devices:
        keys = [k for k in devices[0] if k != "rank"]
        lines += [f"{memory.get('device_name')}, {memory.get('peak_window')}.", ""]
        lines += _table(["rank", *keys], [[d["rank"], *(d.get(k) for k in keys)] for d in devices])
    else:
        lines.append("Not recorded.")

    lines += ["", "## GPU utilisation", ""]
    util = report["gpu_utilization"]
    if util.get("available"):
        lines += _table(
            ["rank", "mean %", "max %", "samples"],
            [[d["rank"], d["mean_pct"], d["max_pct"], d["samples"]] for d in util["per_device"]],
        )
    else:
        lines.append(f"Not available: {util.get('reason')}.")

    if search:
        lines += [
            "",
            "## Maximum batch size",
            "",
            *_table(
                ["", ""],
                [
                    ["per device", search.get("per_device")],
                    ["global", f"{search.get('global')} ({search.get('world_size')} processes)"],
                    [
                        "searched with",
                        f"{search.get('accelerator')}, {search.get('precision')}, 1 device; "
                        f"strategy of the run: {search.get('strategy')}",
                    ],
                    ["memory cap", f"{_fmt(search.get('max_memory_gb'))} GB"],
                    [
                        "trials",
                        ", ".join(
                            f"{t['batch_size']}: {_fmt(t.get('peak_gb'))} GB"
                            for t in search.get("trials", [])
                        ),
                    ],
                    ["stopped by", search.get("stopped_by")],
                ],
            ),
        ]

    ckpts = report["checkpoints"] or {}
    lines += ["", "## Checkpoints", ""]
    lines.append(
        f"- best: `{ckpts.get('best')}`"
        + (
            f" ({ckpts.get('monitor')} = {_fmt(ckpts.get('best_score'))})"
            if ckpts.get("best_score") is not None
            else ""
        )
    )
    lines.append(f"- last: `{ckpts.get('last')}`")
    s3 = report["s3"]
    if s3:
        lines += [f"- S3: `{uri}`" for uri in s3.get("uploaded", []) if "/checkpoints/" in uri]
        lines += [f"- S3 failure: {message}" for message in s3.get("failures", [])]

    plots = report.get("plots") or {}
    if plots:
        lines += ["", "## Curves", "", *(f"![{name}]({path})" for name, path in plots.items())]
    return scrub("\n".join(lines) + "\n")


# --- writing --------------------------------------------------------------------------------------------


def write_report(run_dir: str | Path) -> dict[str, Any]:
    """Write report.json, report.md and plots/ into `run_dir`; returns the report."""
    run_dir = Path(run_dir)
    scalars = read_scalars(run_dir)
    report = build_report(run_dir, scalars)
    report["plots"] = plot_curves(scalars, run_dir / "plots")
    (run_dir / "report.json").write_text(scrub(json.dumps(report, indent=2, default=str)) + "\n")
    (run_dir / "report.md").write_text(render_markdown(report))
    return report


def finish_run(objects: dict[str, Any]) -> dict[str, Any] | None:
    """The end of a training task, on global rank zero: checkpoint paths and S3 keys into run_stats.json,
    then the report, then (when an S3 upload callback is there) the report files to S3.

    A failure here is logged, never raised: the run itself has succeeded."""
    from vitrain.callbacks.report import checkpoint_paths

    trainer = objects["trainer"]
    if not trainer.is_global_zero:
        return None
    run_dir = Path(objects["cfg"].paths.output_dir)
    try:
        stats = read_json(run_dir / STATS_FILE) or {}
        # recorded at the end of fit: testing the best checkpoint restores ModelCheckpoint's state from it
        stats["checkpoints"] = stats.get("checkpoints") or checkpoint_paths(trainer)
        uploaders = [
            c for c in trainer.callbacks if hasattr(c, "upload_run_files") and hasattr(c, "uploaded")
        ]
        if uploaders:
            stats["s3"] = {"uploaded": uploaders[0].uploaded, "failures": uploaders[0].failures}
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / STATS_FILE).write_text(json.dumps(redact(stats), indent=2, default=str) + "\n")
        report = write_report(run_dir)
        log.info("Run report: %s", run_dir / "report.md")
        for uploader in uploaders:
            uploader.upload_run_files(trainer)
        return report
    except Exception:
        log.exception("Writing the run report failed (the run itself succeeded)")
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vitrain.report", description=__doc__.split("\n")[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="run dirs, or sweep dirs (with multirun.yaml)")
    args = parser.parse_args(argv)
    from vitrain.sweep import job_dirs, write_summary

    for directory in args.dirs:
        if not directory.is_dir():
            print(f"error: {directory} is not a directory", file=sys.stderr)
            return 2
        if (directory / "multirun.yaml").is_file():
            for job in job_dirs(directory):
                if (job / STATS_FILE).is_file() or (job / METRICS_FILE).is_file():
                    write_report(job)
            paths = write_summary(directory)
            print("\n".join(str(p) for p in paths))
        else:
            write_report(directory)
            print(directory / "report.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
