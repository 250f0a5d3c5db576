"""Which process this is, known before Lightning sets up the process group.

Lightning computes `rank_zero_only.rank` at import from RANK / LOCAL_RANK / SLURM_PROCID. A process started
by hand on node 1 (NODE_RANK=1, no RANK) therefore believes it is rank zero until the trainer connects, and
prints the config tree and writes rank-zero files a second time. `setup_rank` fixes the rank from the launch
environment at start-up and tags every log record of the other ranks with their rank.
"""

import errno
import logging
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any

from vitrain.errors import UserError

# torch and Lightning are imported where needed: the run-dir resolver and the entry points' override
# check use this module before them, so a config mistake ends in a second instead of after their imports


class LaunchError(UserError):
    """The launch environment (NODE_RANK, WORLD_SIZE, MASTER_PORT) contradicts the trainer config."""


log = logging.getLogger(__name__)


def devices_per_node(devices: Any, accelerator: str | None = "auto") -> int:
    """Processes per node that `Trainer(devices=..., accelerator=...)` will start."""
    if isinstance(devices, int) and devices > 0:
        return devices
    if isinstance(devices, Sequence) and not isinstance(devices, str):
        return len(devices)
    text = str(devices).strip()
    if text.isdigit() and int(text) > 0:
        return int(text)
    if "," in text:  # "0,1,3": a list of device indices
        return len([d for d in text.split(",") if d.strip()])
    # "auto" or -1: every GPU of the node, one process on CPU
    import torch

    if accelerator != "cpu" and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 1


def global_rank_from_env(num_devices: int = 1, env: Mapping[str, str] = os.environ) -> int:
    """The global rank the launcher gave this process: torchrun's RANK, NODE_RANK x devices + LOCAL_RANK for
    Lightning's own launcher (env-var multi-node), srun's SLURM_PROCID; 0 for a plain single process."""
    if "RANK" in env:
        return int(env["RANK"])
    node_rank = env.get("NODE_RANK", env.get("GROUP_RANK"))
    if node_rank is not None:
        return int(node_rank) * num_devices + int(env.get("LOCAL_RANK", 0))
    # LOCAL_RANK before SLURM_PROCID: SLURM_PROCID is also set in an allocation that Lightning does not manage
    if "LOCAL_RANK" in env:
        return int(env["LOCAL_RANK"])
    return int(env.get("SLURM_PROCID", 0))


def is_global_zero_from_env(env: Mapping[str, str] = os.environ) -> bool:
    """Global rank zero, without knowing the devices per node (rank 0 is node 0's local rank 0 anyway)."""
    return global_rank_from_env(1, env) == 0


def check_launch_env(trainer_cfg: Mapping[str, Any] | None, env: Mapping[str, str] = os.environ) -> None:
    """Fail in one line, before any process group exists, on launch variables that cannot work.

    Left alone, a NODE_RANK past the last node or a WORLD_SIZE that disagrees with the trainer makes every
    node wait for peers that never come; a taken MASTER_PORT ends in a traceback from the TCP store.
    """
    trainer_cfg = trainer_cfg or {}
    num_nodes = int(trainer_cfg.get("num_nodes", 1) or 1)
    devices = devices_per_node(trainer_cfg.get("devices", 1), trainer_cfg.get("accelerator", "auto"))
    if _slurm_manages_tasks(env) and int(env["SLURM_NTASKS"]) != num_nodes * devices:
        # Lightning would say it in a traceback, and only after building the model
        raise LaunchError(
            f"SLURM started SLURM_NTASKS={env['SLURM_NTASKS']} tasks but trainer.num_nodes x trainer.devices = "
            f"{num_nodes} x {devices} = {num_nodes * devices}: one task per device, e.g. "
            "trainer.devices=$SLURM_NTASKS_PER_NODE trainer.num_nodes=$SLURM_NNODES (scripts/slurm/)"
        )
    if "TORCHELASTIC_RUN_ID" in env or "SLURM_JOB_ID" in env:
        return  # torchrun / srun own these variables and check them themselves
    if "NODE_RANK" in env:
        node_rank = int(env["NODE_RANK"])
        if not 0 <= node_rank < num_nodes:
            raise LaunchError(
                f"NODE_RANK={node_rank} with trainer.num_nodes={num_nodes}: number the nodes 0..{num_nodes - 1}"
            )
    world = num_nodes * devices
    if "WORLD_SIZE" in env and "LOCAL_RANK" not in env and int(env["WORLD_SIZE"]) != world:
        raise LaunchError(
            f"WORLD_SIZE={env['WORLD_SIZE']} but trainer.num_nodes x trainer.devices = {num_nodes} x {devices}"
            f" = {world}: set WORLD_SIZE={world} or change trainer.num_nodes / trainer.devices"
        )
    if (
        world > 1
        and "MASTER_PORT" in env
        and global_rank_from_env(devices, env) == 0
        and "LOCAL_RANK" not in env
    ):
        _check_port_free(int(env["MASTER_PORT"]))


def _slurm_manages_tasks(env: Mapping[str, str]) -> bool:
    """Lightning's `SLURMEnvironment.detect()`, on `env`: srun started the processes (not an interactive shell)."""
    return "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive")


def _check_port_free(port: int) -> None:
    """Rank zero will listen on MASTER_PORT: is it free on this machine?"""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("", port))
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                raise
            raise LaunchError(
                f"MASTER_PORT={port} is in use on this machine (node 0): pick a free port, the same on every "
                "node, or stop the process that holds it"
            ) from err


def setup_rank(trainer_cfg: Mapping[str, Any] | None = None) -> int:
    """Set Lightning's rank-zero guard from the launch environment and prefix other ranks' log records.

    Lightning overwrites the guard with the same value once the trainer has connected.
    """
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    trainer_cfg = trainer_cfg or {}
    num_devices = devices_per_node(trainer_cfg.get("devices", 1), trainer_cfg.get("accelerator", "auto"))
    rank_zero_only.rank = global_rank_from_env(num_devices)
    install_rank_prefix()
    return rank_zero_only.rank


def install_rank_prefix() -> None:
    """Every log record of a rank other than zero starts with `[rank: N]` (Lightning's own style), whatever
    handler writes it: Hydra's console and file handlers, Lightning's stream handler, later ones too."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    previous = logging.getLogRecordFactory()
    if getattr(previous, "adds_rank", False):
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        rank = rank_zero_only.rank
        if rank and not str(record.msg).startswith("[rank"):
            record.msg = f"[rank: {rank}] {record.msg}"
        return record

    factory.adds_rank = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)
