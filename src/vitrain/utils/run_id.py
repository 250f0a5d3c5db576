"""The run directory's name, identical on every process and node of one run, and again when it is relaunched.

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
"""

import hashlib
import os
import re
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path

from omegaconf import OmegaConf

from vitrain.distributed.ranks import is_global_zero_from_env

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
    run of the same experiment that has a `last` checkpoint (vitrain.resume raises when there is none)."""
    name = stable_run_id()
    if name is None and ckpt_path == "last":
        from vitrain.resume import newest_resumable_run  # here: vitrain.resume imports this module

        return str(newest_resumable_run(Path(runs_root), list(task_overrides)))
    return f"{runs_root}/{name or run_id()}"


def _override_key(arg: str) -> str:
    return arg.split("=", 1)[0].lstrip("+~")


def hydra_output_subdir(subdir: str = ".hydra") -> str | None:
    """Hydra's config dump folder on global rank zero, None (no dump) on every other process.

    For `hydra.output_subdir: ${hydra_output_subdir:.hydra}`: processes that started Hydra themselves (other
    nodes, torchrun and srun workers) would otherwise rewrite the same `.hydra/*.yaml` of the shared run dir.
    """
    return subdir if is_global_zero_from_env() else None


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("run_id"):
        # cached, so the run dir and the sweep dir agree and a timestamp is taken once
        OmegaConf.register_new_resolver("run_id", run_id, use_cache=True)
    if not OmegaConf.has_resolver("run_dir"):
        OmegaConf.register_new_resolver("run_dir", run_dir, use_cache=True)
    if not OmegaConf.has_resolver("hydra_output_subdir"):
        OmegaConf.register_new_resolver("hydra_output_subdir", hydra_output_subdir)
