"""Reading checkpoints for evaluation: a Lightning file, a sharded (FSDP) folder, or an s3:// URI."""

import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.load import _load_distributed_checkpoint

from vitrain.errors import UserError


class CheckpointError(UserError):
    """A checkpoint that does not exist, cannot be read, or does not fit the model."""


def resolve(ckpt_path: str, cache_dir: str | Path) -> Path:
    """A local path for `ckpt_path`, downloading (and verifying) s3:// URIs into the cache."""
    if ckpt_path.startswith("s3://"):
        from vitrain.s3 import fetch_checkpoint  # boto3 only when needed

        return fetch_checkpoint(ckpt_path, Path(cache_dir) / "s3")
    path = Path(ckpt_path).expanduser()
    if not path.exists():
        raise CheckpointError(f"ckpt_path={ckpt_path} does not exist")
    return path


def load(path: Path) -> dict[str, Any]:
    """The whole checkpoint as one dict on CPU; a sharded folder is consolidated in memory.

    Lightning's `consolidate_checkpoint` CLI fails on ModelParallelStrategy folders (KeyError 'model':
    the weights are under 'state_dict'), so we use the fabric loader it is built on.
    """
    try:
        if path.is_dir():
            if not (path / ".metadata").is_file():
                raise CheckpointError(f"{path} is a folder but not a sharded checkpoint (no .metadata file)")
            return _load_distributed_checkpoint(path)
        # weights_only=False: our checkpoints hold the optimizer/scheduler partials of the model's hparams
        return torch.load(path, map_location="cpu", weights_only=False)
    except CheckpointError:
        raise
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as err:
        raise CheckpointError(
            f"checkpoint {path} is truncated or corrupted ({type(err).__name__}): use another checkpoint"
        ) from err
