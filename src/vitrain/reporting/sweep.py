"""The summary of a sweep (`python src/train.py -m ...`): one row per job, `summary.md` and `summary.csv`
in the sweep dir, read from each job's report.json; of an evaluation sweep (`src/eval.py -m
ckpt_path=a,b`, `split=val,test`, `src/predict.py -m ...`), from each job's metrics.json: its accuracy.

`SweepSummary` is a Hydra callback (configs/hydra/default.yaml). It rewrites the summary after every job,
so a sweep that stops half-way (Hydra skips `on_multirun_end` when a job fails) still has one listing
the jobs done so far and the ones without a report, and once more at the end.
"""

from __future__ import annotations

import csv
import io
import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from vitrain.reporting.markdown import table
from vitrain.utils.atomic import write_atomic
from vitrain.utils.run_files import (
    EVAL_METRICS,
    REPORT_JSON,
    REPORT_MD,
    STATS_FILE,
    read_json,
    read_overrides,
)

log = logging.getLogger(__name__)

# column -> how to read it from a report.json
COLUMNS: dict[str, Any] = {
    "job": None,
    "status": None,
    "overrides": None,
    "global_batch": lambda r: r["batch_size"].get("global"),
    "per_device_batch": lambda r: r["batch_size"].get("per_device"),
    "world_size": lambda r: r.get("world_size"),
    "images_per_s": lambda r: r.get("throughput_images_per_s"),
    "peak_memory_gb_per_device": lambda r: _memory(r),
    "time_per_epoch_s": lambda r: r.get("time_per_epoch_s"),
    "epochs": lambda r: r.get("epochs"),
    "best_val_acc1": lambda r: r["metrics"]["best"].get("val/acc1", {}).get("value"),
    "test_acc1": lambda r: r["metrics"]["test"].get("test/acc1"),
    # the images test_acc1 is on: val where the data has no test split (an image folder or shards without test/)
    "test_split": lambda r: (
        ("val" if (r.get("data") or {}).get("test_is_val") else "test") if r["metrics"]["test"] else None
    ),
    "max_batch_size": lambda r: (r.get("max_batch_size") or {}).get("global"),
    "report": None,
    "dir": None,
}


def _split(metrics: dict[str, Any]) -> str:
    """eval.py's split (and the images it was on, where the data has no such split); predict.py's files."""
    split = metrics.get("split")
    if split is None:
        return "files"
    images_of = metrics.get("images_of_split") or split
    return split if images_of == split else f"{split} (the {images_of} images)"


def _score(name: str) -> Any:
    """eval.py's `<split>/<name>`, predict.py's `<name>` (of files labelled by their class folders)."""
    return lambda m: m.get(f"{m['split']}/{name}" if m.get("split") else name)


# an evaluation sweep's columns: column -> how to read it from a job's metrics.json
EVAL_COLUMNS: dict[str, Any] = {
    "job": None,
    "status": None,
    "overrides": None,
    "split": _split,
    "images": lambda m: m.get("images") or sum((m.get("per_class_images") or {}).values()) or None,
    "acc1": _score("acc1"),
    "acc5": _score("acc5"),
    "loss": _score("loss"),
    "metrics": None,
    "dir": None,
}


def _memory(report: dict[str, Any]) -> str | None:
    memory = report.get("memory") or {}
    key = "max_reserved_gb" if memory.get("device_type") == "cuda" else "peak_rss_gb"
    values = [d.get(key) for d in memory.get("per_device") or []]
    return " / ".join(f"{v:.2f}" for v in values if v is not None) or None


def job_dirs(sweep_dir: Path) -> list[Path]:
    """The job dirs of a sweep (Hydra's `.hydra/` or our report inside), in job order."""
    found = [
        p
        for p in Path(sweep_dir).iterdir()
        if p.is_dir() and any((p / name).exists() for name in (".hydra", REPORT_JSON, STATS_FILE))
    ]
    return sorted(found, key=lambda p: (0, int(p.name), "") if p.name.isdigit() else (1, 0, p.name))


