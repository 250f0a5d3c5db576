"""The run's log book (report.md/json, plots), throughput/MFU logging and the batch-size search."""

import csv
import json
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import matplotlib.image
import pytest
import torch
from lightning.pytorch.utilities.memory import is_oom_error
from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

from helpers import PYTHON, ROOT, compose_cfg, run_cli, tiny_overrides
from vitrain.models.classifier import ImageClassifier
from vitrain.reporting.report import mask_override
from vitrain.tasks.training import train
from vitrain.tasks.tuning import GB, MemoryCapExceeded, PerDeviceBatch, extrapolate, peak_bytes, search_copy

SECRET = "vitrain-report-secret-0123456789"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, tiny_cifar: Path, data_cache: Path) -> Path:
    """One 2-epoch tiny run; a secret sits in the environment and in an override, as a careless user's would."""
    run_dir = tmp_path_factory.mktemp("report_run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
        overrides = [
            *tiny_overrides(tiny_cifar, data_cache, batch_size=16),
            "trainer.max_epochs=2",
            "callbacks.throughput.window_size=2",
            f"+extras.api_token={SECRET}",
        ]
        train(compose_cfg("train", overrides, run_dir))
    return run_dir


def scalars(run_dir: Path) -> dict[str, list]:
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={SCALARS: 0})
    acc.Reload()
    return {tag: acc.Scalars(tag) for tag in acc.Tags()[SCALARS]}


def test_report_figures_match_the_run_and_its_tensorboard_events(run_dir: Path):
    report = json.loads((run_dir / "report.json").read_text())
    events = scalars(run_dir)

    val_acc = [e.value for e in events["val/acc1"]]
    assert len(val_acc) == 2
    assert report["metrics"]["best"]["val/acc1"]["value"] == pytest.approx(max(val_acc))
    assert report["metrics"]["final"]["val/acc1"]["value"] == pytest.approx(val_acc[-1])
    assert report["metrics"]["best"]["val/loss"]["value"] == pytest.approx(
        min(e.value for e in events["val/loss"])
    )
    assert report["metrics"]["test"]["test/acc1"] == pytest.approx(events["test/acc1"][-1].value)
    assert set(report["metrics"]["test"]) == {"test/acc1", "test/acc5", "test/loss"}  # no throughput figures

    assert report["strategy"] == "SingleDeviceStrategy" and report["accelerator"] == "cpu"
    assert (report["world_size"], report["num_nodes"], report["devices_per_node"]) == (1, 1, 1)
    assert report["precision"] == "32-true"
    assert report["batch_size"]["global"] == report["batch_size"]["per_device"] == 16
    assert report["epochs"] == 2 and len(report["epoch_times_s"]) == 2
    assert report["global_step"] == 2 * 14
    assert 0 < report["train_time_s"] <= report["wall_time_s"]
    # 2 epochs x 14 batches of 16 (224 training images, drop_last)
    assert report["throughput_images_per_s"] == pytest.approx(2 * 14 * 16 / report["train_time_s"], rel=0.01)
    [device] = report["memory"]["per_device"]
    assert device["rank"] == 0 and 0.1 < device["peak_rss_gb"] < 64
    assert report["gpu_utilization"] == {"available": False, "reason": "no GPU (cpu)"}
    assert report["mfu"] is None and "cpu" in report["mfu_note"]
    assert report["max_batch_size"] is None
    ckpts = report["checkpoints"]
    assert Path(ckpts["best"]).is_file() and Path(ckpts["last"]).name == "last.ckpt"
    assert ckpts["best_score"] == pytest.approx(max(val_acc))
    assert "datamodule.batch_size=16" in report["overrides"]

    md = (run_dir / "report.md").read_text()
    for text in (
        "## Metrics",
        "val/acc1",
        "test/acc1",
        "SingleDeviceStrategy",
        "16 global, 16 per device",
        "images/s",
        "peak_rss_gb",
        "Not available: no GPU",
        "![loss](plots/loss.png)",
        ckpts["best"],
    ):
        assert text in md, text


def test_a_test_split_of_its_own_is_not_called_the_val_images(run_dir: Path):
    report = (run_dir / "report.md").read_text()
    assert "| data | CIFAR10DataModule, 10 classes;" in report and "test = the val images" not in report
    assert not json.loads((run_dir / "run_stats.json").read_text())["data"]["test_is_val"]


def test_throughput_and_flops_are_logged(run_dir: Path):
    events = scalars(run_dir)
    assert events["train/device/samples_per_sec"][-1].value > 0
    assert events["train/device/flops_per_sec"][-1].value > 0
    assert "train/device/mfu" not in events  # no peak FLOPs for a CPU
    stats = json.loads((run_dir / "run_stats.json").read_text())
    # forward + backward is about 3x forward
    assert 2.5 < stats["flops"]["train_flops_per_image"] / stats["flops"]["eval_flops_per_image"] < 3.5


