"""Bad input ends in one clear line on stderr and a non-zero exit, not a traceback."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from helpers import PYTHON, RANK_VARS, ROOT, compose_cfg, fails_in_process, run_cli, tiny_overrides
from vitrain.checkpoints import state_dict_mismatch
from vitrain.distributed.ranks import check_launch_env
from vitrain.errors import ModelError, UserError
from vitrain.models.timm_net import create_net
from vitrain.tasks.training import train


def _last_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _assert_clean_failure(done, *needles: str) -> None:
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    text = done.stderr
    for needle in needles:
        assert needle in text, f"{needle!r} not in stderr:\n{text[-2000:]}"


def _assert_one_line_exit_2(done: tuple[int, str], *needles: str) -> None:
    code, stderr = done
    assert code == 2, stderr[-2000:]
    assert _last_line(stderr).startswith("error: "), stderr[-2000:]
    for needle in needles:
        assert needle in stderr, f"{needle!r} not in stderr:\n{stderr[-2000:]}"


def test_missing_data_folder(tmp_path: Path, data_cache: Path):
    done = fails_in_process("train", tiny_overrides(tmp_path / "nowhere", data_cache), tmp_path / "run")
    _assert_one_line_exit_2(done, "nowhere", "datamodule.data_dir")


def test_eval_of_a_checkpoint_whose_data_moved_says_to_give_their_place(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path
):
    """eval.py reads the data where the checkpoint's run read them: on another machine, or once the folder
    moved, the one line says so and how to name their place; named, it evaluates."""
    import shutil

    data = tmp_path / "photos"
    shutil.copytree(tiny_cifar, data)
    overrides = [*tiny_overrides(data, data_cache), "logger=none", "test=false"]
    _, objects = train(compose_cfg("train", overrides, tmp_path / "run"))
    moved = data.rename(tmp_path / "photos_moved")
    ckpt = [f"ckpt_path={objects.best_model_path}", "split=val"]
    _assert_one_line_exit_2(
        fails_in_process("eval", ckpt, tmp_path / "eval"),
        f"(the checkpoint's run read its data from {data}: give their place on this machine with "
        "datamodule.data_dir=...)",
    )
    from vitrain.tasks.evaluation import evaluate

    given = [*ckpt, f"datamodule.data_dir={moved}", "trainer.precision=32-true"]  # as the run validated
    metrics, _ = evaluate(compose_cfg("eval", given, tmp_path / "eval2"))
    assert metrics["val/acc1"] == pytest.approx(float(objects.trainer.checkpoint_callback.best_model_score))


def test_unknown_model_name(tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    overrides = [*tiny_overrides(tiny_cifar, data_cache), "model.net.model_name=vit_tinny_patch16_224"]
    _assert_one_line_exit_2(
        fails_in_process("train", overrides, tmp_path / "run"),
        "unknown timm model",
        "vit_tinny_patch16_224",
        "did you mean vit_tiny_patch16_224",
    )


def test_an_experiments_option_for_another_datamodule_is_one_line(tmp_path: Path, tiny_cifar: Path):
    """experiment=cifar sets CIFAR-10's `datamodule.download`; swapped for an image folder, it was Hydra's
    three-line wrapper of a TypeError. One line, naming the key and how to drop it (which then runs)."""
    overrides = [
        "experiment=cifar",
        "datamodule=image_folder",
        f"datamodule.data_dir={tiny_cifar}",
        "model.net.pretrained=false",
        "trainer=cpu",
    ]
    _assert_one_line_exit_2(
        fails_in_process("train", overrides, tmp_path / "run"),
        "datamodule.download is not an option of ImageFolderDataModule: experiment=cifar sets it",
        "~datamodule.download",
    )


def test_a_batch_larger_than_the_training_set_stops_instead_of_completing(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path
):
    """224 training images and a global batch of 256: with drop_last an epoch held no batch, and fit
    "completed" without a step, testing the initial weights. One line instead, and no checkpoint."""
    overrides = [*tiny_overrides(tiny_cifar, data_cache), "datamodule.batch_size=256"]
    _assert_one_line_exit_2(
        fails_in_process("train", overrides, tmp_path / "run"),
        "datamodule.batch_size=256 is more than the 224 training images",
        "to 224 or less",
    )
    assert not list((tmp_path / "run").rglob("*.ckpt"))


def test_a_resume_that_would_normalise_otherwise_stops_in_one_line(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path, tiny_checkpoint: Path
):
    """The checkpoint's weights were trained on CIFAR-normalised inputs; a resume whose settings give another
    normalisation (here datamodule.mean/std; offline, dropping model.net.pretrained does the same) would go on
    from other inputs without a word. One line naming both and the values to give; given, it resumes."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_checkpoint, run)
    last = run / "checkpoints" / "last.ckpt"
    before = last.read_bytes()
    base = [*tiny_overrides(tiny_cifar, data_cache), "logger=csv", "test=false", "ckpt_path=last"]
    other = ["datamodule.mean=[0.5,0.5,0.5]", "datamodule.std=[0.5,0.5,0.5]"]
    done = fails_in_process("train", [*base, *other], run)
    _assert_one_line_exit_2(
        done,
        "the checkpoint's images were normalised with mean [0.4914, 0.4822, 0.4465], std [0.247, 0.2435, 0.2616]",
        "this run's with mean [0.5, 0.5, 0.5]",
        "datamodule.mean=[0.4914,0.4822,0.4465] datamodule.std=[0.247,0.2435,0.2616]",
    )
    assert last.read_bytes() == before  # nothing saved over it
    given = ["datamodule.mean=[0.4914,0.4822,0.4465]", "datamodule.std=[0.247,0.2435,0.2616]"]
    train(compose_cfg("train", [*base, *given, "trainer.max_epochs=2"], run))
    assert torch.load(last, weights_only=True)["epoch"] == 1


