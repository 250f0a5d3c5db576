"""Faults in multi-process runs: SIGTERM saves once for all ranks; a dead or hung peer ends the run."""

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from helpers import PYTHON, ROOT, run_cli, tiny_overrides

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
    overrides = _ddp(tiny_cifar, data_cache, tmp_path)
    stopped = run_cli(
        "train.py",
        [*overrides, "+callbacks.fault._target_=fault_injection.SigtermAt", "+callbacks.fault.step=5"],
        env={"PYTHONPATH": TESTS},
        start_new_session=True,
    )
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 10  # signalled after step 5; the ranks agree every 10 steps

    resumed = run_cli("train.py", [*overrides, "ckpt_path=last"], env={"PYTHONPATH": TESTS})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    final = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert final["epoch"] == 1 and final["global_step"] == 2 * 28  # 224 images / global batch 8, 2 epochs


@pytest.mark.parametrize("fault", ["KILL", "STOP"])
def test_lost_peer_ends_the_run_within_the_timeout(
    fault: str, tmp_path: Path, tiny_cifar: Path, data_cache: Path
):
    """Rank 1 dies (KILL) or hangs (STOP) at step 3: rank 0 exits with a clear error, within the timeout."""
    timeout_s = 15
    overrides = [
        *_ddp(tiny_cifar, data_cache, tmp_path),
        f"trainer.strategy.timeout.minutes={timeout_s / 60}",
        "+callbacks.fault._target_=fault_injection.SignalRankAt",
        "+callbacks.fault.rank=1",
        "+callbacks.fault.step=3",
        f"+callbacks.fault.signal_name={fault}",
    ]
    env = {**os.environ, "PYTHONPATH": TESTS, "HF_HUB_OFFLINE": "1"}
    started = time.monotonic()
    # output to a file, not a pipe: the stopped rank 1 keeps inherited pipes open after rank 0 has exited
    with (tmp_path / "stderr.txt").open("w") as err_file:
        proc = subprocess.Popen(
            [PYTHON, str(ROOT / "src" / "train.py"), *overrides],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err_file,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=240)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the stopped rank 1 is still in the group
    waited = time.monotonic() - started
    stderr = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 3, stderr[-3000:]
    assert "lost contact with another process of this run" in stderr
    assert "Traceback" not in stderr.split("lost contact")[-1]
    # start-up and 3 steps take ~15 s here; the hang must end at the collective timeout, not at 30 minutes
    assert waited < 120, waited
