"""Every private Lightning, torch and litdata name vitrain relies on, and nothing else.

Each shim says which public API is missing. tests/test_compat.py has one test per name that fails with a
clear message when an upgrade moves, renames or changes it; tests/test_layout.py keeps these names out of
every other module. Upgrading Lightning, torch or litdata: run tests/test_compat.py first.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.logger import _convert_params, _flatten_dict
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.callbacks import RichProgressBar, ThroughputMonitor, WeightAveraging
from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype
from lightning.pytorch.loggers import MLFlowLogger, WandbLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import RunningStage
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.optim.swa_utils import AveragedModel
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "HYDRA_LAUNCHER_MODULES",
    "META_FILENAME",
    "EpochsFromOneBar",
    "TorchDispatchMode",
    "UnsyncedThroughputMonitor",
    "attached_trainer",
    "averaging_device",
    "averaging_uses_buffers",
    "checkpoint_wrapper",
    "foreach_lerp_",
    "install_hydra_subprocess_cmd",
    "latest_averaging_update",
    "litdata_allow_http",
    "litdata_distributed_env",
    "load_dcp_folder",
    "local_shard",
    "mkldnn_bf16_supported",
    "mlflow_params",
    "plugin_compute_dtype",
    "replace_sigterm_broadcast",
    "set_averaging_device",
    "set_data_parallel_size",
    "set_latest_averaging_update",
    "set_mlflow_run_id",
    "set_wandb_run_id",
    "should_update_logs",
    "tensorboard_purge_from",
    "uninstall_hydra_subprocess_cmd",
    "unwatch_launched_ranks",
    "upstream_hydra_subprocess_cmd",
    "wandb_offline",
]

# --- Lightning: trainer and module ------------------------------------------------------------------


def should_update_logs(trainer: L.Trainer) -> bool:
    """Whether the loggers write on this step (`log_every_n_steps`). Lightning's own LearningRateMonitor
    and ThroughputMonitor ask the logger connector; the Trainer has no public equivalent."""
    return bool(trainer._logger_connector.should_update_logs)


def attached_trainer(module: L.LightningModule) -> L.Trainer | None:
    """The module's trainer, None when not attached: the public `module.trainer` raises instead."""
    return module._trainer


def replace_sigterm_broadcast(trainer: L.Trainer, check: Callable[[], None]) -> bool:
    """Run `check` where Lightning broadcasts its SIGTERM flag before every batch under DDP/FSDP (this
    trainer only); False when Lightning has no such step. No public hook replaces that collective."""
    epoch_loop = trainer.fit_loop.epoch_loop
    if not hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
        return False
    epoch_loop._broadcast_sigterm_tensor = check
    return True


# --- Lightning: throughput --------------------------------------------------------------------------


def plugin_compute_dtype(plugin: Any) -> torch.dtype:
    """The dtype a precision plugin computes in; Lightning has no public accessor (its TODO: "integrate
    this into the precision plugins")."""
    return _plugin_to_compute_dtype(plugin)


class EpochsFromOneBar(RichProgressBar):
    """Rich's bar numbering the epochs from 1 to max_epochs, as the progress lines and the report do: the
    bar said `Epoch 0/9` for the first of ten, and the epoch line below it `epoch 1/10`. The bar's text has no
    option or public hook; its private `_get_train_description` is replaced."""

    def _get_train_description(self, current_epoch: int) -> str:
        text = f"Epoch {current_epoch + 1}"
        if self.trainer.max_epochs is not None and self.trainer.max_epochs > 0:
            text += f"/{self.trainer.max_epochs}"
        # as Lightning's: padded to the validation bar's text, which it shares a column with
        return f"{text:{len(self.validation_description)}}"


