"""The run directory's name, identical on every process and node of one run, and again when it is relaunched.

Hydra resolves `hydra.run.dir` separately in every process it starts in; a plain `${now:...}` differs
between nodes (and between restarts), which splits one run into several directories. In order:

1. VITRAIN_RUN_ID: a name you choose;
2. TORCHELASTIC_RUN_ID (torchrun's `--rdzv-id`) or SLURM_JOB_ID: the launcher's id, shared by all processes;
3. launched by hand on several nodes (MASTER_ADDR, MASTER_PORT and NODE_RANK/RANK set, as in
   `NODE_RANK=1 ... python src/train.py ...`, or torchrun without `--rdzv-id`): derived from the rendezvous
   address and the command line. Every node computes the same name without talking to the others, and
   relaunching the same command after a failure (even with `ckpt_path=last` added) finds the same run dir
   and checkpoints. Overrides that only say where output goes or what to resume from
   (`trainer.default_root_dir`, e.g. a `$(date ...)` that differs between nodes, `ckpt_path`, `hydra.*`)
   are left out of the name;
4. otherwise (one process, or one node that Lightning's launcher fans out: it hands its run dir to the
   other local ranks as `hydra.run.dir=...`): the start time.
"""

import hashlib
import os
import re
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime

from omegaconf import OmegaConf

from vitrain.distributed.ranks import is_global_zero_from_env

# first set wins: an explicit name, then the launcher's id for this job
RUN_ID_VARS = ("VITRAIN_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")
# overrides that do not change which run this is (prefix match on the key)
NOT_IN_RUN_ID = ("ckpt_path", "trainer.default_root_dir", "hydra.")


def run_id(env: Mapping[str, str] = os.environ, argv: Sequence[str] | None = None) -> str:
    for var in RUN_ID_VARS:
        value = env.get(var, "")
        if value and value != "none":  # torchrun's default rdzv id is "none"
            return value
    if launched_by_hand(env):
        return rendezvous_run_id(env, sys.argv[1:] if argv is None else argv)
    return datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


def launched_by_hand(env: Mapping[str, str] = os.environ) -> bool:
    """Part of a multi-process run whose processes each started Hydra themselves."""
    has_rank = any(var in env for var in ("NODE_RANK", "GROUP_RANK", "RANK"))
    return has_rank and bool(env.get("MASTER_ADDR")) and bool(env.get("MASTER_PORT"))


def rendezvous_run_id(env: Mapping[str, str], argv: Sequence[str]) -> str:
    """`<MASTER_ADDR>-<MASTER_PORT>-<hash of the run-defining overrides>`: readable, and no two runs that
    are alive at the same time can share it (they cannot share a rendezvous address)."""
    kept = [arg for arg in argv if not _override_key(arg).startswith(NOT_IN_RUN_ID)]
    digest = hashlib.sha256("\0".join(kept).encode()).hexdigest()[:8]
    address = re.sub(r"[^A-Za-z0-9._-]", "_", f"{env['MASTER_ADDR']}-{env['MASTER_PORT']}")
    return f"{address}-{digest}"


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
    if not OmegaConf.has_resolver("hydra_output_subdir"):
        OmegaConf.register_new_resolver("hydra_output_subdir", hydra_output_subdir)
