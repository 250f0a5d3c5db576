"""Writing checkpoints atomically, and reading them back: a file or a sharded (FSDP) folder (which checkpoint, local
or s3://, is vitrain/tasks/runs.py's question)."""

from __future__ import annotations

import errno
import io
import pickle
import zipfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection

from vitrain.compat import META_FILENAME, load_dcp_folder
from vitrain.errors import UserError
from vitrain.utils.atomic import write_atomic

if TYPE_CHECKING:
    import lightning as L


class CheckpointError(UserError):
    """A checkpoint that does not exist, cannot be read, or does not fit the model."""


NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
READ_ERRORS = (RuntimeError, EOFError, OSError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes a checkpoint next to its target, fsyncs it, then renames it over the target (`write_atomic`);
    for a training state on a GPU in a background thread (`background="auto"`), so training does not wait
    for the disk.

    Lightning's own save goes through an fsspec transaction whose temporary file lives in the system temp
    dir: when that is another filesystem (a tmpfs, a container layer) the final move is a copy, and a
    process killed during it leaves a truncated `last.ckpt` where a good one was. A rename within one
    directory is atomic: readers see the old file or the new one, never half of one.

    In the background (`background=True`, or `auto` for a state on a GPU): the caller's thread copies the
    checkpoint's tensors to host memory (a point-in-time snapshot: training may change the weights right
    after) and returns; a worker thread serialises, writes and fsyncs it. A 1 GB checkpoint (ViT-B with
    AdamW) held up the training loop for seconds a save, twice per epoch (best and last), which on a GPU
    is about an epoch of CIFAR-10 (`make bench`, "4c. Checkpoint stall"). Lightning's `AsyncCheckpointIO`
    does the same but snapshots on the device (a second copy of weights and optimizer state in GPU memory)
    and raises a failed write only at the next save. Here:
    - removals (the previous best) queue behind the writes, so a crash never leaves the new best unwritten
      with the old one already gone;
    - loads, `wait()` and teardown wait for the writes, and raise a failed one (`CheckpointError`);
    - at most `max_pending` snapshots wait at a time (host memory: one copy of the state each); a save
      beyond them waits for the oldest.
    """

    def __init__(self, background: bool | str = "auto", max_pending: int = 2) -> None:
        super().__init__()
        if background not in (True, False, "auto"):
            raise UserError(f"AtomicCheckpointIO background={background!r}: choose true, false or auto")
        self.background = background
        self.max_pending = max(1, max_pending)
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[Future[None]] = []  # writes and removals, in order
        self._writes: list[Future[None]] = []  # the writes among them

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if not self.writes_in_background(checkpoint):
            _write(checkpoint, Path(path))
            return
        self._finish_done()  # a write that failed since the last save raises here
        while len(self._writes) >= self.max_pending:  # host memory: one snapshot per queued write
            self._finish(self._pending[0])
        snapshot = apply_to_collection(checkpoint, torch.Tensor, _host_copy)
        self._writes.append(self._submit(_write, snapshot, Path(path)))

    def writes_in_background(self, checkpoint: dict[str, Any]) -> bool:
        """`auto`: where the state lives on an accelerator. There the training thread mostly launches kernels
        and the host's cores are free; a state in host memory is trained by the host's cores, which a
        concurrent write takes from it (on a 2-core CPU the steps ran at a third of their speed meanwhile:
        about as much time lost as the write in place costs, benchmarks 4c)."""
        if self.background != "auto":
            return bool(self.background)
        devices: set[str] = set()
        apply_to_collection(checkpoint, torch.Tensor, lambda t: devices.add(t.device.type))
        return bool(devices - {"cpu"})

    def remove_checkpoint(self, path: Any) -> None:
        self._finish_done()
        if self._pending:  # queued behind the writes it follows
            self._submit(super().remove_checkpoint, path)
        else:
            super().remove_checkpoint(path)

    @property
    def busy(self) -> bool:
        """A queued write or removal is not done yet."""
        return any(not future.done() for future in self._pending)

    def wait(self) -> None:
        """Until every queued write and removal is done; raises the first that failed."""
        while self._pending:
            self._finish(self._pending[0])

    def teardown(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    def _submit(self, fn: Callable[..., None], *args: Any) -> Future[None]:
        if self._executor is None:  # one worker: writes and removals happen in the order they were asked
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-write")
        future = self._executor.submit(fn, *args)
        self._pending.append(future)
        return future

    def _finish(self, future: Future[None]) -> None:
        self._pending.remove(future)
        if future in self._writes:
            self._writes.remove(future)
        future.result()  # a failed write raises here, in the training thread

    def _finish_done(self) -> None:
        for future in [f for f in self._pending if f.done()]:
            self._finish(future)

    def load_checkpoint(self, path: Any, map_location: Any = "cpu", weights_only: bool | None = None) -> dict:
        self.wait()  # a checkpoint this run is still writing (the best, tested right after fit)
        return self._load(path, map_location, weights_only)

    def _load(self, path: Any, map_location: Any, weights_only: bool | None) -> dict:
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


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy in host memory that training can no longer change (a device tensor copied to the CPU)."""
    return tensor.detach().to("cpu", copy=True)


