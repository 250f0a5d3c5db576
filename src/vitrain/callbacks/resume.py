"""What Lightning leaves out of a checkpoint for an exact resume, and a checkpoint on SIGTERM or Ctrl-C."""

import atexit
import logging
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from vitrain.callbacks.epoch_metrics import CHECKPOINT_KEY, restore_states, states_to_save
from vitrain.checkpoints import wait_for_writes
from vitrain.compat import replace_sigterm_broadcast, unwatch_launched_ranks
from vitrain.loggers import forget_steps_from

log = logging.getLogger(__name__)

#: how long a launching process waits at its exit for the ranks it started, after an agreed stop
RANKS_EXIT_TIMEOUT_S = 60.0


class ExactResume(Callback):
    """Saves every rank's random number generators with each checkpoint and restores them on resume; gives
    each rank its own augmentation stream.

    Lightning restores weights, optimizer, schedule and loop counters but not the global RNGs that drive
    drop-path, mixup and the on-device augmentation of the loader workers' batches: without them a resumed
    run draws other masks and crops than the run it continues (in-memory batches seed their own
    augmentation: data/loaders.py, `Seeded`). Only training draws from them (our loaders have private
    generators), so the state after the last completed batch is the one to continue from — also for a
    SIGTERM save, which happens after the next batch was already fetched and augmented. Restored when training starts (Lightning does not call
    `on_train_epoch_start` again for an epoch it resumes in the middle).

    Ranks: every rank is seeded alike so that the model starts identical everywhere; when training starts,
    rank r > 0 re-seeds its generators from (seed, r), so ranks draw different crops and drop-path masks
    (rank 0 draws as a single process does). Only rank 0 writes the checkpoint file, so the states of all
    ranks are gathered into it (`rng_states_per_rank`, a few KB each; one collective per save), and each rank
    restores its own. A checkpoint from another world size restores rank 0's state, offset by rank.

    A checkpoint saved in the middle of an epoch also carries the epoch's training metric states so far
    (callbacks/epoch_metrics.py): the resumed epoch's `train/acc1` and `train/loss_epoch` cover all its
    batches, as the uninterrupted run's do. The loggers drop what the interrupted run logged after the
    checkpoint (vitrain/loggers.py `forget_steps_from`): those steps are trained and logged again.
    """

    def __init__(self) -> None:
        self._pending: dict[str, Any] | None = None
        self._pending_metrics: dict[str, Any] | None = None
        self._after_last_batch: dict[str, Any] | None = None
        self._cuda: bool | None = None

    def _collect(self) -> dict[str, Any]:
        # Lightning's collector asks torch.cuda.is_available() each time, which on a CUDA build without a
        # GPU loads NVML anew: more than the states themselves. Asked once here.
        if self._cuda is None:
            self._cuda = torch.cuda.is_available()
        states = collect_rng_states()
        # this process's devices' generators (CPU byte tensors: no device tensor reaches the checkpoint)
        states["torch.cuda"] = torch.cuda.get_rng_state_all() if self._cuda else []
        return states

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._after_last_batch = self._collect()  # a few KB copied: microseconds a step

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        mine = self._after_last_batch or self._collect()
        per_rank = gather_from_ranks(mine, trainer.world_size)
        checkpoint["rng_states"] = per_rank[0]
        checkpoint["rng_states_per_rank"] = per_rank
        metric_states = states_to_save(trainer, pl_module)  # a collective too, on every rank alike
        if metric_states:
            checkpoint[CHECKPOINT_KEY] = metric_states

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        per_rank = checkpoint.get("rng_states_per_rank")
        if per_rank and len(per_rank) == trainer.world_size:
            self._pending = per_rank[trainer.global_rank]
        elif checkpoint.get("rng_states") is not None:
            self._pending = {**checkpoint["rng_states"], "offset_by_rank": True}
        self._pending_metrics = checkpoint.get(CHECKPOINT_KEY)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._pending_metrics:  # the model is on its device by now, as the states must be
            restore_states(pl_module, self._pending_metrics, trainer.global_rank)
            self._pending_metrics = None
        if self._pending is not None:
            offset = self._pending.pop("offset_by_rank", False)
            if not torch.cuda.is_available():
                self._pending.pop("torch.cuda", None)  # saved on GPUs, resumed on a CPU: nothing to restore
            set_rng_states(self._pending)
            self._pending = None
            if offset:
                offset_by_rank(trainer.global_rank)
            if trainer.is_global_zero:
                log_resume(trainer)
                # the steps after the checkpoint, logged by a run killed before its next save, come again
                forget_steps_from(trainer.loggers, trainer.global_step)
        else:
            offset_by_rank(trainer.global_rank)


