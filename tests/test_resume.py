"""A killed run resumes to the same weights as the run left alone; SIGTERM saves before exiting."""

import signal
from pathlib import Path

import pytest
import torch

from helpers import ROOT, run_cli, tiny_overrides

TESTS = str(ROOT / "tests")


def _overrides(tiny_cifar: Path, data_cache: Path, run_dir: Path) -> list[str]:
    # augmentation and drop-path on: both draw random numbers, which a resume must restore
    return [
        *tiny_overrides(tiny_cifar, data_cache),
        "model.net.drop_path_rate=0.1",
        "trainer.max_epochs=3",
        "logger=csv",
        f"hydra.run.dir={run_dir}",
    ]


def _run(overrides: list[str], **kwargs):
    return run_cli("train.py", overrides, env={"PYTHONPATH": TESTS}, **kwargs)


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["epoch"] == 2 and checkpoint["global_step"] == 3 * 28
    return checkpoint["state_dict"]


def _assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"weights differ: {different[:5]}"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_cifar: Path, data_cache: Path) -> dict[str, torch.Tensor]:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    done = _run(_overrides(tiny_cifar, data_cache, run_dir))
    assert done.returncode == 0, done.stderr[-3000:]
    return _final_weights(run_dir)


@pytest.mark.slow
def test_sigkill_at_epoch_boundary_then_resume_is_bitwise_identical(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path, uninterrupted
):
    overrides = _overrides(tiny_cifar, data_cache, tmp_path)
    killed = _run([*overrides, "+callbacks.fault._target_=fault_injection.KillAt", "+callbacks.fault.epoch=1"])
    assert killed.returncode == -signal.SIGKILL
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["epoch"] == 0

    resumed = _run([*overrides, "ckpt_path=last"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_bitwise_equal(_final_weights(tmp_path), uninterrupted)


@pytest.mark.slow
def test_sigterm_mid_epoch_saves_last_and_resumes_exactly(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path, uninterrupted
):
    overrides = _overrides(tiny_cifar, data_cache, tmp_path)
    stopped = _run(
        [*overrides, "+callbacks.fault._target_=fault_injection.SigtermAt", "+callbacks.fault.step=40"],
        start_new_session=True,
    )
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 40 and saved["epoch"] == 1, "saved mid-epoch, at the step it stopped"

    resumed = _run([*overrides, "ckpt_path=last"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # every batch trained exactly once: the same weights as the run that was never stopped
    _assert_bitwise_equal(_final_weights(tmp_path), uninterrupted)


def test_truncated_checkpoint_gives_a_clear_error(tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    bad = tmp_path / "last.ckpt"
    bad.write_bytes(b"PK\x03\x04 truncated")
    for script, args in (("eval.py", [f"ckpt_path={bad}"]),
                         ("train.py", [*tiny_overrides(tiny_cifar, data_cache), f"ckpt_path={bad}"])):
        done = run_cli(script, [*args, f"hydra.run.dir={tmp_path / script}"])
        assert done.returncode == 2, done.stderr[-3000:]
        assert "Traceback" not in done.stderr
        assert f"{bad}" in done.stderr and "truncated or corrupted" in done.stderr