class UnsyncedThroughputMonitor(ThroughputMonitor):
    """Lightning's ThroughputMonitor without its `torch.cuda.synchronize()` on every batch.

    A synchronize per step stalls the host until the GPU is idle, so the next step's kernels are queued
    late: the monitor itself slows the training it measures. The logged figures are rates over a window of
    `window_size` batches ending at a logged step, so the clock needs to be exact there only: we
    synchronise on those steps (every `log_every_n_steps`, and each training epoch's last batch, where the
    figures are also computed so that a short run has them) and outside training, as Lightning does. The
    monitor has no option for it, so its private `_update`, `_compute` and counters are replaced here.
    """

    def set_available_flops(self, flops: int | None) -> None:
        """Peak FLOP/s for MFU, also in the per-stage meters `setup` already made."""
        self.available_flops = flops
        for throughput in self._throughputs.values():
            throughput.available_flops = flops

    def fit_train_window(self, trainer: L.Trainer, window: int) -> None:
        """A training window of `window` batches (the meter `setup` made has the configured size)."""
        old = self._throughputs.get(RunningStage.TRAINING)
        if old is not None and old._time.maxlen != window:
            self._throughputs[RunningStage.TRAINING] = Throughput(
                available_flops=self.available_flops,
                world_size=trainer.world_size,
                **{**self.kwargs, "window_size": window},
            )

    @staticmethod
    def _logs_now(trainer: L.Trainer) -> bool:
        """A logging step, or a training epoch's last batch (a short run still gets its figures)."""
        return should_update_logs(trainer) or bool(trainer.training and trainer.is_last_batch)

    def _compute(self, trainer: L.Trainer, iter_num: int | None = None) -> None:
        if not self._logs_now(trainer):
            return
        throughput = self._throughputs[trainer.state.stage]
        metrics = throughput.compute()
        metrics = {f"{trainer.state.stage.value}{throughput.separator}{k}": v for k, v in metrics.items()}
        trainer._logger_connector.log_metrics(metrics, step=iter_num)

    @torch.inference_mode()
    def _update(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, iter_num: int) -> None:
        stage = trainer.state.stage
        # the clock must be exact where a figure is computed; evaluation keeps Lightning's sync per batch
        exact = stage != RunningStage.TRAINING or self._logs_now(trainer)
        if trainer.strategy.root_device.type == "cuda" and exact:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - self._t0s[stage]
        if self.length_fn is not None:
            self._lengths[stage] += self.length_fn(batch)
        self._samples[stage] += self.batch_size_fn(batch)
        self._batches[stage] += 1
        self._throughputs[stage].update(
            time=elapsed,
            batches=self._batches[stage],
            samples=self._samples[stage],
            lengths=None if self.length_fn is None else self._lengths[stage],
            flops=getattr(pl_module, "flops_per_batch", None),
        )


# --- Lightning: weight averaging (EMA) --------------------------------------------------------------
# WeightAveraging keeps its settings and update counters in private attributes, with no accessors.


def averaging_device(callback: WeightAveraging) -> torch.device | int | None:
    """Where the AveragedModel will live (None: the module's device at setup)."""
    return callback._device


def set_averaging_device(callback: WeightAveraging, device: torch.device | int | None) -> None:
    """Move where the AveragedModel will be built (before `setup`)."""
    callback._device = device


def averaged_model(callback: WeightAveraging) -> AveragedModel | None:
    """The AveragedModel the callback made in `setup` (None before a fit)."""
    return callback._average_model


def averaging_uses_buffers(callback: WeightAveraging) -> bool:
    """The `use_buffers` the callback was made with."""
    return bool(callback._use_buffers)


def latest_averaging_update(callback: WeightAveraging) -> tuple[int, int]:
    """(optimizer step, epoch) of the last update, the counters `should_update` is checked against."""
    return callback._latest_update_step, callback._latest_update_epoch


def set_latest_averaging_update(
    callback: WeightAveraging, step: int | None = None, epoch: int | None = None
) -> None:
    """Record an update made outside WeightAveraging's hooks (at `step` and/or `epoch`)."""
    if step is not None:
        callback._latest_update_step = step
    if epoch is not None:
        callback._latest_update_epoch = epoch


# --- Lightning: loggers ------------------------------------------------------------------------------
# A logger continues an existing run when made with its id (`WandbLogger(id=...)`, `MLFlowLogger(run_id=...)`);
# a resumed run knows which one only once its checkpoint to resume from is found, after the loggers are built
# (vitrain/loggers.py), so the id is set on the logger before it starts its run.