def _write(checkpoint: dict[str, Any], target: Path) -> None:
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


def wait_for_writes(trainer: L.Trainer) -> None:
    """Until the checkpoints the trainer is writing in the background are on disk (a no-op for another IO)."""
    io_plugin = trainer.strategy.checkpoint_io
    if isinstance(io_plugin, AtomicCheckpointIO):
        io_plugin.wait()


def checkpoints_in(folder: Path, key: str = "ckpt_path") -> str:
    """`: give one of its checkpoints, e.g. ckpt_path=<folder>/checkpoints/last.ckpt (others: ...)` for a run
    directory or its checkpoints/ folder given where a checkpoint is asked for (as `key`); '' when it holds
    none."""
    for where in (folder, folder / "checkpoints"):
        found = sorted(p for p in where.glob("*.ckpt")) if where.is_dir() else []
        if found:
            first = next((p for p in found if p.name == "last.ckpt"), found[-1])
            others = [p.name for p in found if p != first]
            rest = (
                f" (the others there: {', '.join(others[:5])}{', ...' if len(others) > 5 else ''})"
                if others
                else ""
            )
            return f": give one of its checkpoints, e.g. {key}={first}{rest}"
    return ""


def load(path: Path, key: str = "ckpt_path") -> dict[str, Any]:
    """The whole checkpoint as one dict on CPU; a sharded folder is consolidated in memory. `key`: the
    setting that named it, for the message when a folder is not a checkpoint.

    Lightning's `consolidate_checkpoint` CLI fails on ModelParallelStrategy folders (KeyError 'model':
    the weights are under 'state_dict'), so we read the folder as the fabric loader under it does.
    """
    try:
        if path.is_dir():
            if not (path / ".metadata").is_file():
                raise CheckpointError(
                    f"{path} is a folder but not a sharded checkpoint (no .metadata file){checkpoints_in(path, key)}"
                )
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


def _is_torch_save(path: Path) -> bool:
    """Whether the file starts as `torch.save` writes: a zip archive, or (before torch 1.6) a pickle."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return True  # unreadable here: the load's own error says more
    return head.startswith((b"PK\x03\x04", b"\x80"))


def _damaged(path: Path, err: BaseException) -> CheckpointError:
    if path.is_file() and path.stat().st_size and not _is_torch_save(path):  # empty: cut off as written
        return CheckpointError(
            f"{path} is not a checkpoint (torch.save writes a zip archive): give a .ckpt file a training run "
            "wrote (logs/train/runs/<run>/checkpoints/), an FSDP checkpoint folder or s3://bucket/key"
        )
    if "Weights only load failed" in str(err) and "Unsupported global" in str(err):
        # checkpoints hold plain data only; those of earlier versions pickled config objects
        return CheckpointError(
            f"checkpoint {path} holds Python objects, not only plain data: written by an earlier vitrain "
            "(before plain checkpoints) or by other code; torch.load(weights_only=True) refuses it"
        )
    return CheckpointError(
        f"checkpoint {path} is truncated or corrupted ({type(err).__name__}): use another checkpoint"
    )