def evaluates(jobs: list[Path]) -> bool:
    """A sweep of src/eval.py or src/predict.py: its jobs write metrics.json, none a training report."""
    if any((job / REPORT_JSON).is_file() or (job / STATS_FILE).is_file() for job in jobs):
        return False
    return any((job / name).is_file() for job in jobs for name in (EVAL_METRICS, "eval.log", "predict.log"))


def summary_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job, with the columns of its kind of sweep (`COLUMNS`, or `EVAL_COLUMNS` where `evaluates`)."""
    rows = []
    found = job_dirs(sweep_dir)
    # the columns, the file each job's row is read from, and the column linking the job's own page
    columns, results, link = COLUMNS, REPORT_JSON, {"report": REPORT_MD}
    if evaluates(found):
        columns, results, link = EVAL_COLUMNS, EVAL_METRICS, {"metrics": EVAL_METRICS}
    jobs = [(job, read_json(job / results)) for job in found]
    overrides = {
        job: list(report["overrides"]) if report and "overrides" in report else read_overrides(job) or []
        for job, report in jobs
    }
    shared = set.intersection(*(set(o) for o in overrides.values())) if overrides else set()
    for job, report in jobs:
        row: dict[str, Any] = dict.fromkeys(columns)
        row.update(
            job=job.name,
            dir=str(job.resolve()),
            overrides=" ".join(o for o in overrides[job] if o not in shared),
        )
        if report is None:
            row["status"] = f"no {results} (failed or running)"
        else:
            row.update(status="done", **{column: f"{job.name}/{name}" for column, name in link.items()})
            for column, read in columns.items():
                if read is not None:
                    try:
                        row[column] = read(report)
                    except (KeyError, TypeError, AttributeError):
                        row[column] = None
        rows.append(row)
    return rows


def _cell(value: Any) -> str:
    """A summary cell: empty when unknown (also in the CSV), 4 significant digits for floats."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def render_summary(sweep_dir: Path, rows: list[dict[str, Any]]) -> str:
    header = [c for c in (rows[0] if rows else COLUMNS) if c != "dir"]

    def cells(row: dict[str, Any]) -> list[str]:
        out = [_cell(row[c]) for c in header]
        return [
            f"[{text}]({text})"
            if name in ("report", "metrics") and text
            else f"`{text}`"
            if name == "overrides" and text
            else text
            for name, text in zip(header, out, strict=True)
        ]

    about = (
        "Each job's accuracy on its split (eval.py) or on the files labelled by their class folders (predict.py)."
        if "metrics" in header
        else "Images/s count training batches of all devices; peak memory is per device (GPU: reserved; CPU: "
        "peak RSS of each process)."
    )
    lines = [
        f"# Sweep summary: `{Path(sweep_dir).name}`",
        "",
        f"Sweep dir `{Path(sweep_dir).resolve()}`: {len(rows)} job(s). {about}",
        "",
        *table(header, (cells(row) for row in rows), cell=str),
    ]
    return "\n".join(lines) + "\n"


def write_summary(sweep_dir: str | Path) -> list[Path]:
    """summary.md and summary.csv in `sweep_dir`; each is replaced whole (parallel launchers)."""
    sweep_dir = Path(sweep_dir)
    rows = summary_rows(sweep_dir)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0] if rows else COLUMNS))
    writer.writeheader()
    writer.writerows({k: _cell(v) for k, v in row.items()} for row in rows)
    return [
        write_atomic(sweep_dir / "summary.md", render_summary(sweep_dir, rows)),
        write_atomic(sweep_dir / "summary.csv", buffer.getvalue()),
    ]


class SweepSummary(Callback):
    """Hydra callback: the sweep's summary after each job and at the end of the sweep."""

    def _write(self, config: DictConfig) -> None:
        # imported here: it loads torch, which `python -m vitrain.reporting` does without
        from vitrain.distributed.ranks import is_global_zero_from_env

        if config.hydra.mode != RunMode.MULTIRUN or not is_global_zero_from_env():
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        try:
            paths = write_summary(sweep_dir)
            log.info("Sweep summary: %s", paths[0])
        except Exception:
            log.exception("Writing the sweep summary failed")

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        self._write(config)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._write(config)