def test_the_report_names_the_code_and_libraries_that_made_it(run_dir: Path):
    """The commit of the checkout the run's code came from (and whether it had changes), and the versions of
    Python, torch, Lightning and timm: what makes one run's figures comparable with another's."""
    import lightning
    import timm

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()

    report = json.loads((run_dir / "report.json").read_text())
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    assert report["code"] == {"commit": git("rev-parse", "HEAD"), "dirty": dirty}
    assert report["software"]["torch"] == torch.__version__
    assert (
        report["software"]["lightning"] == lightning.__version__
        and report["software"]["timm"] == timm.__version__
    )
    row = f"| code | `{git('rev-parse', 'HEAD')[:12]}`{' with uncommitted changes' if dirty else ''}; python "
    assert row in (run_dir / "report.md").read_text()


def test_code_version_is_the_commit_of_a_tracked_file(tmp_path: Path):
    from vitrain.utils.provenance import code_version

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, check=True)

    code = tmp_path / "pkg" / "module.py"
    code.parent.mkdir()
    code.write_text("x = 1\n")
    assert code_version(code) is None  # no repository
    git("init", "-q")
    git("add", "pkg/module.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout
    assert code_version(code) == {"commit": commit.strip(), "dirty": False}
    (tmp_path / "logs.txt").write_text("untracked: not a change of the code")
    assert code_version(code) == {"commit": commit.strip(), "dirty": False}
    code.write_text("x = 2\n")
    assert code_version(code) == {"commit": commit.strip(), "dirty": True}
    installed = tmp_path / ".venv" / "vitrain" / "__init__.py"  # a copy in an untracked folder
    installed.parent.mkdir(parents=True)
    installed.write_text("")
    assert code_version(installed) is None


def test_plots_are_valid_pngs(run_dir: Path):
    for name in ("loss", "accuracy"):
        path = run_dir / "plots" / f"{name}.png"
        assert path.read_bytes()[:8] == PNG_SIGNATURE
        image = matplotlib.image.imread(path)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_secrets_never_reach_the_report(run_dir: Path):
    for name in ("report.md", "report.json", "run_stats.json"):
        text = (run_dir / name).read_text()
        assert SECRET not in text, name
    assert "+extras.api_token=***" in json.loads((run_dir / "report.json").read_text())["overrides"]
    # a flag under a secret-sounding name is shown as typed; a value is masked even when it looks numeric
    assert mask_override("model.net.class_token=false") == "model.net.class_token=false"
    assert mask_override("+extras.hub_token=123456") == "+extras.hub_token=***"


def test_report_is_rebuilt_from_the_run_dir(run_dir: Path, tmp_path: Path):
    """`make report RUN=<dir>` = `python -m vitrain.reporting <dir>`: same figures from the files alone."""
    copy = shutil.copytree(run_dir, tmp_path / "copy")
    before = json.loads((copy / "report.json").read_text())
    for name in ("report.md", "report.json"):
        (copy / name).unlink()
    shutil.rmtree(copy / "plots")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [PYTHON, "-m", "vitrain.reporting", str(copy)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    after = json.loads((copy / "report.json").read_text())
    for key in (
        "metrics",
        "memory",
        "batch_size",
        "throughput_images_per_s",
        "checkpoints",
        "overrides",
        "epochs",
    ):
        assert after[key] == before[key], key
    assert (copy / "plots" / "loss.png").is_file() and (copy / "report.md").is_file()


def test_batch_size_search_is_recorded_and_applied(tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    """Doubling from 2 for 3 trials (2, 4, 8): 8 per device is what fits the limits; the run trains with it."""
    overrides = [
        *tiny_overrides(tiny_cifar, data_cache, batch_size=32),
        "+tune=batch_size",
        "tune.batch_size.max_trials=3",
        "tune.batch_size.steps_per_trial=1",
        "tune.batch_size.apply=true",
        "+trainer.limit_train_batches=2",
        "+trainer.limit_val_batches=1",
        "+trainer.limit_test_batches=1",
    ]
    metrics, _ = train(compose_cfg("train", overrides, tmp_path))
    search = json.loads((tmp_path / "batch_size_search.json").read_text())
    assert (search["per_device"], search["global"], search["world_size"]) == (8, 8, 1)
    assert [t["batch_size"] for t in search["trials"]] == [2, 4, 8]
    assert search["stopped_by"] == "max_trials" and search["max_memory_gb"] > 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["max_batch_size"]["per_device"] == 8
    assert report["batch_size"]["global"] == 8  # applied
    assert "test/acc1" in metrics
    assert "8 global, 8 per device" in (tmp_path / "report.md").read_text()
    assert not list(tmp_path.glob(".scale_batch_size_*.ckpt"))


def test_a_run_not_meant_to_train_is_not_reported_interrupted(
    run_dir: Path, tmp_path: Path, tiny_cifar: Path, data_cache: Path
):
    """`+tune=batch_size` alone (search, report, stop) and `train=false ckpt_path=...` (test a checkpoint) write
    no record of a fit: their report.md said "**Interrupted**: ... killed, or still running"."""
    base = [o for o in tiny_overrides(tiny_cifar, data_cache) if not o.startswith("extras.")]
    search_dir = tmp_path / "search"
    search = ["+tune=batch_size", "tune.batch_size.max_trials=2", "tune.batch_size.steps_per_trial=1"]
    done = run_cli("train.py", [*base, *search, f"hydra.run.dir={search_dir}"])
    assert done.returncode == 0, done.stderr[-3000:]
    report = (search_dir / "report.md").read_text()
    assert "Interrupted" not in report and "killed" not in report, report[:600]
    assert "| stopped | without training: a batch-size search only (tune.batch_size.apply=false) |" in report
    assert "| MFU | n/a: no training in this run (train=false) |" in report
    assert "| max batch size | 4 global, 4 per device |" in report

    tested = tmp_path / "tested"
    last = run_dir / "checkpoints" / "last.ckpt"
    metrics, _ = train(compose_cfg("train", [*base, "train=false", f"ckpt_path={last}"], tested))
    report = (tested / "report.md").read_text()
    assert "test/acc1" in metrics and "Interrupted" not in report, report[:600]
    assert "| stopped | without training: train=false |" in report

    # a fit told to train nothing: "completed", and its MFU "no ImageThroughputMonitor", before
    no_epochs = tmp_path / "no_epochs"
    metrics, _ = train(
        compose_cfg("train", [*base, "trainer.max_epochs=0", "trainer.max_steps=-1"], no_epochs)
    )
    report = (no_epochs / "report.md").read_text()
    assert "test/acc1" in metrics
    assert "| stopped | without training: trainer.max_epochs=0 |" in report, report[:1500]
    assert "| MFU | n/a: no training step in this run (trainer.max_epochs=0) |" in report


def test_batch_size_search_trains_at_full_size():
    """Progressive resizing would start the trials at 16 px: the search's copy trains at full size."""
    net = {"model_name": "vit_tiny_patch16_224", "num_classes": 10, "img_size": 32, "patch_size": 8,
           "embed_dim": 32, "depth": 1, "num_heads": 2, "dynamic_img_size": True}  # fmt: skip
    model = ImageClassifier(
        net=net,
        optimizer={"_target_": "torch.optim.AdamW", "lr": 1e-3},
        progressive_resize={"start_size": 16, "multiple": 8},
    )
    probe = search_copy(model)
    assert probe.resize is None and model.resize is not None and probe.net is not model.net


def test_memory_cap_stops_growth_before_a_trial_would_exceed_it():
    """Peaks 1.0 GB at batch 4 and 1.5 GB at batch 8: batch 16 would need about 2.5 GB."""
    assert extrapolate([(4, 1 * GB), (8, int(1.5 * GB))], 16) == pytest.approx(2.5 * GB)
    assert extrapolate([(8, GB)], 16) is None  # one point: no slope yet
    fake = SimpleNamespace(hparams=SimpleNamespace(batch_size=16))
    # on top of what this (test) process already holds, so only the extrapolation can trip the cap
    base = peak_bytes(torch.device("cpu"))
    scaled = PerDeviceBatch(fake, torch.device("cpu"), cap_bytes=base + 2 * GB)
    scaled.trials = [(4, base + 1 * GB), (8, base + int(1.5 * GB))]
    with pytest.raises(MemoryCapExceeded) as caught:
        scaled._check_cap()
    assert is_oom_error(caught.value)  # Lightning's finder halves and stops, as after a real OOM
    assert f"would need about {(base + 2.5 * GB) / GB:.2f} GB" in scaled.stopped_by


@pytest.mark.parametrize("logger", ["csv", "none"])
def test_report_curves_come_from_the_metric_record_with_any_logger(
    logger: str, tmp_path: Path, tiny_cifar: Path, data_cache: Path
):
    """No TensorBoard: report.md's metrics and curves come from the run's own metrics.jsonl."""
    overrides = [
        *tiny_overrides(tiny_cifar, data_cache, batch_size=16),
        "trainer.max_epochs=2",
        f"logger={logger}",
    ]
    metrics, _ = train(compose_cfg("train", overrides, tmp_path))
    assert not list(tmp_path.rglob("events.out.tfevents.*"))

    record = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    val_acc = [r["val/acc1"] for r in record if "val/acc1" in r]
    steps = [r["step"] for r in record if "train/loss_step" in r]
    assert len(val_acc) == 2 and steps == sorted(steps) and len(steps) == 2 * 14
    assert any("lr" in r for r in record)  # the LR monitor logs into the record, also without a logger
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["metrics"]["best"]["val/acc1"]["value"] == pytest.approx(max(val_acc))
    assert report["metrics"]["final"]["val/acc1"]["value"] == pytest.approx(val_acc[-1])
    assert report["metrics"]["test"]["test/acc1"] == pytest.approx(metrics["test/acc1"])
    md = (tmp_path / "report.md").read_text()
    for name in ("loss", "accuracy"):
        assert f"![{name}](plots/{name}.png)" in md
        assert (tmp_path / "plots" / f"{name}.png").read_bytes()[:8] == PNG_SIGNATURE
    if logger == "csv":  # the record and the logger got the same values
        with (tmp_path / "csv" / "metrics.csv").open() as f:
            logged = [float(row["val/acc1"]) for row in csv.DictReader(f) if row.get("val/acc1")]
        assert logged == pytest.approx(val_acc)
