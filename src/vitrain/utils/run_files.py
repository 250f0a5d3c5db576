"""The files of a run dir the report reads and writes, and how (no torch: the report CLI runs without it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from vitrain.utils.atomic import write_atomic

STATS_FILE = "run_stats.json"  # written by callbacks.run_stats.RunStats
METRICS_FILE = "metrics.jsonl"  # written by vitrain.loggers.MetricRecord
LOGGER_RUNS_FILE = "logger_runs.json"  # the W&B / MLflow runs a resume continues (vitrain.loggers)
SEARCH_FILE = "batch_size_search.json"  # written by vitrain.tasks.tuning (`+tune=batch_size`)
EVAL_METRICS = (
    "metrics.json"  # written by src/eval.py and src/predict.py (vitrain.tasks.evaluation, .prediction)
)
REPORT_JSON = "report.json"
REPORT_MD = "report.md"
PLOTS_DIR = "plots"

Scalars = dict[str, list[tuple[int, float]]]

# resolved config entries worth repeating in the report (dotted paths)
CONFIG_KEYS = (
    "model.net.model_name",
    "model.net.pretrained",
    "model.net.img_size",
    "model.net.patch_size",
    "model.optimizer.lr",
    "model.optimizer.weight_decay",
    "model.label_smoothing",
    "model.progressive_resize.start_size",  # set: early steps trained smaller (the report's throughput says so)
    "datamodule.batch_size",
    "datamodule.train_subset",
    "datamodule.test_subset",
    "trainer.max_epochs",
    "trainer.max_steps",
    "trainer.limit_train_batches",  # with max_epochs and max_steps: 0 trains no step (the report says so)
    "trainer.max_time",
    "trainer.precision",  # as asked (`auto`); the top-level `precision` is what it resolved to
    "seed",
    "tags",
    "train",  # false: a run that only tests a checkpoint or searches a batch size (its report says so)
    "test",
)


def select_key(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


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


def has_metrics(run_dir: Path) -> bool:
    return (Path(run_dir) / METRICS_FILE).is_file()


def read_scalars(run_dir: Path) -> Scalars:
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
