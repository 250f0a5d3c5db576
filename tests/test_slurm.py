"""Against a real SLURM (slurmctld + slurmd + munged on this machine, see slurm_cluster.py): a 2-task srun DDP
run, the repository's sbatch script signalled mid-epoch, requeued and resumed to the same weights, a
2-point submitit sweep, and a task count that disagrees with the trainer."""

import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from helpers import LAUNCH_VARS, PYTHON, ROOT, tiny_overrides
from slurm_cluster import SlurmCluster, unavailable

pytestmark = pytest.mark.slow
SBATCH_1NODE = ROOT / "scripts" / "slurm" / "train_1node.sbatch"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory):
    reason = unavailable()
    if reason:
        if os.environ.get("CI"):  # CI installs SLURM (.ci/run): a skip there would hide a broken set-up
            pytest.fail(reason)
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    cluster.start()
    yield cluster
    cluster.stop()


def _job_env(warm_python: str) -> dict[str, str]:
    env = {
        # `python` in the sbatch script and the srun commands: this venv's, through the warm shim
        "PATH": f"{warm_python}:{Path(PYTHON).parent}:{os.environ['PATH']}",
        # the submitit job unpickles our task function: vitrain must be importable (or pip install -e .)
        "PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'tests'}",
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",  # two tasks on two cores
    }
    return env


def _clean(env: dict[str, str]) -> dict[str, str]:
    """Without what a launcher sets (helpers.LAUNCH_VARS): none may leak from the test runner into a job."""
    for var in LAUNCH_VARS:
        env.pop(var, None)
    return env


@pytest.fixture(autouse=True)
def _no_launcher_vars(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)


def _overrides(tiny_cifar: Path, data_cache: Path, logs: Path) -> list[str]:
    # no augmentation: the weights then depend on the data order and the weights alone, which resume restores
    return [
        *tiny_overrides(tiny_cifar, data_cache),
        "datamodule.augment=false",
        "trainer.max_epochs=2",
        "logger=csv",
        "test=false",
        f"paths.log_dir={logs}",
    ]