def test_an_offline_resume_of_a_pretrained_run_starts_from_its_checkpoint(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path, tiny_checkpoint: Path, monkeypatch, caplog
):
    """Offline, without the hub's cache, a pretrained run's weights cannot be had; resuming it needs none of
    them (the checkpoint's replace them): the model starts from the checkpoint, with a warning, and the run
    resumes, whether the checkpoint is named, found by `ckpt_path=last` or by a relaunch (`resume=auto`, as
    SLURM's requeue on a node without the hub). A new run, and `ckpt_path=last` with no `last` here, still
    stop in the one line that says how to go on."""
    import logging
    import shutil

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = tmp_path / "run"
    shutil.copytree(tiny_checkpoint, run)
    last = run / "checkpoints" / "last.ckpt"
    base = [*tiny_overrides(tiny_cifar, data_cache), "logger=csv", "test=false", "model.net.pretrained=true"]
    resumes = {  # each extends the run by an epoch
        "named": [f"ckpt_path={last}"],
        "ckpt_path=last": ["ckpt_path=last"],
        "relaunch": [],  # with the job's stable name below, as a requeued job has
    }
    for epochs, (how, extra) in enumerate(resumes.items(), start=2):
        if how == "relaunch":
            monkeypatch.setenv("VITRAIN_RUN_ID", "requeued-job")
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            train(compose_cfg("train", [*base, *extra, f"trainer.max_epochs={epochs}"], run))
        warned = "could not download pretrained weights for vit_tiny_patch16_224"
        assert any(
            warned in r.getMessage() and f"the model starts from {last} instead" in r.getMessage()
            for r in caplog.records
        ), how
        assert torch.load(last, weights_only=True)["epoch"] == epochs - 1, how
    monkeypatch.delenv("VITRAIN_RUN_ID")
    for extra, hint in (
        (["ckpt_path=last"], "to resume without them, name the checkpoint: ckpt_path="),
        ([], ""),
    ):
        _assert_one_line_exit_2(
            fails_in_process("train", [*base, *extra], tmp_path / f"again{len(extra)}"),
            "could not download pretrained weights for vit_tiny_patch16_224",
            hint,
        )


