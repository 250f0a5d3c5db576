"""A run's directory and what it resumes from: the whole resume trail, in one module.

**Run ids and run directories** (the `run_dir`, `sweep_dir` and `hydra_output_subdir` resolvers Hydra reads).
The run directory's name, identical on every process and node of one run, and again when it is relaunched.

Hydra resolves `hydra.run.dir` separately in every process it starts in; a plain `${now:...}` differs
between nodes (and between restarts), which splits one run into several directories. In order:

1. VITRAIN_RUN_ID: a name you choose;
2. TORCHELASTIC_RUN_ID (torchrun's `--rdzv-id`), or under SLURM `<job name>-<job id>` (`slurm-<job id>`
   without a job name; array jobs `<job name>-<array job id>_<task id>`): the launcher's id, shared by all
   processes and kept by a requeue;
3. launched by hand on several nodes (MASTER_ADDR, MASTER_PORT and NODE_RANK/RANK set, as in
   `NODE_RANK=1 ... python src/train.py ...`, or torchrun without `--rdzv-id`): derived from the rendezvous
   address and the command line. Every node computes the same name without talking to the others, and
   relaunching the same command after a failure (even with `ckpt_path=last` added) finds the same run dir
   and checkpoints. Overrides that only say where output goes, what to resume from or how long to train
   (`trainer.default_root_dir`, e.g. a `$(date ...)` that differs between nodes, `ckpt_path`, `resume`,
   `hydra.*`, `trainer.max_epochs/max_steps/max_time`) are left out of the name;
4. otherwise (one process, or one node that Lightning's launcher fans out: it hands its run dir to the
   other local ranks as `hydra.run.dir=...`): the start time. Then `ckpt_path=last` cannot find its run by
   name: `run_dir` picks the newest run of the same experiment (same run-defining overrides) that has a
   `last` checkpoint, so the resumed run writes into the run directory it continues.

**What a training run continues from: never a silent fresh start.**

Lightning's `ckpt_path="last"` looks only in this run's checkpoint folder and, finding nothing, warns (with
a hint that is wrong for this template) and trains from scratch. Here:

- `ckpt_path=last` must resume: this run's `last`, or (run dir named by time) the newest run of the same
  experiment, or the run's `last` in the S3 bucket; otherwise one line naming the runs that can be resumed.
- `resume=auto` (default): a relaunch of the same job (SLURM requeue, torchrun restart, the same
  VITRAIN_RUN_ID) continues from this run's `last` when there is one, and starts when there is none,
  like NeMo's `resume_if_exists`. `resume=never` always starts anew.
- `ckpt_path=s3://...` is downloaded once into the cache and verified against its recorded sha256.

Global rank zero decides; the processes Lightning's launcher starts follow its decision (`RESUME_FROM`,
vitrain/tasks/decisions.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shlex
import sys
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from omegaconf import DictConfig, OmegaConf

from vitrain.distributed.ranks import is_global_zero_from_env
from vitrain.errors import UserError
from vitrain.tasks.decisions import RESUME_FROM, decisions

if TYPE_CHECKING:
    import lightning as L

log = logging.getLogger(__name__)


# --- run ids and run directories ------------------------------------------------------------------------

# first set wins: an explicit name, then the launcher's id for this job
RUN_ID_VARS = ("VITRAIN_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")
# overrides that do not change which run this is (prefix match on the key): where output goes, what to
# resume from, and how long to train (a resume that extends a run continues it)
NOT_IN_RUN_ID = (
    "ckpt_path",
    "resume",
    "trainer.default_root_dir",
    "hydra.",
    "trainer.max_epochs",
    "trainer.max_steps",
    "trainer.max_time",
)
# SLURM's job name when none was given to an interactive step: says nothing about the run
_ANONYMOUS_JOB_NAMES = {"", "bash", "sh", "zsh", "interactive", "python", "srun"}


def run_id(env: Mapping[str, str] = os.environ, argv: Sequence[str] | None = None) -> str:
    return stable_run_id(env, argv) or datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


def stable_run_id(env: Mapping[str, str] = os.environ, argv: Sequence[str] | None = None) -> str | None:
    """The run's name when a relaunch of the same job gets it again; None for a one-off run (timestamp)."""
    for var in RUN_ID_VARS:
        value = env.get(var, "")
        if value and value != "none":  # torchrun's default rdzv id is "none"
            return slurm_run_id(env) if var == "SLURM_JOB_ID" else value
    if launched_by_hand(env):
        return rendezvous_run_id(env, sys.argv[1:] if argv is None else argv)
    return None


