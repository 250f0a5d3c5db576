"""Faults in multi-process runs: SIGTERM saves once for all ranks; a dead or hung peer ends the run."""

import os
import time
from pathlib import Path

import pytest
import torch

from helpers import ROOT, epoch_figures, run_cli, tiny_overrides
from warm import ScriptRun

TESTS = str(ROOT / "tests")
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _ddp(tiny_cifar: Path, data_cache: Path, run_dir: Path) -> list[str]:
    return [
        *tiny_overrides(tiny_cifar, data_cache),
        "trainer=ddp",
        "trainer.devices=2",
        "trainer.accelerator=cpu",
        "trainer.max_epochs=2",
        "logger=csv",
        f"hydra.run.dir={run_dir}",
    ]


def test_sigterm_two_process_ddp_saves_last_then_resumes(tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    """Also: the interrupted epoch's training figures are those of a run left alone (each rank's metric
    states so far, summed into the checkpoint; rank 0 resumes from the sum)."""
    alone = run_cli("train.py", _ddp(tiny_cifar, data_cache, tmp_path / "alone"), env={"PYTHONPATH": TESTS})
    assert alone.returncode == 0, alone.stderr[-3000:]
    # checkpoints written in the background (what `auto` does on GPUs): the SIGTERM save is on disk at exit
    overrides = [*_ddp(tiny_cifar, data_cache, tmp_path), "trainer.plugins.0.background=true"]
    # rank 0 lingers after the save past a look of Lightning's child-process observer (every 5 s) at rank 1,
    # which has exited with 143: it is waited for, not a reason to SIGKILL rank 0
    fault = ["+callbacks.fault._target_=fault_injection.SigtermAt", "+callbacks.fault.step=5"]
    stopped = run_cli(
        "train.py", [*overrides, *fault, "+callbacks.fault.linger_s=11"], env={"PYTHONPATH": TESTS}
    )
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert "terminated with code" not in stopped.stderr
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 10  # signalled after step 5; the ranks agree every 10 steps

    resumed = run_cli("train.py", [*overrides, "ckpt_path=last"], env={"PYTHONPATH": TESTS})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    final = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert final["epoch"] == 1 and final["global_step"] == 2 * 28  # 224 images / global batch 8, 2 epochs
    assert saved["training_epoch_metric_states"]["train_figures"]["counts"][0] > 0
    resumed_epoch, alone_epoch = epoch_figures(tmp_path)[0], epoch_figures(tmp_path / "alone")[0]
    # accuracies are counts (exact); the mean loss is summed in another order over the ranks
    assert resumed_epoch["train/acc1"] == alone_epoch["train/acc1"]
    assert resumed_epoch["train/acc5"] == alone_epoch["train/acc5"]
    assert resumed_epoch["train/loss_epoch"] == pytest.approx(alone_epoch["train/loss_epoch"], rel=1e-5)


def test_ctrl_c_in_the_test_after_ddp_fit_writes_the_report(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path
):
    """Ctrl-C while two ranks test the best checkpoint: both stop, rank 0 writes the report and exits 130; rank
    0 lingers in the stop past a look of Lightning's child-process observer at rank 1, which has exited with
    130: it is waited for, not a reason to SIGKILL rank 0 (which then wrote no report)."""
    overrides = [
        *_ddp(tiny_cifar, data_cache, tmp_path),
        "trainer.max_epochs=1",
        "datamodule.eval_batch_size=4",
    ]
    fault = [
        "+callbacks.fault._target_=fault_injection.InterruptAt",
        "+callbacks.fault.test_batch=1",
        "+callbacks.fault.linger_s=6",
    ]
    stopped = run_cli("train.py", [*overrides, *fault], env={"PYTHONPATH": TESTS})
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert stopped.stderr.count("SIGINT (Ctrl-C) received: stopping the test; the training is saved") == 1
    assert "Traceback" not in stopped.stderr and "interrupted (Ctrl-C)" not in stopped.stderr
    assert "No test metrics: the test was stopped by SIGINT (Ctrl-C)" in (tmp_path / "report.md").read_text()


@pytest.mark.timeout(660)
@pytest.mark.parametrize("fault", ["KILL", "STOP"])
def test_lost_peer_ends_the_run_within_the_timeout(
    fault: str, tmp_path: Path, tiny_cifar: Path, data_cache: Path
):
    """Rank 1 dies (KILL) or hangs (STOP) at step 3: rank 0 exits with a clear error, within the timeout."""
    timeout_s = 15
    fault_at = tmp_path / "fault_at"  # when rank 1 signalled itself (time.monotonic)
    overrides = [
        *_ddp(tiny_cifar, data_cache, tmp_path),
        f"trainer.strategy.timeout.minutes={timeout_s / 60}",
        "+callbacks.fault._target_=fault_injection.SignalRankAt",
        "+callbacks.fault.rank=1",
        "+callbacks.fault.step=3",
        f"+callbacks.fault.signal_name={fault}",
        f"+callbacks.fault.stamp_file={fault_at}",
    ]
    env = {**os.environ, "PYTHONPATH": TESTS, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    # output to files, not pipes: the stopped rank 1 keeps inherited pipes open after rank 0 has exited
    proc = ScriptRun([ROOT / "src" / "train.py", *overrides], env, ROOT)
    try:
        done = proc.wait(timeout=600)  # a guard against a hang; the time that counts is taken below
    finally:
        proc.kill()  # the stopped rank 1 is still in the run's process group
    ended = time.monotonic()
    stderr = done.stderr
    if fault == "KILL" and done.returncode == -9:
        # a race that users meet too: Lightning's launcher watches the ranks it started (every 5 s) and, when
        # one has died, kills the others and itself, saying so; it wins when rank 0 has not yet hit a
        # collective with the dead rank (seen under a loaded machine's delays)
        assert "terminated with code -9. Forcefully terminating all other processes" in stderr, stderr[-3000:]
    else:
        assert done.returncode == 3, stderr[-3000:]
        assert "lost contact with another process of this run" in stderr
        assert "Traceback" not in stderr.split("lost contact")[-1]
    # the hang ends at the collective timeout (15 s), not at the default 30 minutes: timed from the fault, so
    # start-up and the steps before it (~15 s here, minutes on a loaded machine) do not count
    assert fault_at.is_file(), "rank 1 never reached the fault"
    waited = ended - float(fault_at.read_text())
    assert 0 < waited < 300, waited


def test_ranks_stop_a_diverged_ddp_run_together(tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    """Only rank 1's loss is infinite (its batch overflowed), at two log steps in a row: both ranks stop at
    the same step and the run ends; a rank stopping alone would leave the other in its next all-reduce."""
    fault = ["+callbacks.fault._target_=fault_injection.NonFiniteLossAt", "+callbacks.fault.steps=[4,5]",
             "+callbacks.fault.rank=1", "test=false"]  # fmt: skip
    run = run_cli("train.py", [*_ddp(tiny_cifar, data_cache, tmp_path), *fault], env={"PYTHONPATH": TESTS})
    assert run.returncode == 0, run.stderr[-3000:]
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 6
    report = (tmp_path / "report.md").read_text()
    assert "| stopped | by a NaN or infinite training loss (diverged) at step 6 (epoch 0) |" in report
