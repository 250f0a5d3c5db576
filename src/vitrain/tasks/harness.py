"""What every entry point does around its task: .env, warnings, config tree, one-line errors."""

import logging
import os
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed
from dotenv import load_dotenv
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig

from vitrain.distributed.ranks import check_launch_env, setup_rank
from vitrain.errors import UserError, chain
from vitrain.loggers import finish_runs
from vitrain.utils.cuda_check import skip_failing_nvml_check
from vitrain.utils.host_memory import freeze_startup_heap, retain_freed_memory
from vitrain.utils.secrets import install_secret_filter

log = logging.getLogger(__name__)

# Lightning's notes on choices this template makes on purpose, printed on every run: an advert for its cloud
# logger, and that it adds no model summary of its own beside ours (callbacks.model_summary)
LIGHTNING_NOTES_DROPPED = ("💡 Tip:", "Trainer already configured with model summary callbacks")
# the logger Lightning's rank_zero_info writes to
LIGHTNING_INFO_LOGGER = "lightning.pytorch.utilities.rank_zero"


class DropLightningNotes(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(LIGHTNING_NOTES_DROPPED)


def drop_lightning_notes() -> None:
    """Idempotent: the filter sits on Lightning's info logger itself, every other line of it stays."""
    logger = logging.getLogger(LIGHTNING_INFO_LOGGER)
    if not any(isinstance(f, DropLightningNotes) for f in logger.filters):
        logger.addFilter(DropLightningNotes())


# a task returns its metrics and the objects it built (vitrain.tasks.build.RunObjects)
Task = Callable[[DictConfig], tuple[dict[str, float], Any]]


def user_error(err: BaseException) -> UserError | None:
    """The UserError behind `err`, also when Hydra's instantiate wrapped it."""
    return next((e for e in chain(err) if isinstance(e, UserError)), None)


def one_line(problem: UserError) -> str:
    """The error's own message. One raised in a DataLoader worker comes back re-raised with the worker's
    traceback as its message ("Caught DataError in DataLoader worker process 0.\nOriginal Traceback ...");
    the traceback's last line holds the original ("vitrain.errors.DataError: <message>")."""
    text = str(problem)
    if text.startswith("Caught ") and "\nOriginal Traceback" in text:
        last = text.rstrip().splitlines()[-1]
        return last.partition(": ")[2] or last
    return text


# what gloo and NCCL say when a peer died (connection reset) or hangs (the collective timed out)
PEER_LOST = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Application timeout caused pair closure",
    "Timed out waiting",
    "timed out",
    "NCCL communicator was aborted",
    "Watchdog caught collective operation timeout",
)


def peer_lost(err: BaseException) -> bool:
    """True when `err` (or what caused it) says another rank of the process group is gone."""
    return any(
        isinstance(e, torch.distributed.DistError)
        or (isinstance(e, RuntimeError) and any(s in str(e) for s in PEER_LOST))
        for e in chain(err)
    )


def run_task(task: Task, cfg: DictConfig) -> tuple[dict[str, float], Any]:
    """Run `task(cfg)`; a UserError ends the process with its one-line message and exit code 2.

    The full traceback is printed only with HYDRA_FULL_ERROR=1, as Hydra does for its own errors.
    """
    load_dotenv(override=False)  # .env fills in what the environment does not already set
    install_secret_filter()  # on Hydra's console and file handlers: no credential reaches a log
    # before anything prints: node 1's launching process must not think it is rank zero
    setup_rank(cfg.get("trainer"))
    extras = cfg.get("extras") or {}
    if extras.get("ignore_warnings"):
        warnings.filterwarnings("ignore")
    drop_lightning_notes()
    # Lightning 2.6's own call of a torch pytree API that torch >= 2.10 deprecates: nothing a user can change
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
    )
    # and its `strategy.all_gather` (the run's figures gathered from the ranks) of a torch API >= 2.14 deprecates
    warnings.filterwarnings(
        "ignore",
        message=r"torch\.distributed\.nn\.functional\.all_gather is deprecated",
        category=FutureWarning,
    )
    if "SLURM_JOB_ID" not in os.environ:
        # Lightning's hint to put `srun` before the command, on every run of any machine with SLURM's client
        # installed: outside a SLURM job there is nothing to put it before (srun needs an allocation)
        warnings.filterwarnings(
            "ignore", message=r"The `srun` command is available on your system but is not used"
        )
    if extras.get("retain_freed_memory", True):
        retain_freed_memory()
    freeze_startup_heap()
    skip_failing_nvml_check()  # no NVIDIA driver: no failing library load per optimizer step
    output_dir = Path(cfg.paths.output_dir)
    # the config tree (extras.print_config) is printed by the task once its set-up has succeeded: the
    # config it runs (eval: the checkpoint's), and none before a one-line error
    failed = True
    try:
        check_launch_env(cfg.get("trainer"))
        result = task(cfg)
        failed = False
        _log_output_dir(output_dir)
        return result
    except SIGTERMException as stop:
        # stopped on request after saving `last` (CheckpointOnSigterm): 128 + the signal, as a shell says it
        sys.exit(getattr(stop, "exit_code", 143))
    except KeyboardInterrupt:
        # Ctrl-C outside Lightning's loops (unpacking, decoding, the report; inside fit it stops and saves): one
        # line, not a traceback of wherever it landed; a run dir holding nothing yet goes
        print("interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        remove_unstarted_run_dir(output_dir)
        sys.exit(130)
    except Exception as err:
        if peer_lost(err) and os.environ.get("HYDRA_FULL_ERROR") != "1":
            detail = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
            print(
                f"error: lost contact with another process of this run ({detail[:300]}); check the other "
                "ranks' logs. A hung peer is waited for at most trainer.strategy.timeout",
                file=sys.stderr,
                flush=True,
            )
            sys.exit(3)
        problem = user_error(err)
        if problem is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {one_line(problem)}", file=sys.stderr, flush=True)
        log.debug("user error", exc_info=err)
        remove_unstarted_run_dir(output_dir)
        sys.exit(2)
    finally:
        finish_runs(failed)  # a failed job of a sweep must not leave its W&B run open for the next one


# what Hydra and the task write into a run dir before anything runs
_START_FILES = {
    ".hydra",
    "config_tree.log",
    "train.log",
    "eval.log",
    "predict.log",
    "export.log",
    "debug.log",
}


@rank_zero_only
def remove_unstarted_run_dir(output_dir: Path) -> None:
    """A run that stopped at a one-line error before it did anything leaves no run directory behind: only
    Hydra's `.hydra/` and the log (which holds nothing the error line did not say) would be in it. A run
    dir with anything else (checkpoints of a run to resume, metrics) is kept; so is a sweep's job dir."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    try:
        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            return
        if not (output_dir / ".hydra").is_dir():  # Hydra made no run dir here (a test's, a given folder)
            return
        if any(p.name not in _START_FILES for p in output_dir.iterdir()):
            return
        for handler in logging.getLogger().handlers:  # Hydra's file handler holds the log open
            if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == output_dir:
                handler.close()
                logging.getLogger().removeHandler(handler)
        shutil.rmtree(output_dir)
        if output_dir.parent.name == "runs":  # Hydra's `<log_dir>/<task>/runs/`, made for this run: if empty
            output_dir.parent.rmdir()
            output_dir.parent.parent.rmdir()
    except OSError:  # a parent that holds other runs (not empty) stays
        pass


@rank_zero_only
def _log_output_dir(output_dir: Path) -> None:
    log.info(f"Output dir: {output_dir}")