def slurm_run_id(env: Mapping[str, str]) -> str:
    """`<job name>-<job id>`: readable in `ls`, the same on every task, and kept by `scontrol requeue`."""
    job = env["SLURM_JOB_ID"]
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    name = env.get("SLURM_JOB_NAME", "")
    name = re.sub(r"[^A-Za-z0-9._-]", "_", name.removesuffix(".sbatch").removesuffix(".sh"))
    return f"{'slurm' if name in _ANONYMOUS_JOB_NAMES else name}-{job}"


def launched_by_hand(env: Mapping[str, str] = os.environ) -> bool:
    """Part of a multi-process run whose processes each started Hydra themselves."""
    has_rank = any(var in env for var in ("NODE_RANK", "GROUP_RANK", "RANK"))
    return has_rank and bool(env.get("MASTER_ADDR")) and bool(env.get("MASTER_PORT"))


def rendezvous_run_id(env: Mapping[str, str], argv: Sequence[str]) -> str:
    """`<MASTER_ADDR>-<MASTER_PORT>-<hash of the run-defining overrides>`: readable, and no two runs that
    are alive at the same time can share it (they cannot share a rendezvous address)."""
    address = re.sub(r"[^A-Za-z0-9._-]", "_", f"{env['MASTER_ADDR']}-{env['MASTER_PORT']}")
    return f"{address}-{experiment_digest(argv)}"


def experiment_digest(overrides: Sequence[str]) -> str:
    """What makes two launches the same experiment: the overrides, less where output goes or what to
    resume from."""
    kept = [arg for arg in overrides if not _override_key(arg).startswith(NOT_IN_RUN_ID)]
    return hashlib.sha256("\0".join(kept).encode()).hexdigest()[:8]


def run_dir(runs_root: str, ckpt_path: str | None = None, task_overrides: Sequence[str] = ()) -> str:
    """`hydra.run.dir`: `<runs_root>/<run id>`, or for `ckpt_path=last` without a stable run id the newest
    run of the same experiment that has a `last` checkpoint (vitrain.tasks.runs raises when there is none)."""
    name = stable_run_id()
    if name is None and ckpt_path == "last":
        return str(newest_resumable_run(Path(runs_root), list(task_overrides)))
    if name is None:
        return str(claim_run_dir(Path(runs_root), run_id()))
    return f"{runs_root}/{name}"


def sweep_dir(sweeps_root: str) -> str:
    """`hydra.sweep.dir`: `<sweeps_root>/<run id>`; a sweep named by its start time gets a directory of its own
    as a run does (`claim_run_dir`). Resolved once: Hydra hands the resolved value to every job's config."""
    name = stable_run_id()
    return f"{sweeps_root}/{name}" if name else str(claim_run_dir(Path(sweeps_root), run_id()))