def set_wandb_run_id(logger: WandbLogger, run_id: str) -> None:
    """What `WandbLogger(id=run_id)` sets (W&B's `resume="allow"` is Lightning's default); before its run
    starts."""
    if logger._experiment is not None:
        raise RuntimeError("the W&B run has started: its id can no longer change")
    logger._wandb_init["id"] = run_id
    logger._id = run_id


def drop_wandb_anonymous(logger: WandbLogger) -> None:
    """Lightning hands `wandb.init` `anonymous=None` when the option is off, and W&B (0.19 on) warns at every
    run that "The anonymous setting has no effect" for any value but its own unset: left out, as unset."""
    if (
        logger._experiment is None
        and "anonymous" in logger._wandb_init
        and not logger._wandb_init["anonymous"]
    ):
        del logger._wandb_init["anonymous"]


def wandb_offline(logger: WandbLogger) -> bool:
    """Whether the logger will start its run offline: `WandbLogger(offline=True)` or `WANDB_MODE=offline`
    (Lightning turns its flag into the variable only when the run starts)."""
    return bool(logger._offline) or os.environ.get("WANDB_MODE", "") in ("offline", "dryrun")


def set_mlflow_run_id(logger: MLFlowLogger, run_id: str) -> None:
    """What `MLFlowLogger(run_id=run_id)` sets; before its run starts."""
    if logger._initialized:
        raise RuntimeError("the MLflow run has started: its id can no longer change")
    logger._run_id = run_id


def tensorboard_purge_from(writer: Any, step: int) -> None:
    """Write what `SummaryWriter(purge_step=step)` writes when it opens: a SessionLog START at `step`, on
    reading which TensorBoard drops the run's earlier-written events at `step` and after. For a writer that is
    already open (the loggers start theirs before the checkpoint's step is known); the writer keeps its
    file writer private (`_get_file_writer`), and the event protos are tensorboardX's or TensorBoard's."""
    if type(writer).__module__.startswith("tensorboardX"):
        from tensorboardX.proto.event_pb2 import Event, SessionLog
    else:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
    writer._get_file_writer().add_event(Event(step=step, session_log=SessionLog(status=SessionLog.START)))
    writer.flush()


def mlflow_params(params: dict[str, Any]) -> dict[str, str]:
    """`params` as `MLFlowLogger.log_hyperparams` logs them: flattened with "/", values as text cut at 250
    characters. A run continued on MLflow may not change a logged param (MLflow refuses); the caller compares."""
    return {key: str(value)[:250] for key, value in _flatten_dict(_convert_params(params)).items()}


# --- Lightning: strategies ---------------------------------------------------------------------------


def set_data_parallel_size(strategy: ModelParallelStrategy, size: int) -> None:
    """Replace ModelParallelStrategy's data-parallel size before its `setup_environment` builds the mesh:
    the size is a constructor argument only, and the world size is known once the trainer set the devices
    (its "auto" is the number of nodes, which on one node shards nothing)."""
    strategy._data_parallel_size = size


# --- Lightning: the ranks its launcher started ------------------------------------------------------


def unwatch_launched_ranks(launcher: Any) -> list[subprocess.Popen]:
    """The rank processes Lightning's launcher started from this process, taken from its child-process
    observer; empty where it started none (torchrun, SLURM, one device).

    The observer (a thread the launcher starts, with no public way to stop it) polls them every 5 s and, once
    one has exited with a non-zero code, SIGKILLs this process and the other ranks. After an agreed SIGTERM
    stop every rank exits with 143 (130 after Ctrl-C), so a rank that ended first had this one killed in the
    middle of its own save or report. The observer watches the launcher's own `procs` list: emptied, its next look finds
    nothing to watch and it ends without a kill (the launcher's `kill` then forwards no signal either)."""
    procs = getattr(launcher, "procs", None)
    if not isinstance(procs, list):
        return []
    children = list(procs)
    procs.clear()
    return children


# --- Lightning: multi-process launch under Hydra ----------------------------------------------------

# the modules that hold (and call) Lightning's command builder for local ranks 1..N-1
HYDRA_LAUNCHER_MODULES = (
    "lightning.fabric.strategies.launchers.subprocess_script",
    "lightning.pytorch.strategies.launchers.subprocess_script",
)
_UPSTREAM: dict[str, Callable[[int], tuple[Sequence[str], str]]] = {}


