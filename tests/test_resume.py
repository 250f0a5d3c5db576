"""A killed run resumes to the same weights as the run left alone; SIGTERM saves before exiting."""

import csv
import json
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch

from helpers import ROOT, compose_cfg, epoch_figures, fails_in_process, run_cli, tiny_overrides
from warm import run_script

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
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["epoch"] == 2 and checkpoint["global_step"] == 3 * 28
    return checkpoint["state_dict"]


def _assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"weights differ: {different[:5]}"


@pytest.fixture(scope="module")
def uninterrupted_dir(tmp_path_factory, tiny_cifar: Path, data_cache: Path) -> Path:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    done = _run(_overrides(tiny_cifar, data_cache, run_dir))
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_dir: Path) -> dict[str, torch.Tensor]:
    return _final_weights(uninterrupted_dir)


@pytest.mark.slow
def test_sigkill_at_epoch_boundary_then_resume_is_bitwise_identical(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path, uninterrupted, uninterrupted_dir: Path
):
    overrides = _overrides(tiny_cifar, data_cache, tmp_path)
    killed = _run(
        [*overrides, "+callbacks.fault._target_=fault_injection.KillAt", "+callbacks.fault.epoch=1"]
    )
    assert killed.returncode == -signal.SIGKILL
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    # saved at the epoch's end: no metric state to carry into the next epoch
    assert saved["epoch"] == 0 and "training_epoch_metric_states" not in saved

    resumed = _run([*overrides, "ckpt_path=last"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_bitwise_equal(_final_weights(tmp_path), uninterrupted)
    assert epoch_figures(tmp_path)[1] == epoch_figures(uninterrupted_dir)[1]


@pytest.mark.slow
def test_sigterm_mid_epoch_saves_last_and_resumes_exactly(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path, uninterrupted, uninterrupted_dir: Path
):
    # checkpoints written in the background (`auto` on a GPU): the SIGTERM save is on disk before the exit
    overrides = [*_overrides(tiny_cifar, data_cache, tmp_path), "trainer.plugins.0.background=true"]
    stopped = _run(
        [*overrides, "+callbacks.fault._target_=fault_injection.SigtermAt", "+callbacks.fault.step=40"],
    )
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 40 and saved["epoch"] == 1, "saved mid-epoch, at the step it stopped"

    resumed = _run([*overrides, "ckpt_path=last"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # every batch trained exactly once: the same weights as the run that was never stopped
    _assert_bitwise_equal(_final_weights(tmp_path), uninterrupted)
    # and the interrupted epoch's training figures cover all its batches, not only those after the resume
    assert "training_epoch_metric_states" in saved
    assert epoch_figures(tmp_path)[1] == epoch_figures(uninterrupted_dir)[1]
    # the report says where this session started; the epoch it resumed in is timed from the resume (it used
    # to be timed from the clock's origin: no on_train_epoch_start for an epoch resumed in its middle)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["epochs"] == 3 and report["resumed_at"] == {"epoch": 1, "step": 40, "mid_epoch": True}
    stats = json.loads((tmp_path / "run_stats.json").read_text())["fit"]
    assert [e["epoch"] for e in stats["epochs"]] == [1, 2] and stats["epochs"][0]["partial"] is True
    assert all(e["wall_time_s"] <= stats["wall_time_s"] for e in stats["epochs"])
    assert report["time_per_epoch_s"] == stats["epochs"][1]["wall_time_s"]  # whole epochs only
    done = [
        ln
        for ln in (tmp_path / "train.log").read_text().splitlines()
        if re.search(r" epoch \d+ done in ", ln)
    ]
    assert "epoch 2 done in" in done[-2] and "since the resume" in done[-2], done
    assert "epoch 3 done in" in done[-1] and "since the resume" not in done[-1], done
    took = [int(part) for part in done[-2].split(" done in ")[1].split(" ")[0].split(":")]
    assert sum(v * 60**i for i, v in enumerate(reversed(took))) <= stats["wall_time_s"] + 1, done[-2]
    # logger=csv: the rows of the run before the resume are kept, the resumed run's appended
    with (tmp_path / "csv" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    steps = {int(r["step"]) for r in rows}
    assert {0, 39, 41, 3 * 28 - 1} <= steps, sorted(steps)
    assert [r["train/acc1"] for r in rows if r.get("train/acc1")] == [
        str(figures["train/acc1"]) for figures in epoch_figures(uninterrupted_dir).values()
    ]


def _curves(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every (step, value) of the loss, accuracy and LR curves in the run's metric record, in the order
    written, repeats included (the report itself keeps the last of a repeated step)."""
    curves: dict[str, list[tuple[int, float]]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for key, value in row.items():
            if key.startswith("lr") or key.split("/")[-1].startswith(("loss", "acc")):
                curves.setdefault(key, []).append((row["step"], value))
    return curves


@pytest.mark.slow
def test_a_kill_after_the_last_save_logs_no_step_twice(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path, uninterrupted, uninterrupted_dir: Path
):
    """SIGKILL at step 40, 12 steps after the epoch's save: the resumed run trains steps 28-39 again, and
    every logger that can drop what the killed run logged of them does. The curves equal the run left
    alone's, once each: TensorBoard (hidden as `purge_step` hides), CSV, the metric record."""
    overrides = [
        *_overrides(tiny_cifar, data_cache, tmp_path),
        "logger=[csv,tensorboard]",
        "trainer.plugins.0.background=true",  # as on a GPU: the kill comes once the save is on disk
    ]
    killed = _run(
        [*overrides, "+callbacks.fault._target_=fault_injection.KillAtStep", "+callbacks.fault.step=40"]
    )
    assert killed.returncode == -signal.SIGKILL
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 28
    assert max(step for step, _ in _curves(tmp_path)["train/loss_step"]) >= 38, (
        "the killed run logged past 28"
    )

    resumed = _run([*overrides, "ckpt_path=last"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_bitwise_equal(_final_weights(tmp_path), uninterrupted)
    expected = _curves(uninterrupted_dir)
    assert _curves(tmp_path) == expected

    with (tmp_path / "csv" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(int(r["step"]), float(r["train/loss_step"])) for r in rows if r["train/loss_step"]] == expected[
        "train/loss_step"
    ]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    for key in ("train/loss_step", "val/acc1"):
        shown = [(e.step, e.value) for e in events.Scalars(key)]
        assert [step for step, _ in shown] == [step for step, _ in expected[key]], key
        assert [value for _, value in shown] == pytest.approx([value for _, value in expected[key]], rel=1e-6)


def test_truncated_checkpoint_gives_a_clear_error(tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    bad = tmp_path / "last.ckpt"
    bad.write_bytes(b"PK\x03\x04 truncated")
    for task, args in (
        ("eval", [f"ckpt_path={bad}"]),
        ("train", [*tiny_overrides(tiny_cifar, data_cache), f"ckpt_path={bad}"]),
    ):
        code, stderr = fails_in_process(task, args, tmp_path / task)
        assert code == 2, stderr[-3000:]
        assert f"{bad}" in stderr and "truncated or corrupted" in stderr


def test_disk_full_while_saving_keeps_the_previous_checkpoint(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path, tiny_checkpoint: Path
):
    shutil.copytree(tiny_checkpoint, tmp_path, dirs_exist_ok=True)  # one trained epoch to go on from
    overrides = [*tiny_overrides(tiny_cifar, data_cache), "logger=csv", f"hydra.run.dir={tmp_path}"]
    last = tmp_path / "checkpoints" / "last.ckpt"
    before = last.read_bytes()

    # only `last` is saved: the failing write is the one that replaces a good checkpoint
    full = _run(
        [*overrides, f"ckpt_path={last}", "trainer.max_epochs=2", "callbacks.model_checkpoint.save_top_k=0"],
        file_size_limit=len(before) // 2,
    )
    assert full.returncode == 2, full.stderr[-3000:]
    assert "Traceback" not in full.stderr
    assert "no space left to save checkpoint" in full.stderr and "the previous one is intact" in full.stderr
    assert last.read_bytes() == before, "the good checkpoint was not touched"
    assert not list(last.parent.glob(".*tmp*")), "no temporary file left behind"


def test_resume_from_a_checkpoint_of_another_architecture(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path, tiny_checkpoint: Path
):
    overrides = [*tiny_overrides(tiny_cifar, data_cache), "logger=csv"]
    ckpt = tiny_checkpoint / "checkpoints" / "last.ckpt"  # trained with `overrides`, depth 2
    other = [o.replace("depth=2", "depth=3") for o in overrides]
    code, stderr = fails_in_process("train", [*other, f"ckpt_path={ckpt}"], tmp_path / "b")
    assert code == 2, stderr[-3000:]
    assert f"ckpt_path={ckpt} does not fit model vit_tiny_patch16_224" in stderr

    code, stderr = fails_in_process("train", [*overrides, f"ckpt_path={tmp_path}/nope.ckpt"], tmp_path / "c")
    assert code == 2 and f"ckpt_path={tmp_path}/nope.ckpt does not exist" in stderr


@pytest.mark.slow
def test_torchrun_restart_resumes_in_the_same_run_dir(tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    """`torchrun --max-restarts 1`: the killed worker is restarted and resumes from `last`."""
    marker = tmp_path / "killed-once"
    overrides = [
        *tiny_overrides(tiny_cifar, data_cache),
        "trainer.max_epochs=2",
        "logger=csv",
        # no ckpt_path: resume=auto starts the first attempt and resumes the restart (same rdzv id)
        f"paths.log_dir={tmp_path / 'logs'}",
        "+callbacks.fault._target_=fault_injection.KillAt",
        "+callbacks.fault.epoch=1",
        f"+callbacks.fault.once_file={marker}",
    ]
    env = {**os.environ, "PYTHONPATH": TESTS, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    torchrun = [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=1",
        "--max-restarts=1",
        "--monitor-interval=0.5",
    ]
    done = run_script([*torchrun, ROOT / "src" / "train.py", *overrides], env, ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert marker.exists(), "the first attempt was killed"
    run_dirs = list((tmp_path / "logs" / "train" / "runs").iterdir())
    assert len(run_dirs) == 1, f"the restart must reuse the run dir: {run_dirs}"
    checkpoint = torch.load(run_dirs[0] / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["epoch"] == 1 and checkpoint["global_step"] == 2 * 28
    assert "Restoring states from the checkpoint path" in done.stderr + done.stdout


# --- ckpt_path=last and resume=auto: never a silent fresh start ------------------------------------------


def _fake_run(runs: Path, name: str, overrides: list[str], with_last: bool = True) -> Path:
    run = runs / name
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if with_last:
        (run / "checkpoints").mkdir()
        (run / "checkpoints" / "last.ckpt").write_bytes(b"x")
    return run


def test_ckpt_path_last_finds_the_newest_run_of_the_same_overrides(tmp_path: Path, monkeypatch):
    from vitrain.tasks.runs import ResumeError, run_dir

    for var in ("VITRAIN_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    runs = tmp_path / "runs"
    older = _fake_run(runs, "2026-01-01_00-00-00", ["experiment=smoke"])
    newer = _fake_run(runs, "2026-01-02_00-00-00", ["experiment=smoke", "ckpt_path=last"])
    os.utime(older / "checkpoints" / "last.ckpt", (1, 1))
    _fake_run(runs, "2026-01-03_00-00-00", ["experiment=smoke", "seed=1"])  # another experiment
    _fake_run(runs, "2026-01-04_00-00-00", ["experiment=smoke"], with_last=False)  # nothing saved
    # where output goes and what to resume from do not make another experiment
    assert run_dir(str(runs), "last", ["experiment=smoke", "ckpt_path=last", "hydra.job.chdir=false"]) == str(
        newer
    )
    assert run_dir(str(runs), None, ["experiment=smoke"]).startswith(f"{runs}/20")  # a new run: a new dir
    with pytest.raises(ResumeError) as err:
        run_dir(str(runs), "last", ["experiment=cifar"])
    message = str(err.value)
    assert "\n" not in message and "2026-01-03_00-00-00" in message and "2026-01-01_00-00-00" in message
    assert "hydra.run.dir=" in message and "VITRAIN_RUN_ID=" in message
    assert "2026-01-04" not in message, "a run without `last` cannot be resumed"


def test_runs_started_in_the_same_second_get_directories_of_their_own(tmp_path: Path, monkeypatch):
    """`python src/train.py seed=1 & python src/train.py seed=2`: one run dir for both before (named by the
    second they started), each replacing the other's checkpoints and report. The second is `<stamp>_2`; the
    same for two sweeps (`-m`)."""
    from vitrain.tasks import runs

    for var in ("VITRAIN_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(runs, "run_id", lambda *args, **kwargs: "2026-11-30_12-00-00")
    first = runs.run_dir(str(tmp_path), None, ["experiment=smoke", "seed=1"])
    second = runs.run_dir(str(tmp_path), None, ["experiment=smoke", "seed=2"])
    assert (first, second) == (f"{tmp_path}/2026-11-30_12-00-00", f"{tmp_path}/2026-11-30_12-00-00_2")
    assert Path(first).is_dir() and Path(second).is_dir()
    # sweeps alike; a named one (a relaunch continues it) keeps its name
    sweeps = tmp_path / "multiruns"
    assert [runs.sweep_dir(str(sweeps)) for _ in range(2)] == [
        f"{sweeps}/2026-11-30_12-00-00",
        f"{sweeps}/2026-11-30_12-00-00_2",
    ]
    monkeypatch.setenv("VITRAIN_RUN_ID", "mine")
    assert runs.sweep_dir(str(sweeps)) == runs.sweep_dir(str(sweeps)) == f"{sweeps}/mine"


def test_slurm_run_dir_names_are_readable_and_survive_a_requeue():
    from vitrain.tasks.runs import run_id

    job = {"SLURM_JOB_ID": "4711", "SLURM_JOB_NAME": "vit-b32"}
    assert run_id(job) == "vit-b32-4711"
    assert run_id({**job, "SLURM_RESTART_COUNT": "1"}) == "vit-b32-4711"
    assert run_id({**job, "SLURM_JOB_NAME": "train_1node.sbatch"}) == "train_1node-4711"
    assert run_id({"SLURM_JOB_ID": "4711", "SLURM_JOB_NAME": "bash"}) == "slurm-4711"
    array = {**job, "SLURM_JOB_ID": "4713", "SLURM_ARRAY_JOB_ID": "4711", "SLURM_ARRAY_TASK_ID": "2"}
    assert run_id(array) == "vit-b32-4711_2"


def test_ckpt_path_last_resumes_in_the_run_it_continues_or_stops_in_one_line(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path
):
    """The same command plus `ckpt_path=last`: no new run dir, training continues; with nothing to resume,
    one line and exit 2 before any directory is made."""
    logs = tmp_path / "logs"
    overrides = [*tiny_overrides(tiny_cifar, data_cache), "logger=csv", "test=false", f"paths.log_dir={logs}"]
    nothing = _run([*overrides, "ckpt_path=last"])
    assert nothing.returncode == 2, nothing.stderr[-3000:]
    assert nothing.stderr.count("\n") == 1 and "ckpt_path=last" in nothing.stderr, nothing.stderr
    assert "Traceback" not in nothing.stderr and not logs.exists()

    assert _run(overrides).returncode == 0
    (first,) = (logs / "train" / "runs").iterdir()
    resumed = _run([*overrides, "ckpt_path=last", "trainer.max_epochs=2"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert list((logs / "train" / "runs").iterdir()) == [first], "resumed into the same run dir"
    assert torch.load(first / "checkpoints" / "last.ckpt", weights_only=True)["epoch"] == 1
    assert "Restoring states from the checkpoint path" in resumed.stderr + resumed.stdout
    assert "save_last=True" not in resumed.stderr + resumed.stdout  # Lightning's wrong hint


def test_rng_states_round_trip_through_a_checkpoint(tmp_path: Path):
    """The saved layout (torch, numpy, python; `torch.cuda` added by ExactResume) is the one checkpoints
    written with Lightning's seed utilities hold; Python's state comes back as a list after some saves."""
    import random

    import numpy as np

    from vitrain.callbacks.resume import collect_rng_states, set_rng_states

    torch.manual_seed(3)
    states = collect_rng_states()
    assert set(states) == {"torch", "numpy", "python"}
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.save({"rng_states": states}, tmp_path / "c.ckpt")
    saved = torch.load(tmp_path / "c.ckpt", weights_only=False)["rng_states"]
    version, state, gauss = saved["python"]
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    set_rng_states({**saved, "python": (version, list(state), gauss), "torch.cuda": []})
    torch.testing.assert_close(torch.rand(3), expected[0])
    assert (np.random.rand(3) == expected[1]).all() and random.random() == expected[2]


def test_last_is_saved_after_every_epoch_also_between_validations(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path
):
    """With `trainer.check_val_every_n_epoch=2`, `last.ckpt` still holds every epoch's end: Lightning's
    ModelCheckpoint would wait for a validation, and a run killed after the third epoch would lose it."""
    from vitrain.tasks.training import train

    overrides = [
        *tiny_overrides(tiny_cifar, data_cache),
        "trainer.max_epochs=3",
        "trainer.check_val_every_n_epoch=2",
        "logger=none",
        "test=false",
    ]
    _, objects = train(compose_cfg("train", overrides, tmp_path))
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["epoch"] == 2 and last["global_step"] == objects.trainer.global_step == 3 * 28
    assert [p.name for p in (tmp_path / "checkpoints").glob("epoch*.ckpt")] == [
        Path(objects.best_model_path).name
    ]
    assert Path(objects.best_model_path).name.startswith("epoch001-")  # the one validated epoch