def _last(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")


@pytest.fixture(scope="module")
def srun_ddp(
    slurm: SlurmCluster, warm_python: str, tmp_path_factory, tiny_cifar: Path, data_cache: Path
) -> dict:
    """`srun --ntasks=2 python src/train.py ... trainer=ddp trainer.devices=2`, as in an allocation."""
    logs = tmp_path_factory.mktemp("srun-logs")
    done = slurm.run(
        "srun",
        "--job-name=ddp-ref",
        "--nodes=1",
        "--ntasks-per-node=2",
        "--cpus-per-task=1",
        "python",
        "src/train.py",
        *_overrides(tiny_cifar, data_cache, logs),
        "trainer=ddp",
        "trainer.devices=2",
        "trainer.num_nodes=1",
        env=_job_env(warm_python),
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    (run_dir,) = (logs / "train" / "runs").iterdir()
    return {"run_dir": run_dir, "output": done.stdout + done.stderr}


def test_srun_two_task_ddp(srun_ddp: dict):
    run_dir, output = srun_ddp["run_dir"], srun_ddp["output"]
    assert run_dir.name.startswith("ddp-ref-"), "run dir named after the job, the same on both tasks"
    assert "MEMBER: 2/2" in output  # Lightning's SLURMEnvironment: two ranks from srun
    last = _last(run_dir)
    assert last["epoch"] == 1 and last["global_step"] == 2 * 28


def test_srun_eval_and_predict_on_two_tasks_equal_one(
    srun_ddp: dict, slurm: SlurmCluster, warm_python: str, tmp_path: Path, tiny_cifar: Path
):
    """`srun --ntasks=2 python src/eval.py|predict.py ... trainer=ddp trainer.devices=2`: SLURM's two tasks
    share the work (Lightning's SLURMEnvironment), and the metrics and the rows equal one process's."""
    import csv
    import json

    from helpers import compose_cfg, predicted
    from vitrain.tasks.evaluation import evaluate

    last = srun_ddp["run_dir"] / "checkpoints" / "last.ckpt"
    fp32 = ["trainer.precision=32-true", "extras.print_config=false"]
    two = ["trainer=ddp", "trainer.devices=2", "trainer.num_nodes=1"]

    def srun(script: str, *args: str) -> str:
        done = slurm.run(
            "srun", f"--job-name={script}", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1",
            "python", f"src/{script}.py", *args, *fp32, *two,
            env=_job_env(warm_python), cwd=ROOT, check=False,
        )  # fmt: skip
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
        return done.stdout + done.stderr

    output = srun("eval", f"ckpt_path={last}", "split=test", f"hydra.run.dir={tmp_path / 'eval2'}")
    assert "MEMBER: 2/2" in output
    single = evaluate(compose_cfg("eval", [f"ckpt_path={last}", "split=test", *fp32], tmp_path / "eval1"))[0]
    both = json.loads((tmp_path / "eval2" / "metrics.json").read_text())
    assert sum(both["per_class_images"].values()) == 40
    assert {k: both[k] for k in single} == pytest.approx(single, rel=1e-6)

    rows = predicted(last, tiny_cifar / "test", tmp_path / "predict1", "batch_size=3")
    output = srun(
        "predict", f"ckpt_path={last}", f"inputs={tiny_cifar / 'test'}", "batch_size=3",
        f"hydra.run.dir={tmp_path / 'predict2'}",
    )  # fmt: skip
    assert output.count("40 images classified by") == 1, output[-3000:]
    with open(tmp_path / "predict2" / "predictions.csv", newline="") as f:
        shared = list(csv.DictReader(f))
    assert [(r["file"], r["class"]) for r in shared] == [(r["file"], r["class"]) for r in rows]
    for ours, reference in zip(shared, rows, strict=True):
        assert float(ours["probability"]) == pytest.approx(float(reference["probability"]), abs=2e-6)


def test_sbatch_signalled_mid_epoch_requeues_and_resumes_to_the_same_weights(
    slurm: SlurmCluster, warm_python: str, srun_ddp: dict, tmp_path: Path, tiny_cifar: Path, data_cache: Path
):
    """scripts/slurm/train_1node.sbatch with 2 tasks; SIGUSR1 (the time-limit warning) at step 25: the ranks
    agree to stop at step 30, save `last`, rank zero requeues the job, the second attempt resumes mid-epoch in
    the same run dir and ends with the weights of the uninterrupted srun run."""
    logs = tmp_path / "logs"
    submitted = slurm.run(
        "sbatch",
        "--parsable",
        "--job-name=requeue",
        "--ntasks-per-node=2",
        "--cpus-per-task=1",
        "--gpus-per-node=0",
        f"--output={tmp_path}/%x-%j.out",
        str(SBATCH_1NODE),
        *_overrides(tiny_cifar, data_cache, logs),
        "trainer.plugins.0.background=true",  # the requeue waits for the save's background write
        "+callbacks.fault._target_=fault_injection.SlurmSignalAt",
        "+callbacks.fault.step=25",
        env=_job_env(warm_python),
        cwd=ROOT,
    )
    job = submitted.stdout.strip().split(";")[0]
    output = tmp_path / f"requeue-{job}.out"
    # SLURM holds a requeued batch job for about two minutes (BeginTime) before it may start again: release it.
    # Not within the second of the kill: slurmd revoked the first attempt's credential then, and refuses a start
    # whose time (in whole seconds) is not after it ("Killing non-startable batch job: Job credential revoked":
    # the job FAILED)
    slurm.wait(job, lambda info: int(info.get("Restarts", 0)) >= 1 and info["JobState"] == "PENDING")
    time.sleep(2)
    slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    info = slurm.wait(job, lambda info: info["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"))
    text = output.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", text[-4000:]
    assert "SLURM requeue signal: saved" in text and "at step 30" in text, text[-4000:]
    assert "resume=auto" in text and "Restoring states from the checkpoint path" in text

    (run_dir,) = (logs / "train" / "runs").iterdir()
    assert run_dir.name == f"requeue-{job}", "the requeued attempt wrote into the same run dir"
    last = _last(run_dir)
    assert last["global_step"] == 2 * 28
    reference = _last(srun_ddp["run_dir"])["state_dict"]
    different = [k for k in reference if not torch.equal(reference[k], last["state_dict"][k])]
    assert not different, f"weights differ from the uninterrupted run: {different[:5]}"


def test_task_count_that_disagrees_with_the_trainer_stops_in_one_line(
    slurm: SlurmCluster, warm_python: str, tmp_path: Path, tiny_cifar: Path, data_cache: Path
):
    done = slurm.run(
        "srun",
        "--job-name=mismatch",
        "--ntasks-per-node=1",
        "python",
        "src/train.py",
        *_overrides(tiny_cifar, data_cache, tmp_path / "logs"),
        "trainer=ddp",
        "trainer.devices=2",
        env=_job_env(warm_python),
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert lines == [
        "error: SLURM started SLURM_NTASKS=1 tasks but trainer.num_nodes x trainer.devices = 1 x 2 = 2: one task "
        "per device, e.g. trainer.devices=$SLURM_NTASKS_PER_NODE trainer.num_nodes=$SLURM_NNODES (scripts/slurm/)"
    ], done.stderr[-3000:]
    assert "Traceback" not in done.stderr


def test_submitit_sweep_runs_one_slurm_job_per_point(
    slurm: SlurmCluster, warm_python: str, tmp_path: Path, tiny_cifar: Path, data_cache: Path
):
    logs = tmp_path / "logs"
    env = _clean({**slurm.env, **_job_env(warm_python)})
    # the launching process started by the jobs' `python` (warm): submitit's jobs run `<sys.executable> -m
    # submitit.core._submit`, so they are warm too
    done = subprocess.run(
        [
            os.path.join(warm_python, "python"),
            "src/train.py",
            "-m",
            "hydra/launcher=submitit_slurm",
            f"hydra.launcher.submitit_folder={tmp_path}/submitit/%j",
            "hydra.launcher.cpus_per_task=1",
            "hydra.launcher.tasks_per_node=1",
            "hydra.launcher.timeout_min=10",
            *[o for o in _overrides(tiny_cifar, data_cache, logs) if not o.startswith("trainer.max_epochs")],
            "trainer.max_epochs=1",
            "seed=1,2",
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    (sweep,) = (logs / "train" / "multiruns").iterdir()
    for point in ("0", "1"):
        assert (sweep / point / "checkpoints" / "last.ckpt").is_file(), sorted(sweep.rglob("*"))
    assert (sweep / "summary.md").is_file(), "the launching process writes the sweep's summary"
    job_logs = sorted(p.name for p in (tmp_path / "submitit").rglob("*_log.out"))
    assert len(job_logs) == 2, job_logs  # one SLURM (array) job per sweep point
    points = {(sweep / p / ".hydra" / "overrides.yaml").read_text().count("seed=") for p in ("0", "1")}
    assert points == {1}
    assert {"seed=1" in (sweep / p / ".hydra" / "overrides.yaml").read_text() for p in ("0", "1")} == {
        True,
        False,
    }