def install_hydra_subprocess_cmd(builder: Callable[[int], tuple[Sequence[str], str]]) -> str | None:
    """Make Lightning build the child ranks' command with `builder(local_rank) -> (command, cwd)`; None on
    success, else the module that lacks `_hydra_subprocess_cmd`. Lightning's launcher takes no builder."""
    for name in HYDRA_LAUNCHER_MODULES:
        module = importlib.import_module(name)
        current = getattr(module, "_hydra_subprocess_cmd", None)
        if current is None:
            return name
        if current is not builder:
            _UPSTREAM[name] = current
            module._hydra_subprocess_cmd = builder
    return None


def uninstall_hydra_subprocess_cmd() -> None:
    """Lightning's own builders back."""
    for name, original in _UPSTREAM.items():
        importlib.import_module(name)._hydra_subprocess_cmd = original
    _UPSTREAM.clear()


def upstream_hydra_subprocess_cmd(local_rank: int) -> tuple[Sequence[str], str]:
    """Lightning's own builder: (command, cwd) of local rank `local_rank`."""
    name = HYDRA_LAUNCHER_MODULES[0]
    builder = _UPSTREAM.get(name) or importlib.import_module(name)._hydra_subprocess_cmd
    return builder(local_rank)


# --- checkpoints: Lightning's sharded folder, torch's distributed checkpoint ------------------------

# the file next to a sharded (DCP) checkpoint's shards that holds the rest of the checkpoint; Lightning
# exports no constant for it
META_FILENAME: str = _METADATA_FILENAME


def load_dcp_folder(folder: Path) -> dict[str, Any]:
    """The whole state dict of a torch distributed checkpoint folder, in this process, without a model to
    load into. torch's public `dcp.load` fills only the keys given and `dcp_to_torch_save` writes a file;
    both use this planner and loader internally."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    _load_state_dict(
        state, storage_reader=FileSystemReader(folder), planner=_EmptyStateDictLoadPlanner(), no_dist=True
    )
    return state


# --- torch ------------------------------------------------------------------------------------------


def mkldnn_bf16_supported() -> bool:
    """Whether oneDNN may run bf16 kernels on this CPU (False when `ONEDNN_MAX_CPU_ISA` caps it below
    AVX-512). No public equivalent in torch; inductor uses the same op."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def foreach_lerp_(start: list[torch.Tensor], end: list[torch.Tensor], weight: float) -> None:
    """`start[i].lerp_(end[i], weight)` for all i in one fused kernel: torch's foreach ops are documented
    but carry an underscore (`torch._foreach_*`)."""
    torch._foreach_lerp_(start, end, weight)


# TorchDispatchMode: the base class of a mode that sees every op torch dispatches (`__torch_dispatch__`,
# documented in torch's extending guide), exported only from a private module; vitrain/utils/measuring.py
# counts device ops with it.


def local_shard(t: Any) -> torch.Tensor:
    """A DTensor's local tensor, itself (no copy, no autograd): `DTensor.to_local()` is the public way, an
    autograd function call each, 4x the cost of an FSDP optimizer step's kernel when taken for every
    parameter, gradient and state (vitrain/distributed/local_step.py)."""
    return t._local_tensor


# checkpoint_wrapper (activation checkpointing as a module wrapper whose state-dict keys stay the plain
# model's): torch has no public path for it; torchtitan imports it from here too.


# --- litdata ----------------------------------------------------------------------------------------


def litdata_distributed_env(world_size: int, global_rank: int, num_nodes: int = 1) -> Any:
    """litdata's description of the ranks, for `StreamingDataset.distributed_env`: litdata has no public
    way to be told the ranks (it guesses them from torch.distributed and the GPUs per machine)."""
    from litdata.utilities.env import _DistributedEnv

    return _DistributedEnv(world_size=world_size, global_rank=global_rank, num_nodes=num_nodes)


def litdata_allow_http() -> None:
    """Let litdata's obstore client fetch from plain-HTTP endpoints (a MinIO in the cluster, a test
    server): litdata builds its clients from these module-level options and exposes no setting."""
    from litdata.streaming import downloader

    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"