def test_model_sizes_timm_asserts_on_come_out_in_one_line(tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    """timm checks sizes with asserts (heads that do not divide the width; a hybrid stem whose output its patch
    does not divide, whose assert has no message): one line, naming the check."""
    overrides = [*tiny_overrides(tiny_cifar, data_cache), "model.net.num_heads=3"]  # embed_dim 32
    _assert_one_line_exit_2(
        fails_in_process("train", overrides, tmp_path / "a"),
        "error: model.net: timm cannot build vit_tiny_patch16_224 with these settings: dim should be divisible "
        "by num_heads",
    )

    stem = {  # experiment=cifar_cpu's hybrid ViT, its 4x4 feature map given 3 px patches
        "_target_": "timm.layers.HybridEmbed", "_partial_": True, "proj": False,
        "backbone": {"_target_": "timm.models.vision_transformer_hybrid.ConvStem", "depth": 6, "kernel_size": 3,
                     "channels": [32, 64, 64, 128, 128, 192], "stride": [1, 2, 1, 2, 1, 2]},
    }  # fmt: skip
    net = {
        "model_name": "vit_tiny_patch16_224",
        "img_size": 32,
        "patch_size": 3,
        "embed_dim": 192,
        "depth": 1,
    }
    with pytest.raises(ModelError, match=r"settings: assert .*patch_size.* failed \(hybrid_embed\.py:\d+\)$"):
        create_net({**net, "num_heads": 3, "embed_layer": stem})


def test_unknown_config_group_option(tmp_path: Path):
    # a fresh interpreter: the check runs before torch is imported, and nothing else may print
    done = run_cli("train.py", ["experiment=cifarr", f"hydra.run.dir={tmp_path}/run"], fresh=True)
    _assert_clean_failure(
        done, "unknown experiment=cifarr: choose one of cifar, cifar_cpu, finetune_folder, imagenet, smoke"
    )
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1


def test_pretrained_download_offline_says_how_to_go_on(tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    overrides = [
        "experiment=cifar",
        f"datamodule.data_dir={tiny_cifar}",
        f"datamodule.cache_dir={data_cache}",
        "trainer.accelerator=cpu",
        f"hydra.run.dir={tmp_path}/run",
    ]
    done = run_cli("train.py", overrides, env={"HF_HUB_OFFLINE": "1"})
    _assert_clean_failure(
        done, "could not download pretrained weights", "model.net.pretrained=false", "model.weights_file="
    )
    assert done.returncode == 2


def test_eval_checkpoint_that_does_not_exist(tmp_path: Path):
    done = fails_in_process("eval", [f"ckpt_path={tmp_path}/missing.ckpt"], tmp_path / "run")
    _assert_one_line_exit_2(done, "missing.ckpt does not exist")


def test_a_run_dir_given_for_a_checkpoint_names_its_checkpoints(tmp_path: Path):
    """`ckpt_path=logs/train/runs/<run>` (or its checkpoints/ folder) instead of a checkpoint: the one line says
    which checkpoints are there to give."""
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    for name in ("epoch003-acc0.8100.ckpt", "last.ckpt"):
        (tmp_path / "run" / "checkpoints" / name).write_bytes(b"")
    photo = tmp_path / "photo.png"
    Image.new("RGB", (8, 8)).save(photo)
    for given in (tmp_path / "run", tmp_path / "run" / "checkpoints"):
        done = fails_in_process("predict", [f"ckpt_path={given}", f"inputs={photo}"], tmp_path / "out")
        _assert_one_line_exit_2(
            done,
            f"{given} is a folder but not a sharded checkpoint (no .metadata file): give one of its checkpoints, "
            f"e.g. ckpt_path={tmp_path / 'run' / 'checkpoints' / 'last.ckpt'} (the others there: "
            "epoch003-acc0.8100.ckpt)",
        )


def test_eval_without_a_checkpoint_or_with_one_that_is_none(tmp_path: Path, capsys):
    """No ckpt_path (OmegaConf's MissingMandatoryValue traceback before), train.py's `ckpt_path=last` (which
    looked for a run of eval.py to resume), a file that is no checkpoint (called one with Python objects)."""
    from vitrain.tasks.cli import check_overrides

    for args, needle in (
        ([], "error: ckpt_path is required: a .ckpt file, an FSDP checkpoint folder or s3://bucket/key"),
        (["split=val"], "error: ckpt_path is required"),
        (["ckpt_path="], "error: ckpt_path is required"),  # `make eval` without CKPT=
        (["ckpt_path=null"], "error: ckpt_path is required"),
        (["ckpt_path=last"], "error: eval.py takes a checkpoint, not ckpt_path=last"),
    ):
        with pytest.raises(SystemExit) as stop:
            check_overrides("eval", args)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.startswith(needle) and len(err.strip().splitlines()) == 1, err
    text = tmp_path / "notes.ckpt"
    text.write_text("# not a checkpoint\n")
    done = fails_in_process("eval", [f"ckpt_path={text}"], tmp_path / "run")
    _assert_one_line_exit_2(done, "notes.ckpt is not a checkpoint (torch.save writes a zip archive)")


def test_batch_size_not_divisible_by_world_size(tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    """Refused in the launching process, before Lightning starts the second rank."""
    overrides = [*tiny_overrides(tiny_cifar, data_cache, batch_size=9), "trainer=ddp", "trainer.devices=2"]
    done = fails_in_process("train", overrides, tmp_path / "run")
    _assert_one_line_exit_2(done, "datamodule.batch_size=9 does not divide across 2 processes")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_misspelled_override_key_suggests_the_right_one(tmp_path: Path):
    done = run_cli("train.py", ["datamodule.batchsize=64", f"hydra.run.dir={tmp_path}/run"], fresh=True)
    _assert_clean_failure(
        done, "unknown config key datamodule.batchsize", "did you mean datamodule.batch_size?"
    )
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists(), "nothing is created for a command that cannot run"


def test_wrong_type(tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    overrides = [*tiny_overrides(tiny_cifar, data_cache), "datamodule.batch_size=abc"]
    done = fails_in_process("train", overrides, tmp_path / "r")
    _assert_one_line_exit_2(done, "datamodule.batch_size='abc' must be a whole number")


def _launch(tmp_path: Path, env: dict[str, str], *extra: str):
    return run_cli(
        "train.py",
        [
            "trainer=ddp",
            "trainer.devices=1",
            "trainer.num_nodes=2",
            "trainer.accelerator=cpu",
            *extra,
            f"hydra.run.dir={tmp_path}/run",
        ],
        env={"MASTER_ADDR": "127.0.0.1", **env},
    )


TWO_NODES = {"num_nodes": 2, "devices": 1, "accelerator": "cpu"}


def test_node_rank_past_the_last_node():
    env = {"MASTER_ADDR": "127.0.0.1", "NODE_RANK": "2", "MASTER_PORT": "29999", "WORLD_SIZE": "2"}
    with pytest.raises(UserError, match=r"NODE_RANK=2 with trainer.num_nodes=2: number the nodes 0\.\.1"):
        check_launch_env(TWO_NODES, env)


def test_world_size_that_disagrees_with_the_trainer():
    env = {"MASTER_ADDR": "127.0.0.1", "NODE_RANK": "0", "MASTER_PORT": "29999", "WORLD_SIZE": "4"}
    with pytest.raises(UserError, match=r"WORLD_SIZE=4 but trainer.num_nodes x trainer.devices = 2 x 1 = 2"):
        check_launch_env(TWO_NODES, env)


def test_slurm_task_count_is_refused_before_torch_loads():
    """srun's task count against the trainer's devices is checked with the overrides: every task of a wrong
    allocation stops in a second, before ~10 s of imports (tests/test_slurm.py runs it under a real srun)."""
    code = (
        "import sys\n"
        "from vitrain.tasks.cli import check_overrides\n"
        "try:\n"
        "    check_overrides('train', ['trainer=ddp', 'trainer.devices=2', 'trainer.accelerator=cpu'])\n"
        "except SystemExit as stop:\n"
        "    print('exit', stop.code)\n"
        "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))\n"
    )
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "7"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env
    )
    assert done.stdout.splitlines() == ["exit 2", "[]"], done.stdout + done.stderr[-2000:]
    assert done.stderr.strip() == (
        "error: SLURM started SLURM_NTASKS=1 tasks but trainer.num_nodes x trainer.devices = 1 x 2 = 2: one task "
        "per device, e.g. trainer.devices=$SLURM_NTASKS_PER_NODE trainer.num_nodes=$SLURM_NNODES (scripts/slurm/)"
    )


def test_master_port_in_use(tmp_path: Path):
    """Through the CLI: the launch check runs before any process group, in the entry point's process."""
    import socket

    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = _launch(tmp_path, {"NODE_RANK": "0", "MASTER_PORT": str(port), "WORLD_SIZE": "2"})
    _assert_clean_failure(done, f"MASTER_PORT={port} is in use on this machine")
    assert done.returncode == 2


def test_state_dict_mismatch_gives_the_first_detail(tmp_path: Path):
    """One helper turns torch's multi-line state-dict error into its first detail: resume, eval.py, weights_file."""
    with pytest.raises(RuntimeError) as info:
        torch.nn.Linear(2, 3).load_state_dict({"weight": torch.zeros(4, 2), "bias": torch.zeros(3)})
    assert state_dict_mismatch(info.value).startswith("size mismatch for weight")
    assert state_dict_mismatch(RuntimeError("out of memory")) is None

    net = {"model_name": "vit_tiny_patch16_224", "img_size": 32, "patch_size": 8, "depth": 1,
           "num_heads": 2, "num_classes": 10}  # fmt: skip
    weights = tmp_path / "wider.pth"
    torch.save(create_net({**net, "embed_dim": 48}).state_dict(), weights)
    with pytest.raises(
        ModelError, match=r"model\.weights_file=.* does not fit vit_tiny_patch16_224: size mismatch"
    ):
        create_net({**net, "embed_dim": 32}, str(weights))


def test_an_error_chain_that_loops_is_walked_once():
    """An exception re-raised inside the handler of one it caused has that one as its context, which has it as
    its cause: the harness's walks (the user error behind a failure, a lost peer) followed that loop forever."""
    from vitrain.errors import chain
    from vitrain.tasks.harness import peer_lost, user_error

    inner = UserError("S3: s3://b/k/ is not one whole save")
    try:
        try:
            raise RuntimeError("wrapper") from inner
        except RuntimeError:
            raise inner  # noqa: B904 - the loop under test
    except UserError as err:
        caught = err
    assert caught.__context__.__cause__ is caught  # the loop
    assert [type(e) for e in chain(caught)] == [UserError, RuntimeError]
    assert user_error(caught) is inner and not peer_lost(caught)


# an import hook that sends this process SIGINT as `torch` starts to load: a Ctrl-C in the first seconds
CTRL_C_AT_TORCH = """
import os, signal, sys

class CtrlCAtTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlCAtTorch())
"""


@pytest.mark.parametrize("script", ["train.py", "eval.py", "predict.py"])
def test_ctrl_c_while_torch_loads_is_one_line(script: str, tmp_path: Path):
    """Ctrl-C while an entry point imports torch, Lightning and timm (~10 s on a small machine, before the
    task runs): one line and exit 130, not the traceback of whichever import it landed in; no run dir."""
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(CTRL_C_AT_TORCH)
    run = tmp_path / "run"
    args = {"train.py": ["experiment=smoke"], "eval.py": ["ckpt_path=x.ckpt"]}.get(
        script, ["ckpt_path=x.ckpt", "inputs=photos"]
    )
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARS}
    env["PYTHONPATH"] = str(tmp_path / "hook")
    done = subprocess.run(
        [PYTHON, str(ROOT / "src" / script), *args, f"hydra.run.dir={run}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 130, done.stderr[-3000:]
    assert done.stderr == "interrupted (Ctrl-C)\n" and done.stdout == "", done.stderr[-3000:]
    assert not run.exists()


@pytest.mark.slow
def test_ctrl_c_while_the_data_is_prepared_is_one_line(real_cifar10_cache, tmp_path: Path):
    """Ctrl-C during a first run's unpack or decode (minutes for a large data set), as a terminal sends it to
    the process group: one line and exit 130, not a traceback of wherever it landed (its decode workers'
    included); no half-unpacked folder and no empty run dir are left."""
    _, archive = real_cifar10_cache
    cache, run = tmp_path / "cache", tmp_path / "run"  # a fresh cache: this run unpacks and decodes
    command = [
        *(PYTHON, str(ROOT / "src" / "train.py"), "experiment=smoke"),
        *(f"datamodule.data_dir={archive}", f"datamodule.cache_dir={cache}", f"hydra.run.dir={run}"),
    ]
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARS}
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    seen = []
    for line in process.stdout:
        seen.append(line)
        if "(first run only)" in line:  # unpacking (or decoding) has begun
            os.killpg(process.pid, signal.SIGINT)
            break
    out = "".join(seen) + process.communicate(timeout=120)[0]
    assert process.returncode == 130, out[-3000:]
    assert out.rstrip().endswith("interrupted (Ctrl-C)") and "Traceback" not in out, out[-3000:]
    assert not [p for p in cache.rglob("*") if p.name.startswith(".")], "a half-written file or folder stayed"
    assert not run.exists()
