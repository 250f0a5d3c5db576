"""Which process this is, known before Lightning sets up the process group.

Lightning computes `rank_zero_only.rank` at import from RANK / LOCAL_RANK / SLURM_PROCID. A process started
by hand on node 1 (NODE_RANK=1, no RANK) therefore believes it is rank zero until the trainer connects, and
prints the config tree and writes rank-zero files a second time. `setup_rank` fixes the rank from the launch
environment at start-up and tags every log record of the other ranks with their rank.
"""

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only

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


def setup_rank(trainer_cfg: Mapping[str, Any] | None = None) -> int:
    """Set Lightning's rank-zero guard from the launch environment and prefix other ranks' log records.

    Lightning overwrites the guard with the same value once the trainer has connected.
    """
    trainer_cfg = trainer_cfg or {}
    num_devices = devices_per_node(trainer_cfg.get("devices", 1), trainer_cfg.get("accelerator", "auto"))
    rank_zero_only.rank = global_rank_from_env(num_devices)
    install_rank_prefix()
    return rank_zero_only.rank


def install_rank_prefix() -> None:
    """Every log record of a rank other than zero starts with `[rank: N]` (Lightning's own style), whatever
    handler writes it: Hydra's console and file handlers, Lightning's stream handler, later ones too."""
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