def claim_run_dir(runs_root: Path, stamp: str) -> Path:
    """`<runs_root>/<stamp>`, made now, or `<stamp>_2`, `_3`... when a run started in the same second has it
    (`python src/train.py seed=1 & python src/train.py seed=2`): both wrote into one directory, each
    replacing the other's checkpoints and report. `mkdir` is the claim: of two processes, one gets each."""
    runs_root.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        path = runs_root / (stamp if n == 1 else f"{stamp}_{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"{runs_root}/{stamp}_*: a thousand runs started in the same second")


def _override_key(arg: str) -> str:
    return arg.split("=", 1)[0].lstrip("+~")


def hydra_output_subdir(subdir: str = ".hydra") -> str | None:
    """Hydra's config dump folder on global rank zero, None (no dump) on every other process.

    For `hydra.output_subdir: ${hydra_output_subdir:.hydra}`: processes that started Hydra themselves (other
    nodes, torchrun and srun workers) would otherwise rewrite the same `.hydra/*.yaml` of the shared run dir.
    """
    return subdir if is_global_zero_from_env() else None


def register_resolvers() -> None:
    # cached: resolved once, a timestamp taken (and a time-named directory claimed) once
    if not OmegaConf.has_resolver("run_dir"):
        OmegaConf.register_new_resolver("run_dir", run_dir, use_cache=True)
    if not OmegaConf.has_resolver("sweep_dir"):
        OmegaConf.register_new_resolver("sweep_dir", sweep_dir, use_cache=True)
    if not OmegaConf.has_resolver("hydra_output_subdir"):
        OmegaConf.register_new_resolver("hydra_output_subdir", hydra_output_subdir)


# --- the checkpoint to resume from ----------------------------------------------------------------------


LAST = "last.ckpt"
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


@runtime_checkable
class RemoteCopy(Protocol):
    """Where a run keeps a copy of itself off this machine (the S3 upload callback,
    vitrain/callbacks/s3_upload.py): asked for this run's `last` when the local disk has none, and given the
    report files at the end."""

    def fetch_last(self, trainer: L.Trainer, cache_dir: Path) -> Path | None: ...

    def upload_run_files(self, trainer: L.Trainer | None = None, wait: bool = True) -> list[str]: ...


def checkpoint_to_resume(cfg: DictConfig, trainer: L.Trainer, remote: RemoteCopy | None = None) -> str | None:
    """The checkpoint `trainer.fit` starts from (a local path), or None to start from scratch. Decided by
    global rank zero: a process its launcher started returns the same decision."""
    decided = decisions.get(RESUME_FROM)
    if decided is not None:  # a process started by global rank zero's launcher: same decision
        return decided or None
    ckpt_path = cfg.get("ckpt_path")
    mode = str(cfg.get("resume") or "auto")
    if mode not in RESUME_MODES:
        raise UserError(f"resume={mode}: choose one of {', '.join(RESUME_MODES)}")
    if ckpt_path and ckpt_path != "last":
        return str(resolve_checkpoint(str(ckpt_path), cfg.paths.cache_dir))
    if ckpt_path != "last" and (mode == "never" or stable_run_id() is None):
        return None  # a new run (its name is new): nothing of it can exist yet
    last = _local_last(trainer)
    if last is None and remote is not None:
        last = remote.fetch_last(trainer, Path(cfg.paths.cache_dir) / "s3")
    if last is not None:
        log.info("Resuming from %s%s", last, "" if ckpt_path == "last" else " (resume=auto: a relaunch)")
        return str(last)
    if ckpt_path == "last":
        runs_root = Path(cfg.paths.log_dir) / str(cfg.task_name) / "runs"
        raise ResumeError(
            nothing_to_resume(runs_root, resumable_runs(runs_root), f"{cfg.paths.output_dir} no")
        )
    return None


def resolve_checkpoint(ckpt_path: str, cache_dir: str | Path) -> Path:
    """A local path for `ckpt_path`, downloading (and verifying) s3:// URIs into the cache."""
    if ckpt_path.startswith("s3://"):
        from vitrain.s3.store import fetch_checkpoint  # boto3 only when needed

        return fetch_checkpoint(ckpt_path, Path(cache_dir) / "s3")
    from vitrain.checkpoints import CheckpointError  # torch and Lightning: not before the config is checked

    path = Path(ckpt_path).expanduser()
    if not path.exists():
        raise CheckpointError(f"ckpt_path={ckpt_path} does not exist")
    return path


def configured_last(cfg: DictConfig) -> Path | None:
    """The local `last` checkpoint the run would resume from, read from the config before the trainer exists
    (`checkpoint_to_resume` decides once it does, the same way): for `ckpt_path=last` and a relaunch under
    `resume=auto`, the newest `last` in the checkpoint callbacks' folders. None for any other run, and where
    the run keeps its `last` only off this machine (the S3 copy is asked once the trainer exists)."""
    decided = decisions.get(RESUME_FROM)
    if decided is not None:  # a process started by global rank zero's launcher: what it resumes
        return Path(decided) if decided else None
    ckpt_path = cfg.get("ckpt_path")
    mode = str(cfg.get("resume") or "auto")
    if ckpt_path != "last" and (ckpt_path or mode == "never" or stable_run_id() is None):
        return None
    nodes = (cfg.get("callbacks") or {}).values()
    return newest_last(Path(str(n.dirpath)) for n in nodes if isinstance(n, DictConfig) and n.get("dirpath"))


def newest_last(folders: Iterable[Path]) -> Path | None:
    """The newest whole `last` checkpoint in these folders, if any."""
    found = [last for folder in folders if (last := last_in(folder))]
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


def _checkpoint_dirs(trainer: L.Trainer) -> list[Path]:
    return [Path(c.dirpath) for c in trainer.checkpoint_callbacks if getattr(c, "dirpath", None)]


def _local_last(trainer: L.Trainer) -> Path | None:
    return newest_last(_checkpoint_dirs(trainer))


def resume_hint(
    run_config: Mapping | None, output_dir: str | Path, name: str | None, script: str = "src/train.py"
) -> str:
    """What resumes this run, exactly: "relaunch the same command" only where that is true (`name`, the
    stable run id the launch had, with resume=auto and no explicit checkpoint to start from), else the
    command line with `ckpt_path=last` and this run's directory. `name` is taken at launch: by the time a
    SIGTERM comes, Lightning's launcher has set MASTER_ADDR, MASTER_PORT and NODE_RANK in a plain run's
    process too, which would make it look launched by hand."""
    run_config = run_config or {}
    ckpt_path = run_config.get("ckpt_path")
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
