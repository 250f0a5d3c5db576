"""The files of a run dir the report reads and writes, and how (no torch: the report CLI runs without it)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import yaml

from vitrain.utils.atomic import write_atomic

STATS_FILE = "run_stats.json"  # written by reporting.run_stats.RunStats
SEARCH_FILE = "batch_size_search.json"  # written by vitrain.tuning (`+tune=batch_size`)
REPORT_JSON = "report.json"
REPORT_MD = "report.md"
PLOTS_DIR = "plots"
EVENTS_GLOB = "events.out.tfevents.*"

Scalars = dict[str, list[tuple[int, float]]]


def read_json(path: Path) -> dict[str, Any] | None:
    """The file's JSON, or None when it is missing or unreadable (a run that stopped half-way)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def to_json(data: Any) -> str:
    return json.dumps(data, indent=2, default=str) + "\n"


def write_json(path: Path, data: Any) -> Path:
    return write_atomic(path, to_json(data))


def has_events(run_dir: Path) -> bool:
    return any(Path(run_dir).rglob(EVENTS_GLOB))


def read_scalars(run_dir: Path) -> Scalars:
    """Every scalar of the run's TensorBoard event files: tag -> [(step, value)], by step, last write wins
    (a resumed run logs some steps twice)."""
    dirs = sorted({p.parent for p in Path(run_dir).rglob(EVENTS_GLOB)})
    if not dirs:
        return {}
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    logging.getLogger("tensorboard").setLevel(logging.WARNING)  # one INFO line per event file otherwise
    merged: dict[str, dict[int, float]] = {}
    for directory in dirs:
        acc = EventAccumulator(str(directory), size_guidance={SCALARS: 0})  # 0: keep every point
        acc.Reload()
        for tag in acc.Tags()[SCALARS]:
            series = merged.setdefault(tag, {})
            for event in acc.Scalars(tag):
                series[event.step] = event.value
    return {tag: sorted(points.items()) for tag, points in merged.items()}


def read_overrides(run_dir: Path) -> list[str] | None:
    """The command-line overrides Hydra saved in the run dir's `.hydra/overrides.yaml`."""
    path = Path(run_dir) / ".hydra" / "overrides.yaml"
    return list(yaml.safe_load(path.read_text()) or []) if path.is_file() else None


def read_hydra(run_dir: Path) -> dict[str, Any] | None:
    """Overrides and config-group choices from the `.hydra/` folder Hydra wrote into the run dir."""
    overrides = read_overrides(run_dir)
    if overrides is None:
        return None
    choices: dict[str, Any] = {}
    hydra_yaml = Path(run_dir) / ".hydra" / "hydra.yaml"
    if hydra_yaml.is_file():
        runtime = (yaml.safe_load(hydra_yaml.read_text()) or {}).get("hydra", {})
        choices = {
            k: v
            for k, v in (runtime.get("runtime", {}).get("choices") or {}).items()
            if not k.startswith("hydra/")
        }
    return {"overrides": overrides, "choices": choices}