def log_resume(trainer: L.Trainer) -> None:
    """One line when a run resumes: what continues bitwise, or, from the datamodule, what may not."""
    caveat_of = getattr(trainer.datamodule, "resume_caveat", None)
    caveat = caveat_of() if caveat_of is not None else "the data comes from loaders vitrain does not know"
    where = f"epoch {trainer.current_epoch}, step {trainer.global_step}"
    if caveat:
        log.warning(f"resuming at {where}: random generators restored, but not bitwise: {caveat}")
    else:
        log.info(
            f"resuming at {where}: random generators restored; the data continues with the next batch the "
            "interrupted run had not trained on, with the same augmentation (bitwise as if never stopped)"
        )


def collect_rng_states() -> dict[str, Any]:
    """This process's global torch (CPU), numpy and Python generator states, in the layout Lightning's
    (private) seed utilities use, so checkpoints written with either restore alike. numpy's key as a list:
    an ndarray would need torch.load(weights_only=False)."""
    kind, key, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = (kind, key.tolist(), int(pos), int(has_gauss), float(gauss))
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy_state}


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what `collect_rng_states` took, plus `torch.cuda` (this process's devices) when present."""
    torch.set_rng_state(states["torch"])
    if "torch.cuda" in states:
        torch.cuda.set_rng_state_all(states["torch.cuda"])
    if "numpy" in states:
        np.random.set_state(states["numpy"])
    version, state, gauss = states["python"]
    random.setstate((version, tuple(state), gauss))  # a list after some serialisations


def offset_by_rank(rank: int) -> None:
    """Re-seed this rank's global generators (torch CPU and CUDA, numpy, random) from (its seed, rank):
    each rank its own augmentation stream. Rank 0 keeps its stream."""
    if rank == 0:
        return
    seed = (torch.initial_seed() + 1_000_003 * rank) % 2**32
    torch.manual_seed(seed)  # also every CUDA device's generator
    random.seed(seed)
    np.random.seed(seed)


def gather_from_ranks(obj: Any, world_size: int) -> list[Any]:
    """`obj` of every rank, in rank order, on every rank (a list of one without a process group)."""
    if world_size <= 1 or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [obj]
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, obj)
    return gathered


class StopRequested(SIGTERMException):
    """The ranks agreed to stop and save `last`: `by` names the signal, `exit_code` is what the process exits
    with once the report is written (128 + the signal, as a shell reports it)."""

    def __init__(self, by: str, exit_code: int) -> None:
        super().__init__(by)
        self.by = by
        self.exit_code = exit_code


