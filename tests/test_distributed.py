"""Distributed training for real, on this machine: gloo over 127.0.0.1, 2 processes, a tiny ViT, 3 steps.

One DDP run and one FSDP run (2 processes each) serve several tests: world size, metrics exactly equal to
one process on a validation set of 9 (odd, so the ranks get 5 and 4 images, in 3 and 2 batches), and
weights equal to one process after the same 3 global batches. Two "nodes" run the seed's command.
"""

import csv
import json
import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import hydra
import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from helpers import ROOT, TINY_VIT, assert_plain, compose_cfg, predicted, run_cli, tiny_overrides
from vitrain import checkpoints
from vitrain.distributed.ddp import DDPStrategy
from vitrain.distributed.fsdp import ONE_PROCESS
from vitrain.distributed.ranks import devices_per_node, global_rank_from_env
from vitrain.tasks.evaluation import evaluate
from vitrain.tasks.runs import run_id
from vitrain.tasks.training import train
from warm import ScriptRun, run_script

RUN_TIMEOUT = 240  # seconds for one multi-process run on 2 slow cores (normally 20-40 s)
STEPS = 3


def overrides(data: Path, cache: Path) -> list[str]:
    """The same 3 global batches of 8 for every world size: no augmentation, no drop-path."""
    return [
        *tiny_overrides(data, cache, batch_size=8),
        "datamodule.val_size=9",
        "datamodule.eval_batch_size=4",
        "datamodule.augment=false",
        f"+trainer.limit_train_batches={STEPS}",
        "logger=csv",
    ]


@dataclass
class Run:
    dir: Path
    output: str


# what a launcher sets: none of it may leak from the test runner into the runs
LAUNCH_VARS = ("LOCAL_RANK", "RANK", "GROUP_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID", "VITRAIN_RUN_ID", "PROJECT_ROOT")  # fmt: skip


def launch_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    return {**env, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(target: list, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess:
    """`torchrun --nnodes=1 --nproc-per-node=2 <target...>`: the launcher warm (tests/warm.py), its two
    workers new interpreters."""
    launcher = [
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc-per-node=2",
        f"--master-port={free_port()}",
    ]
    return run_script([*launcher, *target], launch_env(), ROOT, timeout)


def launch(run_dir: Path, args: list[str], use_torchrun: bool = False, fresh: bool = False) -> Run:
    """`python src/train.py ...` (Lightning starts the other local rank) or the same under torchrun;
    `fresh`: new interpreters all through, not warm ones (tests/warm.py)."""
    args = [*args, f"hydra.run.dir={run_dir}"]
    if use_torchrun:
        done = torchrun([ROOT / "src" / "train.py", *args])
    else:
        done = run_cli("train.py", args, timeout=RUN_TIMEOUT, fresh=fresh)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return Run(run_dir, output)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory: pytest.TempPathFactory, tiny_cifar: Path, data_cache: Path) -> Path:
    """One process, in-process: the reference for the weights.

    Training always samples with DistributedSampler (seed, epoch): the k-th batches of N replicas together
    are the k-th batch of one replica, so this run sees exactly the global batches of the 2-process runs.
    """
    run_dir = tmp_path_factory.mktemp("single")
    train(compose_cfg("train", [*overrides(tiny_cifar, data_cache), "test=false"], run_dir))
    return run_dir


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory, tiny_cifar: Path, data_cache: Path) -> Run:
    """New interpreters, as a user's run: Lightning starts rank 1 with `sys.executable` and the command line
    (the suite's other DDP runs are warm)."""
    args = [*overrides(tiny_cifar, data_cache), "trainer=ddp", "trainer.devices=2"]
    return launch(tmp_path_factory.mktemp("ddp") / "run", args, fresh=True)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory, tiny_cifar: Path, data_cache: Path) -> Run:
    """Launched by torchrun (the resume test below uses Lightning's own launcher for FSDP)."""
    args = [*overrides(tiny_cifar, data_cache), "trainer=fsdp", "trainer.devices=2"]
    return launch(tmp_path_factory.mktemp("fsdp") / "run", args, use_torchrun=True)


