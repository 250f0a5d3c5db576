"""Lightning callbacks that kill their own process at a known point; tests add them with
`+callbacks.fault._target_=fault_injection.KillAt` (tests/ is put on PYTHONPATH).

A kill "after a save" first waits for the checkpoints the trainer writes in the background
(`wait_for_writes`): the tests are about what a resume does with a checkpoint on disk. A real kill within a
save's few seconds of writing resumes from the checkpoint before it (docs/reliability.md)."""

import multiprocessing
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback

from vitrain.checkpoints import wait_for_writes


class KillAt(Callback):
    """SIGKILL (no clean-up at all) when training epoch `epoch` starts, after the previous epoch's save.

    With `once_file`, only the first time: the file marks that the kill happened (for restart tests).
    """

    def __init__(self, epoch: int, once_file: str | None = None) -> None:
        self.epoch = epoch
        self.once_file = Path(once_file) if once_file else None

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch != self.epoch:
            return
        if self.once_file is not None:
            if self.once_file.exists():
                return
            self.once_file.touch()
        wait_for_writes(trainer)
        os.kill(os.getpid(), signal.SIGKILL)


class SigtermAt(Callback):
    """SIGTERM the whole process group (as a scheduler does) once global rank zero reaches `step`; with
    `linger_s`, global rank zero then stays that much longer in the stop, after the save (as a slow disk or
    report would keep it), so the other ranks exit first."""

    def __init__(self, step: int, linger_s: float = 0.0) -> None:
        self.step, self.linger_s = step, linger_s

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        if trainer.is_global_zero and self.linger_s:
            time.sleep(self.linger_s)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if trainer.global_step == self.step and trainer.is_global_zero and not trainer.received_sigterm:
            os.killpg(os.getpgid(os.getpid()), signal.SIGTERM)


class InterruptAt(Callback):
    """Ctrl-C as a terminal sends it: SIGINT to the whole process group (the DataLoader's workers too) once
    global rank zero reaches training `step` (or test batch `test_batch`), `times` times. With `children_file`,
    write how many child processes (the loader's workers) were alive before the signal and half a second
    after it."""

    def __init__(
        self,
        step: int | None = None,
        times: int = 1,
        children_file: str | None = None,
        test_batch: int | None = None,
        linger_s: float = 0.0,
    ) -> None:
        self.step, self.times, self.test_batch, self.linger_s = step, times, test_batch, linger_s
        self.children_file = Path(children_file) if children_file else None
        self._sent = False

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if trainer.global_step == self.step:
            self._interrupt(trainer)

    def on_test_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        """With `test_batch`: in the test after fit, once that test batch (its index) is done."""
        if args[-1] == self.test_batch:
            self._interrupt(trainer)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        """With `linger_s`, global rank zero stays that much longer in the stop (past a look of Lightning's
        child-process observer, every 5 s, at a rank that has exited)."""
        if trainer.is_global_zero and self.linger_s:
            time.sleep(self.linger_s)

    def _interrupt(self, trainer: L.Trainer) -> None:
        if not trainer.is_global_zero or self._sent:
            return
        self._sent = True
        before = len(multiprocessing.active_children())
        for _ in range(self.times):
            os.killpg(os.getpgid(os.getpid()), signal.SIGINT)
            time.sleep(0.2)  # the handler runs (and, the second time, raises) before the next is sent
        if self.children_file is not None:
            time.sleep(0.5)
            self.children_file.write_text(f"{before} {len(multiprocessing.active_children())}")


class SignalRankAt(Callback):
    """Send `signal_name` (KILL: a dead peer, STOP: a hung one) to this process if it is global rank `rank`
    when it reaches `step`; with `stamp_file`, first write the time (`time.monotonic()`, one clock for all
    processes of the machine) there, so a test can time what follows from the fault itself."""

    def __init__(
        self, rank: int, step: int, signal_name: str = "KILL", stamp_file: str | None = None
    ) -> None:
        self.rank, self.step, self.signum = rank, step, getattr(signal, f"SIG{signal_name}")
        self.stamp_file = Path(stamp_file) if stamp_file else None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            if self.stamp_file is not None:
                self.stamp_file.write_text(repr(time.monotonic()))
            wait_for_writes(trainer)
            os.kill(os.getpid(), self.signum)


class SlurmSignalAt(Callback):
    """In a SLURM job's first attempt, global rank zero has SLURM signal every task of the job (`scancel
    --signal`, what `--signal=USR1@90` does before the time limit) when it reaches `step`, and waits until
    the signal has arrived here, so the step the ranks stop at is known."""

    def __init__(self, step: int, signal_name: str = "USR1") -> None:
        self.step, self.name = step, signal_name

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if trainer.global_step != self.step or not trainer.is_global_zero:
            return
        if int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0:
            return
        signum = getattr(signal, f"SIG{self.name}")
        arrived = threading.Event()
        previous = signal.getsignal(signum)

        def note(sig: int, frame) -> None:
            arrived.set()
            if callable(previous):
                previous(sig, frame)

        signal.signal(signum, note)
        # scancel runs inside the job step, so SLURM signals it too: it ignores the signal (an ignored signal
        # stays ignored across exec), or it may die of it before exiting 0 (a race that failed a CI run)
        subprocess.run(
            ["scancel", f"--signal={self.name}", os.environ["SLURM_JOB_ID"]],
            check=True,
            preexec_fn=lambda: signal.signal(signum, signal.SIG_IGN),
        )
        deadline = time.monotonic() + 60
        while not arrived.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        signal.signal(signum, previous)


class KillAtStep(Callback):
    """SIGKILL (no clean-up at all) before training step `step`, i.e. right after a checkpoint saved every
    `step` steps was written: a kill in the middle of an epoch."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if trainer.global_step == self.step:
            wait_for_writes(trainer)
            os.kill(os.getpid(), signal.SIGKILL)


class NonFiniteLossAt(Callback):
    """The training loss the module hands the loggers (`logged_train_loss`) made infinite at the given global
    steps (`rank`: on that global rank only; None: on every rank), as a 16-bit overflow would make it: set
    after the backward, between the training step and the divergence check at the batch's end."""

    def __init__(self, steps: list[int], rank: int | None = None) -> None:
        self.steps, self.rank = set(steps), rank

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step in self.steps and self.rank in (None, trainer.global_rank):
            pl_module.logged_train_loss = float("inf")
