"""The text of report.md, and the table helpers the sweep summary shares."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from vitrain.utils.secrets import scrub


def fmt(value: Any, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _precision(report: dict[str, Any]) -> str:
    """`bf16-mixed (auto)` when `trainer.precision=auto` chose it for the machine."""
    asked = (report.get("config") or {}).get("trainer.precision")
    return fmt(report.get("precision")) + (" (auto)" if asked == "auto" else "")


def _data(data: dict[str, Any] | None) -> str:
    """`ImageFolderDataModule, 3 classes; 66 train / 9 val / 9 test images`."""
    if not data:
        return "not recorded"
    sizes = data.get("images") or {}
    images = " / ".join(f"{fmt(sizes.get(s))} {s}" for s in ("train", "val", "test"))
    same = " (test = the val images: the data has no test split)" if data.get("test_is_val") else ""
    return f"{data.get('datamodule')}, {fmt(data.get('num_classes'))} classes; {images} images{same}"


def _class_images(data: dict[str, Any] | None) -> str:
    """`20 (dog) to 500 (cat), median 200; 25x` for the training images per class; `30 each` when equal."""
    counts = (data or {}).get("train_class_images")
    if not counts:
        return "not recorded"
    small, large = min(counts, key=counts.get), max(counts, key=counts.get)
    if counts[small] == counts[large]:
        return f"{counts[small]} each"
    ordered = sorted(counts.values())
    median = ordered[len(ordered) // 2]
    ratio = f"; {counts[large] / counts[small]:.1f}x" if counts[small] else ""
    return f"{counts[small]} (`{small}`) to {counts[large]} (`{large}`), median {median}{ratio}"


def _skipped(data: dict[str, Any] | None) -> str:
    """The count of unreadable files left out, with the first few named; 0 when none."""
    if not data or data.get("skipped_files") is None:
        return "not recorded"
    count = data["skipped_files"]
    names = [Path(e["path"]).name for e in data.get("skipped_examples") or []]
    if not count:
        return "0"
    more = ", ..." if count > len(names) else ""
    return f"{count} (unreadable, left out: {', '.join(f'`{n}`' for n in names)}{more})"


def _code(code: dict[str, Any] | None, software: dict[str, Any] | None) -> str:
    """The commit the run's code was at (and whether it had changes), and the libraries it ran with."""
    if code:
        where = f"`{code['commit'][:12]}`" + (" with uncommitted changes" if code.get("dirty") else "")
    else:
        where = "not recorded (not a git checkout)" if software else "not recorded"
    if software:
        names = ("python", "torch", "lightning", "timm", "cuda")
        where += "; " + ", ".join(f"{n} {software[n]}" for n in names if software.get(n))
    return where


def _stopped(stopped: dict[str, Any] | None, with_resume: bool = False) -> str:
    """How the run ended: completed, at the time limit, or interrupted (with what resumes it)."""
    if not stopped:
        return "completed"
    by = stopped.get("by")
    if by == "unknown":
        return "before the end of fit (no run_stats.json: killed, or still running)"
    if by == "no training":
        return f"without training: {stopped.get('why')}"
    where = f"at step {fmt(stopped.get('step'))} (epoch {fmt(stopped.get('epoch'))})"
    if by == "trainer.max_time":
        return f"by trainer.max_time {where}"
    hint = str(stopped.get("resume") or "")
    if hint.startswith("resume with: "):
        hint = f"resume with `{hint.removeprefix('resume with: ')}`"
    resume = f"; {hint}" if hint and with_resume else ""
    return f"by {by} {where}{resume}"