class CheckpointOnSigterm(Callback):
    """On SIGTERM (spot reclaim, `kill`, SLURM) or Ctrl-C, every rank stops at the same step and `last` is
    saved.

    Lightning's own handling is not safe across ranks: its handler runs a broadcast inside the signal
    handler, and after each batch every rank that has seen the signal raises at once, without asking the
    others. A rank that got the signal a moment later trains on and waits in the next collective forever
    (seen on gloo). So we take SIGTERM over: the handler only notes it (and forwards it to the local child
    ranks, as Lightning's does); every `check_every_n_steps` the ranks agree with one all-reduce (MAX)
    before a batch, and all stop together. The save goes through the trainer (a collective: all ranks take
    part, as FSDP needs) into the `last` path, so `ckpt_path=last` resumes from it mid-epoch.

    Lightning 2.6 also broadcasts its own SIGTERM flag before every batch under DDP/FSDP: a second collective
    (a host sync on GPUs) per step, which after the take-over only ever says "no". The agreement runs in
    its place, so a step has one such collective, not two.

    Under SLURM with auto-requeue (Lightning's default `SLURMEnvironment`), the requeue signal
    (`#SBATCH --signal=USR1@90`) takes the same path, and then global rank zero runs `scontrol requeue` once
    every rank has saved; the requeued job resumes from `last` in the same run directory (`resume=auto`).
    Lightning's own handler would save `hpc_ckpt_N.ckpt` from rank zero alone inside the signal handler
    (incomplete for FSDP, and another checkpoint than `last`) and requeue while the others train on.

    Ctrl-C (SIGINT) during fit takes the same path, so an interactive run stopped by hand keeps its progress
    and gets its report (during the test after fit, the test stops at once and the report is written: the
    training is saved); a second Ctrl-C stops at once without saving (a KeyboardInterrupt, which Lightning
    ends with exit code 1 and no save). Lightning has no handler of its own for it. It is installed as fit
    starts, before the validation sanity check starts DataLoader workers: a worker (forked, so it inherits
    the handler, and in the terminal's process group, so it gets the Ctrl-C too) ignores it instead of
    dying, which would break the loader the training process still reads from. Not forwarded to the local
    ranks: a terminal signals them all, and the ranks' agreement stops those it did not reach.
    """

    # what the ranks agree on (MAX): nothing, stop and save after Ctrl-C, after SIGTERM, stop, save and
    # requeue the SLURM job
    _NONE, _INTERRUPT, _STOP, _REQUEUE = 0, 1, 2, 3
    _BY = {
        _INTERRUPT: ("SIGINT (Ctrl-C)", 130),
        _STOP: ("SIGTERM", 143),
        _REQUEUE: ("SLURM requeue signal", 143),
    }

    def __init__(self, check_every_n_steps: int = 10) -> None:
        self.check_every_n_steps = max(int(check_every_n_steps), 1)
        self._requested = self._NONE
        self._agreed = self._NONE
        self._replaced_lightning_check = False
        self._pid = os.getpid()
        self._fitting = self._testing = False
        #: the task's words for how to resume this run (vitrain/tasks/runs.resume_hint), set when it is built
        self.resume_hint: Callable[[], str] | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pid, self._fitting = os.getpid(), True
        if threading.current_thread() is not threading.main_thread():
            return
        current = signal.getsignal(signal.SIGINT)
        # not a handler a user's code set; an earlier fit's in this process (Lightning restores it as the
        # handler it found) is replaced
        if current is signal.default_int_handler or getattr(current, "stops_fit", False):
            self._handle(signal.SIGINT, trainer, requeue_signal=None)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._fitting = False

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._testing, self._requested = True, self._NONE

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._testing = False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        requeue_signal = slurm_requeue_signal(trainer)
        for signum in (signal.SIGTERM, requeue_signal):
            if signum is not None:  # replaces Lightning's handlers (restored when fit ends)
                self._handle(signum, trainer, requeue_signal)
        if trainer.world_size > 1:
            # the agreement replaces Lightning's SIGTERM broadcast before each batch (this trainer only);
            # tests/test_faults_distributed.py fails should an upgrade stop running it
            self._replaced_lightning_check = replace_sigterm_broadcast(trainer, lambda: self._agree(trainer))

    def _handle(self, signum: int, trainer: L.Trainer, requeue_signal: int | None) -> None:
        def note(signum: int, frame: FrameType | None) -> None:
            if os.getpid() != self._pid:
                return  # a DataLoader worker forked with the handler: the training process decides
            interrupt = signum == signal.SIGINT
            if interrupt and self._testing and not self._requested:
                # the test after fit: the training is over and saved; the test stops at once and the task
                # writes the report before it exits
                self._requested = self._INTERRUPT
                if trainer.is_global_zero:
                    os.write(2, b"SIGINT (Ctrl-C) received: stopping the test; the training is saved\n")
                raise StopRequested(*self._BY[self._INTERRUPT])
            if interrupt and (self._requested or not self._fitting):
                raise KeyboardInterrupt  # a second Ctrl-C, or one outside fit and test: at once, nothing saved
            if not self._requested and not interrupt and trainer.strategy.launcher is not None:
                trainer.strategy.launcher.kill(signum)
            wanted = (
                self._INTERRUPT if interrupt else self._REQUEUE if signum == requeue_signal else self._STOP
            )
            if not self._requested and trainer.is_global_zero:
                # at once, before a slow step ends; os.write, not logging: a handler may interrupt a log call
                every = self.check_every_n_steps if trainer.world_size > 1 else 1
                again = "; Ctrl-C again stops at once without saving" if interrupt else ""
                os.write(
                    2,
                    f"{self._BY[wanted][0]} received: stopping at the next step boundary (within "
                    f"{every} step(s)) and saving last{again}\n".encode(),
                )
            self._requested = max(self._requested, wanted)

        note.stops_fit = True  # type: ignore[attr-defined]
        signal.signal(signum, note)
        # restart system calls the signal interrupts instead of failing them: gloo does not retry
        signal.siginterrupt(signum, False)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if not self._replaced_lightning_check:
            self._agree(trainer)

    def _agree(self, trainer: L.Trainer) -> None:
        if trainer.world_size == 1:
            self._agreed = self._requested
        elif trainer.global_step % self.check_every_n_steps == 0:
            flag = torch.tensor([self._requested], device=trainer.strategy.root_device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            self._agreed = int(flag.item())
        if self._agreed:
            raise StopRequested(*self._BY[self._agreed])

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._fitting = self._testing = False
        stopping = trainer.state.fn in (TrainerFn.FITTING, TrainerFn.TESTING)
        if not isinstance(exception, SIGTERMException) or not stopping:
            return
        # every rank exits with 143 (130 after Ctrl-C) after the stop: the ranks this process launched (none
        # may exit before the save's barrier, or before the report after a stopped test) are waited for at its
        # exit instead of having Lightning's observer kill this process when the first of them exits
        launched = unwatch_launched_ranks(trainer.strategy.launcher)
        if launched:
            atexit.register(wait_for_ranks, launched)
        if trainer.state.fn == TrainerFn.TESTING:
            return  # the test after fit: the training is saved already
        checkpoint = trainer.checkpoint_callback
        if not isinstance(checkpoint, ModelCheckpoint) or checkpoint.dirpath is None:
            log.warning("SIGTERM: no ModelCheckpoint configured, nothing saved")
            return
        path = Path(checkpoint.dirpath) / f"{checkpoint.CHECKPOINT_NAME_LAST}{checkpoint.FILE_EXTENSION}"
        trainer.save_checkpoint(path, weights_only=False)  # a full save; ends in a barrier (every rank wrote)
        if not trainer.is_global_zero:
            return
        wait_for_writes(trainer)  # on disk before it is said to be, and before SLURM requeues the job
        if self._agreed == self._REQUEUE:
            log.warning(f"SLURM requeue signal: saved {path} at step {trainer.global_step}")
            requeue_slurm_job()
        else:
            hint = self.resume_hint() if self.resume_hint else "resume it with ckpt_path=last"
            log.warning(f"{self._BY[self._agreed][0]}: saved {path} at step {trainer.global_step}; {hint}")


def wait_for_ranks(processes: list[subprocess.Popen], timeout: float = RANKS_EXIT_TIMEOUT_S) -> None:
    """Wait for the launched ranks to end (their share of the save is written by then); any still running
    after `timeout` is killed, as Lightning's observer would have."""
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            log.warning(f"rank process {process.pid} still running {timeout:.0f} s after the stop: killed")
            process.kill()


def slurm_requeue_signal(trainer: L.Trainer) -> int | None:
    """The signal after which Lightning would requeue this SLURM job (`SLURMEnvironment(auto_requeue=True)`)."""
    environment = getattr(trainer.strategy, "cluster_environment", None)  # none on one device
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
        return environment.requeue_signal
    return None


def requeue_slurm_job() -> None:
    """`scontrol requeue` this job (array task): SLURM stops it and starts it again under the same id."""
    job = os.environ["SLURM_JOB_ID"]
    if os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID"):
        job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    if done.returncode == 0:
        log.warning(f"SLURM: requeued job {job}; it resumes from `last` in this run directory")
    else:
        log.error(f"SLURM: scontrol requeue {job} failed ({done.stderr.strip()}); resubmit the job to resume")
