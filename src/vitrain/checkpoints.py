"""Writing checkpoints atomically, and reading them back: a file or a sharded (FSDP) folder (which checkpoint, local
or s3://, is vitrain/tasks/runs.py's question)."""

import errno
import io
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from vitrain.compat import META_FILENAME, load_dcp_folder
from vitrain.errors import UserError
from vitrain.utils.atomic import write_atomic


class CheckpointError(UserError):
    """A checkpoint that does not exist, cannot be read, or does not fit the model."""


NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
READ_ERRORS = (RuntimeError, EOFError, OSError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes a checkpoint next to its target, fsyncs it, then renames it over the target (`write_atomic`).

    Lightning's own save goes through an fsspec transaction whose temporary file lives in the system temp
    dir: when that is another filesystem (a tmpfs, a container layer) the final move is a copy, and a
    process killed during it leaves a truncated `last.ckpt` where a good one was. A rename within one
    directory is atomic: readers see the old file or the new one, never half of one.
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        target = Path(path)
        buffer = io.BytesIO()  # serialised first, as Lightning does: a failed write then raises OSError
        torch.save(checkpoint, buffer)  # with its errno, not the zip writer's bare RuntimeError
        try:
            write_atomic(target, buffer.getbuffer(), durable=True)
        except OSError as err:
            if err.errno in NO_SPACE:
                kept = " (the previous one is intact)" if target.exists() else ""
                raise CheckpointError(
                    f"no space left to save checkpoint {target}{kept}: free disk space or point "
                    "callbacks.model_checkpoint.dirpath at a larger disk"
                ) from err
            raise

    def load_checkpoint(self, path: Any, map_location: Any = "cpu", weights_only: bool | None = None) -> dict:
        """Lightning's load to the CPU, with a one-line error naming the file when it is missing or damaged.

        To the CPU (Lightning's own default), never where the tensors were saved: rank 0's `cuda:0` tensors
        would land on GPU 0 in every process (N copies of weights and optimizer state there), and a
        checkpoint written on GPUs could not resume on a machine without one. The strategy moves the
        restored state to each rank's device."""
        if not Path(path).exists():
            raise CheckpointError(f"ckpt_path={path} does not exist")
        try:
            return super().load_checkpoint(
                path, map_location=map_location or "cpu", weights_only=weights_only
            )
        except READ_ERRORS as err:
            raise _damaged(Path(path), err) from err


def load(path: Path) -> dict[str, Any]:
    """The whole checkpoint as one dict on CPU; a sharded folder is consolidated in memory.

    Lightning's `consolidate_checkpoint` CLI fails on ModelParallelStrategy folders (KeyError 'model':
    the weights are under 'state_dict'), so we read the folder as the fabric loader under it does.
    """
    try:
        if path.is_dir():
            if not (path / ".metadata").is_file():
                raise CheckpointError(f"{path} is a folder but not a sharded checkpoint (no .metadata file)")
            return _load_sharded(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except READ_ERRORS as err:
        raise _damaged(path, err) from err


def _load_sharded(folder: Path) -> dict[str, Any]:
    """The folder as Lightning's `_load_distributed_checkpoint` reads it, in one process: the shards, then
    meta.pt (plain data: weights_only=True)."""
    checkpoint = load_dcp_folder(folder)
    meta = folder / META_FILENAME
    if meta.is_file():
        checkpoint.update(torch.load(meta, map_location="cpu", weights_only=True))
    return checkpoint


# where classes that checkpoints name by path (the `_target_`s of their saved `run_config`) lived before
# (issue 32 moved them): old prefix -> new prefix; vitrain/tasks/evaluation.py rebuilds a run from them
MOVED_TARGETS = {
    "vitrain.data.cifar10.": "vitrain.data.datamodules.cifar.",
    "vitrain.data.image_folder.": "vitrain.data.datamodules.image_folder.",
    "vitrain.data.streaming.": "vitrain.data.datamodules.streaming.",
    "vitrain.reporting.run_stats.": "vitrain.callbacks.run_stats.",
}


def current_targets(node: Any) -> Any:
    """`node` (a saved config: dicts and lists) with every `_target_` that names a moved class rewritten to
    where the class lives now; a checkpoint written before a move still rebuilds its run."""
    if isinstance(node, dict):
        out = {key: current_targets(value) for key, value in node.items()}
        target = out.get("_target_")
        if isinstance(target, str):
            for old, new in MOVED_TARGETS.items():
                if target.startswith(old):
                    out["_target_"] = new + target.removeprefix(old)
        return out
    if isinstance(node, list):
        return [current_targets(value) for value in node]
    return node


def state_dict_mismatch(err: BaseException) -> str | None:
    """The first detail of torch's "Error(s) in loading state_dict" (a missing key, a size mismatch), for a
    one-line message; None when `err` is another error."""
    text = str(err)
    if "Error(s) in loading state_dict" not in text:
        return None
    return next((line.strip() for line in text.splitlines()[1:] if line.strip()), text[:200])


def _damaged(path: Path, err: BaseException) -> CheckpointError:
    if "Weights only load failed" in str(err):
        # checkpoints hold plain data only; those of earlier versions pickled config objects
        return CheckpointError(
            f"checkpoint {path} holds Python objects, not only plain data: written by an earlier vitrain "
            "(before plain checkpoints) or by other code; torch.load(weights_only=True) refuses it"
        )
    return CheckpointError(
        f"checkpoint {path} is truncated or corrupted ({type(err).__name__}): use another checkpoint"
    )