def val_metrics(run_dir: Path) -> dict[str, float]:
    """The run's epoch-0 validation metrics, from the CSV logger."""
    with (run_dir / "csv" / "metrics.csv").open() as f:
        rows = [row for row in csv.DictReader(f) if row.get("val/loss")]
    assert len(rows) == 1, rows
    return {k: float(v) for k, v in rows[0].items() if k.startswith("val/")}


def weights(path: Path) -> dict[str, torch.Tensor]:
    state = checkpoints.load(path)["state_dict"]
    return {k: v.float() for k, v in state.items() if k.startswith("net.")}


def assert_world_size_2(output: str) -> None:
    assert "All distributed processes registered. Starting with 2 processes" in output
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in output


# --- one machine, two processes -----------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(RUN_TIMEOUT)
def test_ddp_two_processes(ddp_run: Run):
    assert_world_size_2(ddp_run.output)
    assert (ddp_run.dir / "checkpoints" / "last.ckpt").is_file()
    assert "test/acc1" in ddp_run.output  # fit, then test of the best checkpoint, on both ranks


@pytest.mark.distributed
@pytest.mark.timeout(RUN_TIMEOUT)
def test_fsdp_two_processes_saves_shards(fsdp_run: Run):
    assert_world_size_2(fsdp_run.output)
    last = fsdp_run.dir / "checkpoints" / "last.ckpt"
    assert last.is_dir() and (last / ".metadata").is_file() and (last / "meta.pt").is_file()
    assert sorted(p.name for p in last.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert "FSDPVisionTransformer" in fsdp_run.output  # the model summary shows the sharded net
    assert "test/acc1" in fsdp_run.output  # the sharded best checkpoint reloads for testing
    assert ONE_PROCESS not in fsdp_run.output  # two processes: sharded, no warning


@pytest.mark.timeout(RUN_TIMEOUT)
def test_fsdp_on_one_process_says_it_shards_nothing(tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    """FSDP over one process trains, and says in one line that it saves nothing and costs host time."""
    run = launch(tmp_path / "run", [*overrides(tiny_cifar, data_cache), "trainer=fsdp", "trainer.devices=1"])
    assert ONE_PROCESS in run.output and run.output.count(ONE_PROCESS) == 1
    assert "test/acc1" in run.output


@pytest.mark.distributed
@pytest.mark.timeout(RUN_TIMEOUT)
@pytest.mark.parametrize("name", ["ddp_run", "fsdp_run"])
def test_checkpoints_are_plain(name: str, request: pytest.FixtureRequest):
    """`torch.load(weights_only=True)` reads the DDP file and the FSDP folder's meta.pt (rank 0's RNG
    states and those gathered from rank 1 included); the folder loads whole with checkpoints.load."""
    run: Run = request.getfixturevalue(name)
    last = run.dir / "checkpoints" / "last.ckpt"
    meta = torch.load(last / "meta.pt" if last.is_dir() else last, weights_only=True)
    assert_plain(meta, name)
    assert len(meta["rng_states_per_rank"]) == 2 and meta["hyper_parameters"]["optimizer"]["_target_"]
    assert "state_dict" in checkpoints.load(last)


@pytest.mark.distributed
@pytest.mark.timeout(RUN_TIMEOUT)
def test_fsdp_one_file_checkpoint_is_plain(tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    """`save_distributed_checkpoint=false`: rank 0 writes one file; testing reloads the best one."""
    args = [*overrides(tiny_cifar, data_cache), "trainer=fsdp", "trainer.devices=2",
            "trainer.strategy.save_distributed_checkpoint=false"]  # fmt: skip
    run = launch(tmp_path / "run", args)
    assert "test/acc1" in run.output
    last = run.dir / "checkpoints" / "last.ckpt"
    assert last.is_file()
    checkpoint = torch.load(last, weights_only=True)
    assert_plain(checkpoint, "last.ckpt")
    assert any(k.startswith("net.") for k in checkpoint["state_dict"])


@pytest.mark.distributed
@pytest.mark.timeout(2 * RUN_TIMEOUT)
@pytest.mark.parametrize("name", ["ddp_run", "fsdp_run"])
def test_weights_equal_single_process(
    name: str,
    request: pytest.FixtureRequest,
    single_run: Path,
    tmp_path: Path,
    tiny_cifar: Path,
    data_cache: Path,
):
    """2 processes x 4 images = 1 process x 8 images, step for step (AdamW, warm-up, label smoothing)."""
    run: Run = request.getfixturevalue(name)
    ours = weights(run.dir / "checkpoints" / "last.ckpt")
    reference = weights(single_run / "checkpoints" / "last.ckpt")
    assert ours.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(ours[key], value, rtol=1e-4, atol=5e-5, msg=key)
    initial = initial_weights(tiny_cifar, data_cache, tmp_path)
    moved = max((reference[k] - initial[k]).abs().max().item() for k in reference)
    assert moved > 1e-3, "the weights must have trained for the comparison to mean anything"


@pytest.mark.distributed
@pytest.mark.timeout(2 * RUN_TIMEOUT)
def test_fine_tune_from_the_fsdp_runs_checkpoint_folder(fsdp_run: Run, tmp_path: Path):
    """`model.weights_file=<the FSDP run's last.ckpt folder>` starts a model for other classes from the
    weights the run saved sharded (consolidated here, in one process), its head resized; the run's directory
    instead is refused in one line that names a checkpoint in it, for this key."""
    last = fsdp_run.dir / "checkpoints" / "last.ckpt"
    assert last.is_dir()
    saved = weights(last)
    cfg = compose_cfg("train", [*TINY_VIT, f"model.weights_file={last}", "model.net.num_classes=3"], tmp_path)
    model = hydra.utils.instantiate(cfg.model)
    assert model.net.head.out_features == 3
    body = {f"net.{k}": v for k, v in model.net.state_dict().items() if not k.startswith("head.")}
    assert body.keys() == {k for k in saved if not k.startswith("net.head.")}
    for key, value in body.items():
        assert torch.equal(value, saved[key]), key

    cfg.model.weights_file = str(fsdp_run.dir)
    with pytest.raises(hydra.errors.InstantiationException) as info:
        hydra.utils.instantiate(cfg.model)
    message = str(info.value.__cause__)
    assert "is a folder but not a sharded checkpoint" in message, message
    assert f"model.weights_file={last}" in message and "\n" not in message, message


def initial_weights(data: Path, cache: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """The weights every run starts from: train.py seeds with 42 before building the model."""
    cfg = compose_cfg("train", [*overrides(data, cache), "model.net.num_classes=10"], tmp_path)
    L.seed_everything(cfg.seed)
    model = hydra.utils.instantiate(cfg.model)
    return {k: v.float() for k, v in model.state_dict().items() if k.startswith("net.")}


@pytest.mark.distributed
@pytest.mark.timeout(2 * RUN_TIMEOUT)
@pytest.mark.parametrize("name", ["ddp_run", "fsdp_run"])
def test_val_metrics_exact_and_eval_on_one_process(name: str, request: pytest.FixtureRequest, tmp_path: Path):
    """World size 2 on 9 validation images (5 + 4, uneven batch counts) = `src/eval.py` on one process."""
    run: Run = request.getfixturevalue(name)
    distributed = val_metrics(run.dir)
    done = run_cli(
        "eval.py",
        # the run validated in fp32: eval's default `auto` picks bf16 on a CPU whose native bf16 measures faster
        [
            f"ckpt_path={run.dir / 'checkpoints' / 'last.ckpt'}",
            "split=val",
            "trainer.precision=32-true",
            f"hydra.run.dir={tmp_path}",
        ],
        timeout=RUN_TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    single = json.loads((tmp_path / "metrics.json").read_text())
    assert distributed["val/acc1"] == pytest.approx(single["val/acc1"], abs=1e-7)
    assert distributed["val/acc5"] == pytest.approx(single["val/acc5"], abs=1e-7)
    # a padded (repeated) sample would move the mean loss far more than float noise
    assert distributed["val/loss"] == pytest.approx(single["val/loss"], rel=1e-6)


@pytest.mark.distributed
@pytest.mark.timeout(3 * RUN_TIMEOUT)
@pytest.mark.parametrize("name", ["ddp_run", "fsdp_run"])
def test_eval_and_predict_on_two_processes_equal_one(
    name: str, request: pytest.FixtureRequest, tiny_cifar: Path, tmp_path: Path
):
    """`src/eval.py` and `src/predict.py` on the run's own 2 processes: eval's metrics and its images per class
    (both ranks', not rank zero's), predict's rows (in the files' order) and labelled-set metrics equal one
    process's. 41 files by 5: the ranks get 21 and 20, in 5 and 4 batches; the FSDP checkpoint is a folder,
    and its prediction is launched by torchrun."""
    run: Run = request.getfixturevalue(name)
    last = run.dir / "checkpoints" / "last.ckpt"
    trainer = [f"trainer={name.removesuffix('_run')}", "trainer.devices=2"]
    fp32 = ["trainer.precision=32-true", "extras.print_config=false"]

    single = evaluate(compose_cfg("eval", [f"ckpt_path={last}", "split=val", *fp32], tmp_path / "eval1"))[1]
    done = run_cli(
        "eval.py",
        [f"ckpt_path={last}", "split=val", *fp32, *trainer, f"hydra.run.dir={tmp_path / 'eval2'}"],
        timeout=RUN_TIMEOUT,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert_world_size_2(done.stdout + done.stderr)
    assert re.search(r"validation done in [\d:]+ \| 9 images \|", done.stdout + done.stderr)  # both ranks'
    two = json.loads((tmp_path / "eval2" / "metrics.json").read_text())
    assert sum(two["per_class_images"].values()) == 9, two["per_class_images"]
    assert two["per_class_images"] == single.per_class_images
    assert two["per_class_acc"] == pytest.approx(single.per_class_acc, abs=1e-7)
    one = json.loads((tmp_path / "eval1" / "metrics.json").read_text())
    assert {k: two[k] for k in one if k.startswith("val/")} == pytest.approx(
        {k: v for k, v in one.items() if k.startswith("val/")}, rel=1e-6
    )

    photos = tmp_path / "photos"
    shutil.copytree(tiny_cifar / "test", photos)
    shutil.copy(next((photos / "cat").iterdir()), photos / "cat" / "zz-extra.png")
    rows = predicted(last, photos, tmp_path / "predict1", "batch_size=5")
    assert len(rows) == 41
    args = [f"ckpt_path={last}", f"inputs={photos}", "batch_size=5", *fp32, *trainer]
    args.append(f"hydra.run.dir={tmp_path / 'predict2'}")
    # the FSDP run was launched by torchrun: its prediction too; DDP's by Lightning's launcher
    done = (
        torchrun([ROOT / "src" / "predict.py", *args]) if name == "fsdp_run" else run_cli("predict.py", args)
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert_world_size_2(output)
    assert output.count("41 images classified by") == 1  # rank zero writes and prints
    assert len(re.findall(r"predict done in [\d:]+ \| 41 images \|", output)) == 1
    with open(tmp_path / "predict2" / "predictions.csv", newline="") as f:
        both = list(csv.DictReader(f))
    assert [r["file"] for r in both] == [r["file"] for r in rows]
    assert [[r[k] for k in r if not k.startswith("probability")] for r in both] == [
        [r[k] for k in r if not k.startswith("probability")] for r in rows
    ]
    for ours, reference in zip(both, rows, strict=True):
        for key in (k for k in reference if k.startswith("probability")):
            assert float(ours[key]) == pytest.approx(float(reference[key]), abs=2e-6), (ours["file"], key)
    scored = [json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("predict1", "predict2")]
    assert scored[1]["per_class_images"] == scored[0]["per_class_images"]
    assert scored[1]["acc1"] == pytest.approx(scored[0]["acc1"], abs=1e-9)


@pytest.mark.distributed
@pytest.mark.timeout(2 * RUN_TIMEOUT)
def test_fsdp_resumes_from_sharded_checkpoint(
    fsdp_run: Run, tmp_path: Path, tiny_cifar: Path, data_cache: Path
):
    """`ckpt_path=last` continues the FSDP run: step counter, epoch and AdamW moments come back.

    The resumed run also turns on the other FSDP options (bf16 mixed precision, activation checkpointing,
    no resharding after forward, explicit prefetching of 2 blocks): they change neither the parameter names
    nor the fp32 sharded weights, so the checkpoint loads strictly into the re-wrapped model; its validation
    (different batch counts on the two ranks) runs with the prefetch lists set.
    """
    run_dir = tmp_path / "run"
    shutil.copytree(fsdp_run.dir / "checkpoints" / "last.ckpt", run_dir / "checkpoints" / "last.ckpt")
    args = [
        *overrides(tiny_cifar, data_cache),
        "trainer=fsdp",
        "trainer.devices=2",
        "trainer.max_epochs=2",
        "ckpt_path=last",
        "test=false",
        "trainer.strategy.mixed_precision=bf16",
        "trainer.strategy.activation_checkpointing=true",
        "trainer.strategy.reshard_after_forward=false",
        "trainer.strategy.prefetch=2",
    ]
    resumed = launch(run_dir, args)
    assert "Restored all states from the checkpoint" in resumed.output
    state = checkpoints.load(run_dir / "checkpoints" / "last.ckpt")
    assert state["epoch"] == 1 and state["global_step"] == 2 * STEPS
    adam_steps = {float(s["step"]) for s in state["optimizer_0"]["state"].values()}
    assert adam_steps == {2.0 * STEPS}, "AdamW state restored, not restarted"


# --- two nodes on loopback, launched by hand as the seeds do -------------------------------------

SEED_COMMAND = [
    "experiment=cifar",
    "trainer=ddp",
    "trainer.devices=1",
    "trainer.num_nodes=2",
    # trainer.default_root_dir=$(date +%Y-%m-%d_%H-%M-%S): each node's clock, given per node below
    "callbacks.model_checkpoint.dirpath=logs/train/runs",
    "datamodule.batch_size=384",
    "trainer.min_epochs=1",
    "trainer.max_epochs=10",
    "model.net.model_name=vit_base_patch32_224",
]


@pytest.mark.distributed
@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_two_nodes_by_env_vars_share_one_run(tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    tiny = [
        *TINY_VIT,
        f"datamodule.data_dir={tiny_cifar}",
        f"datamodule.cache_dir={data_cache}",
        "datamodule.batch_size=16",
        "datamodule.val_size=16",
        "trainer.accelerator=cpu",
        # experiment=cifar's `auto`: each node would measure the CPU's bf16 speed on its own
        "trainer.precision=32-true",
        "trainer.max_epochs=1",
        f"+trainer.limit_train_batches={STEPS}",
    ]
    port = str(free_port())
    base = launch_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2")
    nodes = []
    for node in (0, 1):
        # the nodes' clocks differ by a second: the run must not split
        target = [
            ROOT / "src" / "train.py",
            *SEED_COMMAND,
            f"trainer.default_root_dir=2026-01-01_00-00-0{node}",
            *tiny,
        ]
        nodes.append(ScriptRun(target, {**base, "NODE_RANK": str(node)}, tmp_path, merge_stderr=True))
    try:
        done = [p.wait(timeout=RUN_TIMEOUT) for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    for node, p in enumerate(done):
        assert p.returncode == 0, f"node {node}:\n{p.stdout[-4000:]}"
    node0, node1 = (p.stdout for p in done)
    assert_world_size_2(node0 + node1)

    runs = tmp_path / "logs" / "train" / "runs"
    run_dirs = [p for p in runs.iterdir() if p.is_dir()]
    assert len(run_dirs) == 1 and run_dirs[0].name.startswith(f"127.0.0.1-{port}-"), run_dirs
    run = run_dirs[0]
    ckpts = sorted(p.name for p in runs.glob("*.ckpt"))
    assert len(ckpts) == 2 and "last.ckpt" in ckpts, ckpts  # best + last, once, where the seed put them
    tb_dirs = {p.parent for p in tmp_path.rglob("events.out.tfevents.*")}
    assert tb_dirs == {run / "tensorboard"}
    assert not list(tmp_path.glob("2026-*")), "default_root_dir is not where anything goes"
    # rank-zero work happens once: node 1 neither prints the config tree nor logs the output dir
    assert "CONFIG" in node0 and "CONFIG" not in node1
    assert (run / "config_tree.log").is_file()
    assert "Output dir" in node0 and "Output dir" not in node1
    assert "[rank: 1] Testing the best checkpoint" in node1  # other ranks' log lines say who they are


# --- no processes: launch environment, run-dir agreement, compression hooks ----------------------


def test_global_rank_from_env():
    assert global_rank_from_env(4, {}) == 0
    assert global_rank_from_env(4, {"RANK": "5", "NODE_RANK": "0"}) == 5  # torchrun
    assert global_rank_from_env(4, {"NODE_RANK": "1"}) == 4  # node 1's launching process
    assert global_rank_from_env(4, {"NODE_RANK": "1", "LOCAL_RANK": "3"}) == 7  # its 4th process
    assert global_rank_from_env(4, {"LOCAL_RANK": "2", "SLURM_PROCID": "0"}) == 2
    assert global_rank_from_env(4, {"SLURM_PROCID": "6"}) == 6  # srun
    assert (
        devices_per_node(2)
        == devices_per_node("2")
        == devices_per_node([0, 1])
        == devices_per_node("0,1")
        == 2
    )
    assert devices_per_node("auto", "cpu") == 1


def test_run_id_agrees_across_nodes_and_relaunches():
    env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "NODE_RANK": "0"}
    cmd = ["experiment=cifar", "trainer=ddp", "trainer.num_nodes=2", "datamodule.batch_size=384"]
    first = run_id(env, [*cmd, "trainer.default_root_dir=2026-01-01_00-00-00"])
    assert first.startswith("10.0.0.1-29500-")
    # another node, another clock, a relaunch that resumes, Lightning's children: the same run
    assert run_id({**env, "NODE_RANK": "1"}, [*cmd, "trainer.default_root_dir=2026-01-01_00-00-01"]) == first
    assert run_id(env, [*cmd, "ckpt_path=last", "hydra.run.dir=x"]) == first
    # another experiment or another rendezvous: another run
    assert run_id(env, [*cmd[:-1], "datamodule.batch_size=256"]) != first
    assert run_id({**env, "MASTER_PORT": "29501"}, cmd) != first
    # launcher ids and an explicit name win; torchrun's default id "none" does not count
    assert run_id({**env, "TORCHELASTIC_RUN_ID": "none"}, cmd) == run_id(env, cmd)
    assert run_id({**env, "TORCHELASTIC_RUN_ID": "job7"}, cmd) == "job7"
    assert run_id({**env, "SLURM_JOB_ID": "123", "VITRAIN_RUN_ID": "mine"}, cmd) == "mine"
    # a single process: the start time
    assert run_id({}, cmd)[:2] == "20"


def test_ddp_compression_options():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    assert DDPStrategy(gradient_compression="bf16").comm_hook is default_hooks.bf16_compress_hook
    strategy = DDPStrategy(gradient_compression="powersgd", powersgd_rank=2, powersgd_start_iter=10)
    assert strategy.comm_hook is powerSGD_hook.powerSGD_hook
    assert strategy.comm_state.matrix_approximation_rank == 2
    with pytest.raises(ValueError, match="gradient_compression"):
        DDPStrategy(gradient_compression="int8")


class _Wrapped(L.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_compression_hook_runs_on_cpu(tmp_path: Path):
    """Lightning registers comm hooks on CUDA only; ours run on gloo too: bf16 rounds the gradients."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        net = nn.Linear(64, 64)
        x = torch.randn(8, 64)
        strategy = DDPStrategy(gradient_compression="bf16", parallel_devices=[torch.device("cpu")])
        strategy.model = _Wrapped(net)
        strategy.configure_ddp()  # what Lightning's setup calls: DDP-wraps the model, then our hook on CPU
        assert isinstance(strategy.model, DistributedDataParallel)
        strategy.model(x).square().sum().backward()
        grad = net.weight.grad.clone()
        exact = torch.func.grad(lambda w: torch.nn.functional.linear(x, w, net.bias).square().sum())(
            net.weight
        )
        torch.testing.assert_close(grad, exact.bfloat16().float())
        assert not torch.equal(grad, exact)
    finally:
        dist.destroy_process_group()
