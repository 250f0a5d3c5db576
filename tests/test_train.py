"""End-to-end single-process training and evaluation, in-process and through the entry points."""

import json
from pathlib import Path

import hydra
import pytest
import timm
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers import TINY_VIT, compose_cfg, run_cli, tiny_overrides
from vitrain.tasks.evaluation import evaluate
from vitrain.tasks.export import export_model
from vitrain.tasks.training import train


def _events(run_dir: Path) -> EventAccumulator:
    files = list(run_dir.rglob("events.out.tfevents.*"))
    assert files, f"no TensorBoard event file under {run_dir}"
    acc = EventAccumulator(str(files[0].parent))
    acc.Reload()
    return acc


def test_train_writes_checkpoints_and_tensorboard(tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    cfg = compose_cfg("train", [*tiny_overrides(tiny_cifar, data_cache), "trainer.max_epochs=2"], tmp_path)
    metrics, objects = train(cfg)

    ckpt_dir = tmp_path / "checkpoints"
    assert (ckpt_dir / "last.ckpt").is_file()
    best = Path(objects.best_model_path)
    assert best.is_file() and best.parent == ckpt_dir
    for name in (
        "train/loss_epoch",
        "train/acc1",
        "train/acc5",
        "val/loss",
        "val/acc1",
        "val/acc5",
        "test/acc1",
    ):
        assert name in metrics and 0 <= metrics[name] < 100, name

    scalars = set(_events(tmp_path).Tags()["scalars"])
    assert {"train/loss_step", "train/loss_epoch", "val/acc1", "val/acc5", "train/acc1", "lr"} <= scalars, (
        scalars
    )
    lrs = [e.value for e in _events(tmp_path).Scalars("lr")]
    assert lrs[0] < max(lrs), "warm-up: the learning rate rises first"

    saved = torch.load(best, weights_only=True)
    assert saved["run_config"]["model"]["net"]["embed_dim"] == 32
    assert saved["hyper_parameters"]["label_smoothing"] == cfg.model.label_smoothing


def _imagenet_weights(tmp_path: Path) -> tuple[torch.nn.Module, Path]:
    """The tiny ViT with a 1000-class head, as a timm weights file (ImageNet weights from the hub, offline)."""
    source = timm.create_model(
        "vit_tiny_patch16_224",
        num_classes=1000,
        img_size=32,
        patch_size=8,
        embed_dim=32,
        depth=2,
        num_heads=2,
    )
    weights = tmp_path / "imagenet.pth"
    torch.save(source.state_dict(), weights)
    return source, weights


def test_local_weights_file_is_loaded_with_resized_head(tmp_path: Path):
    source, weights = _imagenet_weights(tmp_path)
    cfg = compose_cfg(
        "train", [*TINY_VIT, f"model.weights_file={weights}", "model.net.num_classes=10"], tmp_path
    )
    model = hydra.utils.instantiate(cfg.model)
    assert model.net.head.out_features == 10
    assert torch.equal(model.net.blocks[1].mlp.fc1.weight, source.blocks[1].mlp.fc1.weight)
    assert model.input_spec["mean"] == (0.5, 0.5, 0.5)  # the pretrained config's, not CIFAR's
    # the file's weights are not kept a second time in the config timm attaches (nor in EMA's deep copy)
    assert "state_dict" not in model.net.pretrained_cfg


def test_runs_from_weights_are_evaluated_with_the_normalisation_they_trained_with(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path, tiny_checkpoint: Path
):
    """A run started from weights (a timm file, as from the hub) normalises its images with their config's
    mean/std (0.5 for this ViT), not CIFAR's. eval.py (predict.py, export.py alike) builds the network without
    those weights and must still normalise as training did: from the checkpoint's record, and for a
    checkpoint without one (written before it) as training derived it. A run started from one of our
    checkpoints takes that checkpoint's normalisation, as timm's weights give theirs."""
    from timm.data import IMAGENET_DEFAULT_MEAN

    from vitrain.data.datamodules.cifar import CIFAR10_MEAN, CIFAR10_STD

    _, weights = _imagenet_weights(tmp_path)
    run = tmp_path / "run"
    overrides = [*tiny_overrides(tiny_cifar, data_cache), f"model.weights_file={weights}", "test=false"]
    trained, _ = train(compose_cfg("train", overrides, run))
    last = run / "checkpoints" / "last.ckpt"
    saved = torch.load(last, weights_only=True)
    assert saved["normalisation"] == {"mean": [0.5] * 3, "std": [0.5] * 3}
    older = tmp_path / "older.ckpt"
    torch.save({k: v for k, v in saved.items() if k != "normalisation"}, older)
    for checkpoint in (last, older):
        evaluated, objects = evaluate(
            compose_cfg(
                "eval",
                [
                    f"ckpt_path={checkpoint}",
                    "split=val",
                    "trainer.precision=32-true",
                    "extras.print_config=false",
                ],
                tmp_path / f"eval-{checkpoint.stem}",
            )
        )
        assert objects.datamodule.mean == (0.5, 0.5, 0.5) != CIFAR10_MEAN
        assert evaluated["val/loss"] == pytest.approx(trained["val/loss"], rel=1e-6)
        assert evaluated["val/acc1"] == pytest.approx(trained["val/acc1"], abs=1e-9)
    # the exported timm folder's data config too (predict.py reads the same model)
    _, folder = export_model(
        compose_cfg("export", [f"ckpt_path={older}", "extras.print_config=false"], tmp_path / "export")
    )
    config = json.loads((folder / "config.json").read_text())["pretrained_cfg"]
    assert config["mean"] == [0.5] * 3 and config["std"] == [0.5] * 3

    scratch = tiny_checkpoint / "checkpoints" / "last.ckpt"  # from scratch: CIFAR-10's own statistics
    for start, mean in ((last, (0.5, 0.5, 0.5)), (scratch, CIFAR10_MEAN), (weights, (0.5, 0.5, 0.5))):
        cfg = compose_cfg(
            "train", [*TINY_VIT, f"model.weights_file={start}", "model.net.num_classes=3"], tmp_path
        )
        spec = hydra.utils.instantiate(cfg.model).input_spec
        assert spec["mean"] == pytest.approx(mean) and spec["mean"] != pytest.approx(IMAGENET_DEFAULT_MEAN)
        if start == scratch:
            assert spec["std"] == pytest.approx(CIFAR10_STD)


def test_eval_of_a_checkpoint_from_before_the_stratified_carve_validates_on_its_images(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path
):
    """A checkpoint written before the carved validation split was stratified names no `val_split`: eval.py
    carves as its run did (at random), not the stratified split, which would score some of its training
    images as validation ones."""
    run = tmp_path / "run"
    overrides = [*tiny_overrides(tiny_cifar, data_cache), "datamodule.val_split=random", "test=false"]
    trained, _ = train(compose_cfg("train", overrides, run))
    older = tmp_path / "older.ckpt"
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    del checkpoint["run_config"]["datamodule"]["val_split"]
    del checkpoint["CIFAR10DataModule"]["val_split"]
    torch.save(checkpoint, older)

    def evaluated(*extra: str) -> tuple[dict[str, float], object]:
        args = [f"ckpt_path={older}", "split=val", "trainer.precision=32-true", "extras.print_config=false"]
        return evaluate(compose_cfg("eval", [*args, *extra], tmp_path / f"eval{len(extra)}"))

    metrics, objects = evaluated()
    assert objects.datamodule.hparams.val_split == "random"
    assert metrics["val/loss"] == pytest.approx(trained["val/loss"], rel=1e-6)
    assert metrics["val/acc1"] == pytest.approx(trained["val/acc1"], abs=1e-9)
    stratified, _ = evaluated("datamodule.val_split=stratified")  # another validation split
    assert stratified["val/loss"] != pytest.approx(trained["val/loss"], rel=1e-6)


def test_train_and_eval_cli(tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    """`src/train.py` then `src/eval.py` on its best checkpoint: eval reproduces the validation metrics."""
    overrides = [o for o in tiny_overrides(tiny_cifar, data_cache) if not o.startswith("extras.")]
    run_dir = tmp_path / "run"
    # a new interpreter, as a user's first run (the suite's other CLI runs are warm: tests/warm.py)
    done = run_cli("train.py", [*overrides, "trainer.max_epochs=2", f"hydra.run.dir={run_dir}"], fresh=True)
    assert done.returncode == 0, done.stderr[-3000:]
    # Lightning's hint to prefix srun, outside any SLURM job (CI installs SLURM's client: srun is there)
    assert "`srun` command is available" not in done.stderr
    assert (run_dir / "config_tree.log").is_file() and "model_name" in (
        run_dir / "config_tree.log"
    ).read_text()
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    best = next((run_dir / "checkpoints").glob("epoch*.ckpt"))
    best_score = torch.load(best, weights_only=True)["callbacks"]
    score = next(v["best_model_score"] for k, v in best_score.items() if k.startswith("ModelCheckpoint"))

    eval_dir = tmp_path / "eval"
    # the run validated in fp32: eval's default `auto` picks bf16 on a CPU whose native bf16 measures faster
    done = run_cli(
        "eval.py",
        [f"ckpt_path={best}", "split=val", "trainer.precision=32-true", f"hydra.run.dir={eval_dir}"],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((eval_dir / "metrics.json").read_text())
    assert metrics["val/acc1"] == pytest.approx(float(score), abs=1e-6)
    # what produced the numbers, as the training report names it
    trained = json.loads((run_dir / "report.json").read_text())
    assert metrics["code"] == trained["code"] and metrics["code"]["commit"]
    assert metrics["software"]["torch"] == torch.__version__
    assert "val/acc1" in done.stdout  # the Rich table

    done = run_cli("eval.py", [f"ckpt_path={best}", f"hydra.run.dir={tmp_path / 'eval_test'}"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert 0 <= json.loads((tmp_path / "eval_test" / "metrics.json").read_text())["test/acc1"] <= 1


@pytest.mark.slow
def test_real_cifar10_learns(tmp_path: Path, real_cifar10_cache):
    """Two short epochs of a small ViT on the real CIFAR-10 are far above chance (10 %).

    A 3-conv stem, width 64 and depth 2 make it ~20x cheaper than the experiment's model.
    `precision=auto` as shipped: bf16 only where the CPU has it, so this never waits on emulated bf16.
    """
    cache_dir, archive = real_cifar10_cache
    overrides = [
        "experiment=cifar_cpu",
        f"datamodule.data_dir={archive}",
        f"datamodule.cache_dir={cache_dir}",
        "datamodule.batch_size=128",
        "datamodule.train_subset=15000",
        "datamodule.test_subset=2000",  # three test passes below (train's, eval's, eval's without TTA)
        "model.net.depth=2",  # the experiment: depth 4, six stem convs up to 192 channels
        "model.net.embed_dim=64",
        "model.net.num_heads=2",
        "model.net.embed_layer.backbone.depth=3",  # three stride-2 convs: 32 px -> 4x4 tokens
        "model.net.embed_layer.backbone.channels=[16,32,64]",
        "model.net.embed_layer.backbone.stride=[2,2,2]",
        "trainer.max_epochs=2",
        "trainer.max_time=null",
        "logger=none",
        "extras.print_config=false",
    ]
    metrics, objects = train(compose_cfg("train", overrides, tmp_path))
    assert metrics["test/acc1"] > 0.25, metrics

    # eval.py rebuilds the model from the checkpoint's saved config (class_token: false, the ConvStem node,
    # flip TTA) and reproduces the test accuracy; without the TTA the same weights score another, still
    # trained, prediction
    ckpt = [f"ckpt_path={objects.best_model_path}", "extras.print_config=false"]
    evaluated = evaluate(compose_cfg("eval", ckpt, tmp_path / "eval"))[0]
    assert evaluated["test/acc1"] == pytest.approx(metrics["test/acc1"])
    plain = evaluate(compose_cfg("eval", [*ckpt, "model.tta_flip=false"], tmp_path / "plain"))[0]
    assert plain["test/loss"] != pytest.approx(metrics["test/loss"]) and plain["test/acc1"] > 0.25, plain


def test_a_diverged_run_stops_and_its_report_says_so(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path, caplog
):
    """A learning rate far too high: the loss is NaN from the second step, and the run trained on through
    all its epochs before, its report saying "completed" with its loss rows missing."""
    overrides = [*tiny_overrides(tiny_cifar, data_cache), "trainer.max_epochs=3", "trainer.limit_val_batches=1",
                 "trainer.num_sanity_val_steps=0", "model.optimizer.lr=1e9", "logger=csv"]  # fmt: skip
    with caplog.at_level("ERROR"):
        _, objects = train(compose_cfg("train", overrides, tmp_path))
    assert objects.trainer.global_step == 3  # NaN at steps 2 and 3 (log_every_n_steps=1), not 3 x 28 steps
    assert "the run diverged and stops. Lower model.optimizer.lr" in caplog.text
    report = (tmp_path / "report.md").read_text()
    assert "| stopped | by a NaN or infinite training loss (diverged) at step 3 (epoch 0) |" in report
    assert json.loads((tmp_path / "report.json").read_text())["stopped"]["step"] == 3


@pytest.mark.parametrize(("steps", "trained"), [([3], 10), ([3, 4], 5)], ids=["one_overflow", "two_in_a_row"])
def test_one_non_finite_loss_is_no_divergence(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path, steps: list[int], trained: int
):
    """Under 16-mixed a step whose loss overflowed is skipped and training goes on: one non-finite loss among
    finite ones trains to the end; two log steps in a row stop the run (the default `patience`)."""
    from omegaconf import open_dict

    overrides = [*tiny_overrides(tiny_cifar, data_cache), "trainer.limit_train_batches=10",
                 "trainer.limit_val_batches=1", "trainer.num_sanity_val_steps=0", "test=false", "logger=none"]  # fmt: skip
    cfg = compose_cfg("train", overrides, tmp_path)
    with open_dict(cfg):
        cfg.callbacks["fault"] = {"_target_": "fault_injection.NonFiniteLossAt", "steps": steps}
    _, objects = train(cfg)
    assert objects.trainer.global_step == trained
