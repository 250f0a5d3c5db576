"""Which checkpoint a training run continues from: never a silent fresh start.

Lightning's `ckpt_path="last"` looks only in this run's checkpoint folder and, finding nothing, warns (with
a hint that is wrong for this template) and trains from scratch. Here:

- `ckpt_path=last` must resume: this run's `last`, or (run dir named by time) the newest run of the same
  experiment, or the run's `last` in the S3 bucket; otherwise one line naming the runs that can be resumed.
- `resume=auto` (default): a relaunch of the same job (SLURM requeue, torchrun restart, the same
  VITRAIN_RUN_ID) continues from this run's `last` when there is one, and starts when there is none,
  like NeMo's `resume_if_exists`. `resume=never` always starts anew.
- `ckpt_path=s3://...` is downloaded once into the cache and verified against its recorded sha256.
"""

import logging
import os
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from vitrain.errors import UserError
from vitrain.utils.run_id import experiment_digest, stable_run_id

log = logging.getLogger(__name__)

LAST = "last.ckpt"
# set by global rank zero before fit: the processes Lightning's launcher starts follow its decision
DECIDED_ENV = "VITRAIN_RESUME_FROM"
RESUME_MODES = ("auto", "never")


class ResumeError(UserError):
    """`ckpt_path=last` with nothing to resume from."""


def last_in(folder: Path) -> Path | None:
    """`folder/last.ckpt` when it is a whole checkpoint: a file, or a sharded folder with its `.metadata`."""
    path = folder / LAST
    if path.is_file() or (path / ".metadata").is_file():
        return path
    return None


def resumable_runs(runs_root: Path) -> list[Path]:
    """Run directories under `runs_root` with a `checkpoints/last.ckpt`, newest checkpoint first."""
    if not runs_root.is_dir():
        return []
    found = [
        (last.stat().st_mtime, run) for run in runs_root.iterdir() if (last := last_in(run / "checkpoints"))
    ]
    return [run for _, run in sorted(found, reverse=True)]


def run_digest(run: Path) -> str | None:
    """The experiment digest of a run, from the overrides Hydra stored in its `.hydra/overrides.yaml`."""
    overrides = run / ".hydra" / "overrides.yaml"
    if not overrides.is_file():
        return None
    try:
        return experiment_digest([str(o) for o in OmegaConf.load(overrides)])
    except Exception:  # a damaged file makes the run unmatchable, not the resume impossible
        return None


def newest_resumable_run(runs_root: Path, task_overrides: Sequence[str]) -> Path:
    """The newest run under `runs_root` launched with the same run-defining overrides, with a `last`."""
    digest = experiment_digest(task_overrides)
    runs = resumable_runs(runs_root)
    for run in runs:
        if run_digest(run) == digest:
            log.info("ckpt_path=last: resuming %s (the newest run of these overrides)", run)
            return run
    raise ResumeError(nothing_to_resume(runs_root, runs, "no run with these overrides"))


def nothing_to_resume(runs_root: Path, runs: list[Path], why: str) -> str:
    listed = ", ".join(run.name for run in runs[:5]) + (", ..." if len(runs) > 5 else "")
    choices = f"resumable runs in {runs_root}: {listed}" if runs else f"no resumable run in {runs_root}"
    return (
        f"ckpt_path=last: {why} has a checkpoints/{LAST} ({choices}); pick one with "
        f"hydra.run.dir={runs_root}/<run> or VITRAIN_RUN_ID=<run>, or leave out ckpt_path=last to start anew"
    )


def checkpoint_to_resume(cfg: DictConfig, trainer: L.Trainer) -> str | None:
    """The checkpoint `trainer.fit` starts from (a local path), or None to start from scratch."""
    if DECIDED_ENV in os.environ:  # a process started by global rank zero's launcher: same decision
        return os.environ[DECIDED_ENV] or None
    ckpt_path = cfg.get("ckpt_path")
    mode = str(cfg.get("resume") or "auto")
    if mode not in RESUME_MODES:
        raise UserError(f"resume={mode}: choose one of {', '.join(RESUME_MODES)}")
    if ckpt_path and ckpt_path != "last":
        from vitrain import checkpoints

        return str(checkpoints.resolve(str(ckpt_path), cfg.paths.cache_dir))
    if ckpt_path != "last" and (mode == "never" or stable_run_id() is None):
        return None  # a new run (its name is new): nothing of it can exist yet
    last = _local_last(trainer) or _s3_last(cfg, trainer)
    if last is not None:
        log.info("Resuming from %s%s", last, "" if ckpt_path == "last" else " (resume=auto: a relaunch)")
        return str(last)
    if ckpt_path == "last":
        runs_root = Path(cfg.paths.log_dir) / str(cfg.task_name) / "runs"
        raise ResumeError(
            nothing_to_resume(runs_root, resumable_runs(runs_root), f"{cfg.paths.output_dir} no")
        )
    return None


def _checkpoint_dirs(trainer: L.Trainer) -> list[Path]:
    return [
        Path(c.dirpath) for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.dirpath
    ]


def _local_last(trainer: L.Trainer) -> Path | None:
    found = [last for folder in _checkpoint_dirs(trainer) if (last := last_in(folder))]
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


def _s3_last(cfg: DictConfig, trainer: L.Trainer) -> Path | None:
    """This run's `last` in the bucket of the S3 upload callback (a new machine with an empty disk)."""
    from vitrain.callbacks.s3_upload import S3CheckpointUpload

    upload: Any = next((c for c in trainer.callbacks if isinstance(c, S3CheckpointUpload)), None)
    if upload is None or not upload.bucket:
        return None
    from vitrain.s3.errors import S3ObjectNotFound
    from vitrain.s3.store import S3Store

    uri = upload.run_uri(trainer).child("checkpoints", LAST)
    try:
        path = S3Store(upload.options).fetch(uri, Path(cfg.paths.cache_dir) / "s3")
    except S3ObjectNotFound:
        log.info("S3: no %s yet: nothing to resume", uri)
        return None
    log.info("Resuming from %s (downloaded from %s)", path, uri)
    return path


def resume_hint(
    run_config: dict[str, Any] | None, output_dir: str | Path, script: str = "src/train.py"
) -> str:
    """What resumes this run, exactly: "relaunch the same command" only where that is true (a stable run id
    with resume=auto and no explicit checkpoint to start from), else the command line with
    `ckpt_path=last` and this run's directory."""
    run_config = run_config or {}
    ckpt_path = run_config.get("ckpt_path")
    name = stable_run_id()
    if name is not None and str(run_config.get("resume") or "auto") == "auto" and ckpt_path in (None, "last"):
        return f"relaunch the same command to resume (run id {name}; resume=auto continues from its last)"
    kept = [
        o
        for o in _task_overrides()
        if not o.split("=", 1)[0].lstrip("+~").startswith(("ckpt_path", "hydra."))
    ]
    command = ["python", script, *kept, "ckpt_path=last", f"hydra.run.dir={output_dir}"]
    return "resume with: " + " ".join(shlex.quote(part) for part in command)


def _task_overrides() -> list[str]:
    """The command line's overrides of this run (Hydra's `overrides.task`); none outside a Hydra app."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    return [str(o) for o in HydraConfig.get().overrides.task]
