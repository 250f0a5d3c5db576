"""Hydra multirun (`-m`) with Lightning's own multi-process launcher (DDP, FSDP on one node).

Lightning starts local ranks 1..N-1 by re-running the command line (its Hydra command builder). Under `-m`
that command is the whole sweep, so every child would start its own copy of the sweep, in the wrong
directory. And the jobs of a sweep run one after the other in one process, so job 2 inherits what job 1's
launcher left behind: `LOCAL_RANK` in the environment (Lightning then believes an outside launcher made
the processes and waits for ranks nobody starts), `MASTER_PORT`, `WORLD_SIZE`, `OMP_NUM_THREADS`, and an
initialised process group whose other ranks have exited.

`DistributedMultirun`, a Hydra callback (configs/hydra/default.yaml), fixes both:
- each child of a job runs exactly that job: its overrides (for an Optuna trial: the sampled values),
  `hydra.run.dir=<job dir>`, no `-m` and `hydra.mode=RUN` (a search config sets MULTIRUN in the config);
- before every job the launch variables are what they were when the sweep started; after every job the
  process group is destroyed and the job's GPU memory is released.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from vitrain.compat import (
    install_hydra_subprocess_cmd,
    uninstall_hydra_subprocess_cmd,
    upstream_hydra_subprocess_cmd,
)

log = logging.getLogger(__name__)

# what Lightning's launcher, its DDP set-up and seed_everything write into os.environ
LAUNCH_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "NODE_RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "OMP_NUM_THREADS",
    "PL_GLOBAL_SEED",
    "PL_SEED_WORKERS",
)
# command-line flags that say which config to load (kept); every other flag belongs to the sweep
_VALUE_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")
# hydra overrides the child must not inherit from the sweep
_SWEEP_ONLY = ("hydra.mode", "hydra.run.dir", "hydra.output_subdir", "hydra.job.name")


def config_flags(argv: Sequence[str]) -> list[str]:
    """The `--config-path/--config-name/--config-dir` flags of a command line, with their values."""
    kept: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg in _VALUE_FLAGS:
            kept += [arg, next(args, "")]
        elif arg.startswith(tuple(f"{flag}=" for flag in _VALUE_FLAGS)):
            kept.append(arg)
    return kept


def job_command(local_rank: int, argv: Sequence[str] | None = None) -> tuple[list[str], str]:
    """(command, cwd) that starts local rank `local_rank` of the current multirun job."""
    import __main__

    hydra_cfg = HydraConfig.get()
    argv = list(sys.argv if argv is None else argv)
    spec = getattr(__main__, "__spec__", None)
    if spec is None:
        script = argv[0] if os.path.isabs(argv[0]) else os.path.join(hydra_cfg.runtime.cwd, argv[0])
        command = [sys.executable, script]
    else:
        command = [sys.executable, "-m", spec.name]
    hydra_overrides = [o for o in hydra_cfg.overrides.hydra if not o.lstrip("+~").startswith(_SWEEP_ONLY)]
    command += [
        *config_flags(argv[1:]),
        *hydra_cfg.overrides.task,
        *hydra_overrides,
        f'hydra.run.dir="{hydra_cfg.runtime.output_dir}"',
        # a single run even where the config says MULTIRUN (hparams_search=... sets hydra.mode)
        "hydra.mode=RUN",
        f"hydra.job.name=train_ddp_process_{local_rank}",
        "hydra.output_subdir=null",
    ]
    return command, hydra_cfg.runtime.cwd


def _subprocess_cmd(local_rank: int) -> tuple[Sequence[str], str]:
    """Lightning's builder outside a multirun, `job_command` inside one."""
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return job_command(local_rank)
    return upstream_hydra_subprocess_cmd(local_rank)


def install() -> bool:
    """Route Lightning's child-command builder through `_subprocess_cmd`; False if Lightning changed."""
    missing = install_hydra_subprocess_cmd(_subprocess_cmd)
    if missing is not None:
        log.warning("%s has no Hydra command builder: multirun with DDP is not supported here", missing)
        return False
    return True


def uninstall() -> None:
    uninstall_hydra_subprocess_cmd()


class DistributedMultirun(Callback):
    """Hydra callback: every job of a sweep launches its own processes, from a clean slate."""

    def __init__(self) -> None:
        self._env: dict[str, str | None] = {}
        self._threads = torch.get_num_threads()

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # what the user (or a cluster launcher) set stays; what a job's launcher adds is undone
        self._env = {var: os.environ.get(var) for var in LAUNCH_VARS}
        self._threads = torch.get_num_threads()
        install()

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not self._env:  # not a sweep
            return
        install()  # again: a parallel launcher (joblib, submitit) runs jobs in other processes
        for var, value in self._env.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        torch.set_num_threads(self._threads)  # Lightning lowers it per process for N local ranks

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if self._env and torch.distributed.is_available() and torch.distributed.is_initialized():
            # the next job's ranks form a new group; the old one's peers have exited
            torch.distributed.destroy_process_group()
        release_gpu_memory()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        uninstall()


def release_gpu_memory() -> None:
    """Give the finished job's GPU memory back before the next job of the sweep starts in this process.

    Its model, optimizer state and cached blocks stay in PyTorch's caching allocator otherwise: the next
    job sees less free memory (its batch-size search finds a smaller batch) and can run out of memory.
    Reference cycles (trainer <-> module <-> callbacks) need a collection before their tensors are freed.
    """
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