def table(
    header: Iterable[str], rows: Iterable[Iterable[Any]], cell: Callable[[Any], str] = fmt
) -> list[str]:
    """A markdown table's lines; `cell` turns each value into its text."""
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    """report.md from the report dict (`vitrain.reporting.report.build_report`, plus its plots)."""
    bs = report["batch_size"]
    procs = report["world_size"]
    layout = (
        f"{procs} process{'es' if procs != 1 else ''} ({report['num_nodes']} node(s) x "
        f"{report['devices_per_node']} device(s))"
        if procs
        else "-"
    )
    search = report["max_batch_size"]
    mfu = fmt(report["mfu"]) if report["mfu"] is not None else f"n/a: {report['mfu_note']}"
    stopped = report.get("stopped") or {}
    lines = [
        f"# Run report: `{Path(report['run_dir']).name}`",
        "",
        *(
            [
                f"**Interrupted**: {_stopped(stopped, with_resume=True)}. Figures cover what ran until then.",
                "",
            ]
            if stopped.get("interrupted")
            else []
        ),
        f"Run dir `{report['run_dir']}`; generated {report['generated']}. "
        "Rebuild with `make report RUN=<run dir>` (`python -m vitrain.reporting <run dir>` once vitrain is "
        "installed).",
        "",
        *table(
            ["", ""],
            [
                ["experiment", report["experiment"]],
                ["overrides", " ".join(f"`{o}`" for o in report["overrides"]) or "-"],
                ["model", report.get("model") or report["config"].get("model.net.model_name")],
                ["stopped", _stopped(report.get("stopped"))],
                ["strategy", f"{fmt(report['strategy'])} on {fmt(report['accelerator'])}, {layout}"],
                ["code", _code(report.get("code"), report.get("software"))],
                ["precision", _precision(report)],
                [
                    "batch size",
                    f"{fmt(bs.get('global'))} global, {fmt(bs.get('per_device'))} per device"
                    f" (accumulate {fmt(bs.get('accumulate_grad_batches'))})",
                ],
                ["data", _data(report.get("data"))],
                ["train images per class", _class_images(report.get("data"))],
                ["skipped files", _skipped(report.get("data"))],
                ["epochs", _epochs(report)],
                [
                    "training wall time",
                    f"{fmt(report['wall_time_s'])} s (fit), {fmt(report['time_per_epoch_s'])} s per epoch",
                ],
                ["throughput", _throughput(report)],
                ["MFU", mfu],
                ["peak memory", f"{fmt(report['peak_memory_gb'])} GB (largest device)"],
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
    lines += table(["metric", "best", "at step", "final"], rows) if rows else ["No validation metrics."]
    lines.append("")
    stopped_test = report.get("test_stopped")
    if not metrics["test"] and stopped_test:
        ckpt = stopped_test.get("ckpt_path") or "<checkpoint>"
        lines.append(
            f"No test metrics: the test was stopped by {stopped_test['stopped_by']}; test the checkpoint with "
            f"`python src/eval.py ckpt_path={ckpt}`."
        )
    elif not metrics["test"]:
        lines.append("No test metrics.")
    else:
        if (report.get("data") or {}).get("test_is_val"):
            lines += [
                "Test metrics on the validation images (the data has no test split): not a held-out estimate, "
                "since the best checkpoint was chosen on them.",
                "",
            ]
        lines += table(["test metric", "value"], sorted(metrics["test"].items()))

    lines += ["", "## Memory (peak per device)", ""]
    memory = report["memory"] or {}
    devices = memory.get("per_device") or []
    if devices:
        keys = [k for k in devices[0] if k != "rank"]
        lines += [f"{memory.get('device_name')}, {memory.get('peak_window')}.", ""]
        lines += table(["rank", *keys], [[d["rank"], *(d.get(k) for k in keys)] for d in devices])
    else:
        lines.append("Not recorded.")

    lines += ["", "## GPU utilisation", ""]
    util = report["gpu_utilization"]
    if util.get("available"):
        lines += table(
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
            *table(
                ["", ""],
                [
                    ["per device", search.get("per_device")],
                    ["global", f"{search.get('global')} ({search.get('world_size')} processes)"],
                    [
                        "searched with",
                        f"{search.get('accelerator')}, {search.get('precision')}, 1 device; "
                        f"strategy of the run: {search.get('strategy')}",
                    ],
                    ["memory cap", f"{fmt(search.get('max_memory_gb'))} GB"],
                    [
                        "trials",
                        ", ".join(
                            f"{t['batch_size']}: {fmt(t.get('peak_gb'))} GB" for t in search.get("trials", [])
                        ),
                    ],
                    ["stopped by", search.get("stopped_by")],
                ],
            ),
        ]

    ckpts = report["checkpoints"] or {}
    lines += ["", "## Checkpoints", ""]
    lines.append(
        (f"- best: `{ckpts['best']}`" if ckpts.get("best") else "- best: none saved")
        + (
            f" ({ckpts.get('monitor')} = {fmt(ckpts.get('best_score'))})"
            if ckpts.get("best_score") is not None
            else ""
        )
    )
    lines.append(f"- last: `{ckpts['last']}`" if ckpts.get("last") else "- last: none saved")
    use = ckpts.get("best") or ckpts.get("last")
    if use:
        lines.append(
            f"- use it: `python src/eval.py ckpt_path={use}` (accuracy per class), "
            f"`python src/predict.py ckpt_path={use} inputs=<photos>` (a CSV of classes), "
            f"`python src/export.py ckpt_path={use}` (a timm model folder)"
        )
    s3 = report["s3"]
    if s3:
        lines += [f"- S3: `{uri}`" for uri in uploaded_checkpoints(s3.get("uploaded", []))]
        lines += [f"- S3 failure: {message}" for message in s3.get("failures", [])]

    plots = report.get("plots") or {}
    if plots:
        lines += ["", "## Curves", "", *(f"![{name}]({path})" for name, path in plots.items())]
    return scrub("\n".join(lines) + "\n")


def _epochs(report: dict[str, Any]) -> str:
    """Epochs trained; for a resumed run, where this session started: times and images/s are its own."""
    resumed = report.get("resumed_at")
    if not resumed:
        return fmt(report["epochs"])
    return (
        f"{fmt(report['epochs'])} (resumed at epoch {resumed['epoch']}, step {resumed['step']}: wall time and "
        "images/s cover the resumed session; the metrics cover the whole run)"
    )


def _throughput(report: dict[str, Any]) -> str:
    """Steady state (the throughput monitor's last window) first; the average over all training batches,
    and the first step (torch.compile's compile time, warm-up) apart."""
    steady = report.get("throughput_monitor_images_per_s")
    text = f"{fmt(steady)} images/s steady state (all devices), " if steady else ""
    text += f"{fmt(report['throughput_images_per_s'])} images/s over all training batches"
    if (report.get("config") or {}).get("model.progressive_resize.start_size") is not None:
        # the averages count the cheaper early steps at smaller sizes; the window is the run's last steps
        text += " (progressive resizing: the early steps trained smaller images, faster)"
    if report.get("first_step_s") is not None:
        text += f"; first step {fmt(report['first_step_s'])} s (compile, warm-up)"
        if report.get("images_per_s_after_first_step"):
            text += f", {fmt(report['images_per_s_after_first_step'])} images/s after it"
    return text


def uploaded_checkpoints(uris: list[str]) -> list[str]:
    """The checkpoints among uploaded URIs, as `ckpt_path` takes them: a sharded checkpoint's files (its
    save's subfolder, its manifest) as the folder's one URI."""
    found = []
    for uri in uris:
        head, sep, tail = uri.rpartition("/checkpoints/")
        if sep and tail:
            found.append(f"{head}{sep}{tail.split('/', 1)[0]}")
    return list(dict.fromkeys(found))
