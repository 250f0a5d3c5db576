"""What a new user meets on the way (issue 31): time budgets that hold, honest messages, one-line errors."""

import json
import logging
import os
import re
import shlex
import shutil
import signal
import time
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import OmegaConf, open_dict

from helpers import LAUNCH_VARS, compose_cfg, fails_in_process, tiny_overrides
from vitrain.callbacks.resume import CheckpointOnSigterm
from vitrain.errors import DataError, UserError
from vitrain.reporting.report import write_report
from vitrain.tasks.build import build
from vitrain.tasks.cli import EVAL_ADDED_ENV, check_overrides, checkpoint_overrides, sweep_variants
from vitrain.tasks.evaluation import evaluate
from vitrain.tasks.runs import RUN_ID_VARS, checkpoint_to_resume, resume_hint
from vitrain.tasks.training import train


class SlowStep(L.Callback):
    """Makes every training step take at least `seconds`: a slow machine, in a test."""

    def __init__(self, seconds: float = 0.05) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, *args) -> None:
        time.sleep(self.seconds)


def test_max_time_holds_inside_the_first_epoch(tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    """`trainer.max_time` stops a run whose first epoch cannot fit the budget, even with `min_epochs=1` (the
    seed's command line): mid-epoch, then the final weights are validated, tested and reported once."""
    overrides = [
        *tiny_overrides(tiny_cifar, data_cache, batch_size=2),  # 112 steps an epoch
        "trainer.max_epochs=1000",
        "trainer.min_epochs=1",
        "trainer.max_time=00:00:00:01",
        "trainer.num_sanity_val_steps=0",
        "logger=none",
        "+callbacks.slow_step._target_=test_user_path.SlowStep",
    ]
    metrics, objects = train(compose_cfg("train", overrides, tmp_path))
    steps_per_epoch = objects.trainer.num_training_batches
    assert 0 < objects.trainer.global_step < steps_per_epoch / 2, (
        objects.trainer.global_step,
        steps_per_epoch,
    )
    assert "val/acc1" in metrics and "test/acc1" in metrics
    assert (tmp_path / "report.md").is_file()


class SigtermSelfAt(L.Callback):
    """SIGTERM this process (only: the test runs in-process) once training reaches `step`."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step == self.step and not trainer.received_sigterm:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_tells_the_command_that_resumes_and_reports_interrupted(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path, monkeypatch, caplog, capfd
):
    """A plain run (named by its start time) stopped by SIGTERM: what it prints to resume is a command line
    that does resume this run, and report.md says the run was interrupted and where."""
    for var in RUN_ID_VARS:
        monkeypatch.delenv(var, raising=False)
    overrides = [
        *tiny_overrides(tiny_cifar, data_cache),
        "logger=none",
        "trainer.num_sanity_val_steps=0",
        "+callbacks.sigterm_at._target_=test_user_path.SigtermSelfAt",
        "+callbacks.sigterm_at.step=5",
    ]
    with pytest.raises(SIGTERMException):
        train(compose_cfg("train", overrides, tmp_path))
    assert "SIGTERM received: stopping at the next step boundary" in capfd.readouterr().err
    message = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("SIGTERM: saved"))
    assert "relaunch the same command" not in message  # a relaunch would start a new, time-named run
    command = shlex.split(message.split("resume with: ", 1)[1])
    assert command[:2] == ["python", "src/train.py"] and "ckpt_path=last" in command

    report = (tmp_path / "report.md").read_text()
    assert "**Interrupted**: by SIGTERM at step 5" in report and "ckpt_path=last" in report
    assert "| model | vit_tiny_patch16_224" in report

    # the printed command resumes this run: its run dir, its last checkpoint
    resumed = compose_cfg("train", command[2:], tmp_path / "unused")
    run_dir = next(o.split("=", 1)[1] for o in command if o.startswith("hydra.run.dir="))
    with open_dict(resumed):
        resumed.paths.output_dir = run_dir
    objects = build(resumed)
    assert checkpoint_to_resume(resumed, objects.trainer) == str(tmp_path / "checkpoints" / "last.ckpt")


def test_a_relaunch_after_the_end_of_training_keeps_the_report(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path, monkeypatch, caplog
):
    """A finished run resumed again (a relaunched sweep's finished jobs, the same VITRAIN_RUN_ID): Lightning
    trains nothing, and the report kept its epochs, times and images/s (they were blank: the empty session's
    figures replaced them, and the sweep summary lost them)."""
    for var in RUN_ID_VARS:
        monkeypatch.delenv(var, raising=False)
    overrides = [*tiny_overrides(tiny_cifar, data_cache), "logger=none", "trainer.max_epochs=2"]
    train(compose_cfg("train", overrides, tmp_path))
    first = json.loads((tmp_path / "report.json").read_text())
    assert first["epochs"] == 2 and first["time_per_epoch_s"] and first["throughput_images_per_s"]
    with caplog.at_level(logging.INFO):
        train(compose_cfg("train", [*overrides, "ckpt_path=last"], tmp_path))
    again = json.loads((tmp_path / "report.json").read_text())
    for key in ("epochs", "global_step", "time_per_epoch_s", "throughput_images_per_s", "peak_memory_gb"):
        assert again[key] == first[key], key
    assert again["mfu_note"] == first["mfu_note"]
    assert again["metrics"] == first["metrics"]  # the validation history kept; tested again: the same weights
    assert any(r.getMessage().startswith("nothing left to train") for r in caplog.records)


def test_a_resume_that_splits_the_batches_otherwise_does_not_claim_to_be_exact(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path, monkeypatch, caplog
):
    """Stopped mid-epoch, resumed with another global batch (the rest of the epoch is not the images it had
    left) or by another number of processes (not bitwise): the resume says so instead of "bitwise as if never
    stopped"; resumed as saved, it still says bitwise."""
    for var in RUN_ID_VARS:
        monkeypatch.delenv(var, raising=False)
    overrides = [*tiny_overrides(tiny_cifar, data_cache), "logger=none", "trainer.num_sanity_val_steps=0"]
    stop = ["+callbacks.sigterm_at._target_=test_user_path.SigtermSelfAt", "+callbacks.sigterm_at.step=5"]
    stopped = tmp_path / "stopped"
    with pytest.raises(SIGTERMException):
        train(compose_cfg("train", [*overrides, *stop], stopped))
    saved = torch.load(stopped / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["CIFAR10DataModule"] == {"batch_size": 8, "world_size": 1, "val_split": "stratified"}

    def resumed(name: str, *extra: str, edit=None) -> str:
        run = tmp_path / name
        shutil.copytree(stopped, run)
        if edit is not None:
            checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
            edit(checkpoint)
            torch.save(checkpoint, run / "checkpoints" / "last.ckpt")
        caplog.clear()
        with caplog.at_level(logging.INFO):
            train(compose_cfg("train", [*overrides, *extra, "ckpt_path=last"], run))
        return next(r.getMessage() for r in caplog.records if r.getMessage().startswith("resuming at"))

    assert "bitwise as if never stopped" in resumed("same")
    message = resumed("bigger", "datamodule.batch_size=16")
    assert "not bitwise" in message and "the rest of that epoch is not the images it had left" in message
    assert "resume with datamodule.batch_size=8" in message

    def by_two_processes(checkpoint: dict) -> None:
        checkpoint["CIFAR10DataModule"]["world_size"] = 2
        checkpoint["rng_states_per_rank"] = checkpoint["rng_states_per_rank"] * 2

    message = resumed("fewer", edit=by_two_processes)
    assert "not bitwise" in message and "saved by 2 process(es), this run has 1" in message, message

    def before_the_stratified_carve(checkpoint: dict) -> None:  # written before 2026-12-01
        del checkpoint["CIFAR10DataModule"]["val_split"]

    message = resumed("older", edit=before_the_stratified_carve)
    assert (
        "not bitwise" in message and "carved its validation split by datamodule.val_split=random" in message
    )
    assert "resume with datamodule.val_split=random" in message and "process" not in message, message
    assert "bitwise as if never stopped" in resumed(
        "older_as_it_was", "datamodule.val_split=random", edit=before_the_stratified_carve
    )


def test_resume_hint_says_relaunch_only_where_a_relaunch_resumes():
    assert resume_hint({"resume": "auto"}, "logs/x", None).startswith("resume with: python src/train.py")
    assert resume_hint({"resume": "auto"}, "logs/x", "mine").startswith("relaunch the same command")
    # resume=never, or an explicit checkpoint to start from: a relaunch would start over
    assert "ckpt_path=last" in resume_hint({"resume": "never"}, "logs/x", "mine")
    assert "ckpt_path=last" in resume_hint({"resume": "auto", "ckpt_path": "/w/pre.ckpt"}, "logs/x", "mine")


def test_resume_hint_is_the_launchs_not_what_the_strategy_later_sets(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path, monkeypatch
):
    """Lightning's launcher sets MASTER_ADDR, MASTER_PORT, NODE_RANK and LOCAL_RANK in a plain DDP or FSDP
    run's own process: a SIGTERM after that still gets the command that resumes this time-named run."""
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    callbacks = build(compose_cfg("train", tiny_overrides(tiny_cifar, data_cache), tmp_path)).callbacks
    hint = next(c for c in callbacks if isinstance(c, CheckpointOnSigterm)).resume_hint
    for var, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "41234",
        "NODE_RANK": "0",
        "LOCAL_RANK": "0",
    }.items():
        monkeypatch.setenv(var, value)
    assert hint().startswith("resume with: python src/train.py")


def test_report_of_a_run_killed_before_its_stats_is_truthful(tmp_path: Path):
    """`make report` on a run that never wrote run_stats.json: no `None`, no false claim about MFU."""
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text(
        "model:\n  net:\n    model_name: vit_small_patch16_224\n"
    )
    (tmp_path / ".hydra" / "overrides.yaml").write_text("- experiment=smoke\n")
    write_report(tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "None" not in report and "no ImageThroughputMonitor" not in report
    assert "| model | vit_small_patch16_224 |" in report
    assert "**Interrupted**" in report


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("model.optimizer.lr=-1", "error: model.optimizer.lr=-1: must be a positive number"),
        ("model.optimizer.lr=abc", "error: model.optimizer.lr=abc: must be a positive number"),
        ("datamodule.batch_size=0", "error: datamodule.batch_size=0: must be a positive whole number"),
        # each ran before: drop-path 2 failed in torch at the first step, the others trained silently
        (
            "model.net.drop_path_rate=2",
            "error: model.net.drop_path_rate=2: must be a number in [0, 1) or null (the model's)",
        ),
        (
            "model.scheduler.warmup_fraction=2",
            "error: model.scheduler.warmup_fraction=2: must be a number in [0, 1]",
        ),
        ("model.mixup.mixup_alpha=-1", "error: model.mixup.mixup_alpha=-1: must be a number >= 0 (0: off)"),
        ("model.tta_flip=maybe", "error: model.tta_flip=maybe: must be true or false"),
        # a traceback from Lightning, a ZeroDivisionError, and no clipping at all (Lightning skips <= 0) before
        (
            "trainer.precision=foo",
            "error: trainer.precision=foo: must be auto or one of Lightning's: 32-true, bf16-mixed, 16-mixed, "
            "bf16-true, 16-true, 64-true",
        ),
        (
            "trainer.accumulate_grad_batches=0",
            "error: trainer.accumulate_grad_batches=0: must be a positive whole number",
        ),
        (
            "trainer.gradient_clip_val=-1",
            "error: trainer.gradient_clip_val=-1: must be a number >= 0 or null",
        ),
        (
            "trainer=fsdp trainer.strategy.prefetch=-1",
            "error: trainer.strategy.prefetch=-1: must be a whole number >= 0",
        ),
        (
            "trainer=fsdp trainer.strategy.unit_params=1e8",
            "error: trainer.strategy.unit_params=100000000.0: must be a whole number >= 0",
        ),
        (
            "trainer=fsdp trainer.strategy.mixed_precision=fp8",
            "error: trainer.strategy.mixed_precision=fp8: must be null or bf16",
        ),
        # each a traceback before: Lightning's MisconfigurationException wrapped by Hydra, a ZeroDivisionError
        # at the first epoch's end, int('abc') in seed_everything, the DataLoader's ValueError
        ("trainer.max_steps=-7", "error: trainer.max_steps=-7: must be a whole number (-1: no limit)"),
        ("trainer.num_nodes=0", "error: trainer.num_nodes=0: must be a positive whole number"),
        (
            "trainer.check_val_every_n_epoch=0",
            "error: trainer.check_val_every_n_epoch=0: must be a positive whole number or null",
        ),
        (
            "trainer.limit_val_batches=2.5",
            "error: trainer.limit_val_batches=2.5: must be null (all), a count >= 0 or a fraction in [0, 1]",
        ),
        (
            "trainer.limit_train_batches=-1",
            "error: trainer.limit_train_batches=-1: must be null (all), a count >= 0 or a fraction in [0, 1]",
        ),
        ("seed=abc", "error: seed=abc: must be a whole number or null"),
        # 0: Lightning's ZeroDivisionError at the first batch; a half-written duration: its error as it starts
        *(
            (
                f"+trainer.val_check_interval={value}",
                f"error: trainer.val_check_interval={value}: must be null, a count of training batches >= 1, "
                "a fraction of the epoch in [0, 1] or a duration 'DD:HH:MM:SS'",
            )
            for value in ("0", "-3", "2.5", "00:30:00")
        ),
        (
            "datamodule.num_workers=-2",
            "error: datamodule.num_workers=-2: must be a whole number >= 0 or null (its share of the cores)",
        ),
        # a sweep: every value checked before its first job
        # Hydra's "Could not override ... To append to your config use +..." over six lines before
        (
            "-m datamodule.batchsize=64,128",
            "error: unknown config key datamodule.batchsize (did you mean datamodule.batch_size?)",
        ),
        # job 0 trained, then job 1 failed, before
        ("-m datamodule.batch_size=4,-3", "error: datamodule.batch_size=-3: must be a positive whole number"),
        (
            "-m seed=1,2 model.optimizer.lr=range(-1,2)",
            "error: model.optimizer.lr=-1: must be a positive number",
        ),
        # an Optuna interval at its ends; hparams_search sets hydra.mode=MULTIRUN: no -m
        (
            "hparams_search=cifar_optuna model.optimizer.lr=tag(log,interval(-1,0.1))",
            "error: model.optimizer.lr=-1.0: must be a positive number",
        ),
        # a whole number from a float interval: Optuna samples 16.0 ... 256.0 from it
        (
            "hparams_search=cifar_optuna datamodule.batch_size=interval(16,256)",
            "error: datamodule.batch_size=16.0: must be a positive whole number (interval(16, 256) samples "
            "floats; int(interval(16, 256)) samples whole numbers)",
        ),
        # the sweeper's own search space (hydra.sweeper.params), as a hparams_search config holds it
        (
            "hparams_search=cifar_optuna hydra.sweeper.params={datamodule.batch_size:'choice(64,0)'}",
            "error: datamodule.batch_size=0: must be a positive whole number",
        ),
        # several values without -m: Hydra's three-line "Ambiguous value"
        (
            "seed=1,2",
            "error: seed=1,2: a sweep over values needs -m (a list is key=[a,b], a string key='a,b')",
        ),
    ],
)
def test_bad_values_stop_in_one_line_before_the_heavy_imports(override: str, expected: str, capsys):
    with pytest.raises(SystemExit) as stop:
        check_overrides("train", ["experiment=smoke", *override.split()])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip() == expected


def test_a_good_sweep_passes_the_check_with_one_composition_per_value(capsys):
    """Sweeps Hydra runs are not refused (hparams_search takes `seed=1,2` without -m); the check composes the
    sum of the values, not their product."""
    for args in (
        ["-m", "datamodule.batch_size=range(2,6,2)", "seed=1,2"],
        ["hparams_search=cifar_optuna", "seed=1,2", "datamodule.batch_size=8"],
        ["-m", "datamodule=glob(cifar*)", "+hydra.sweeper.params.x=interval(0,1)"],
        ["hparams_search=cifar_optuna", "datamodule.batch_size=int(interval(16,256))"],
        ["-m", "+trainer.val_check_interval=0.25,100,00:00:30:00,null"],
    ):
        check_overrides("train", ["experiment=smoke", *args])  # no exit
    assert capsys.readouterr().err == ""
    variants = sweep_variants(
        ["experiment=smoke", "datamodule.batch_size=2,4,8", "seed=1,2", "+x=interval(0,1)"]
    )
    assert variants == [
        ["experiment=smoke", "datamodule.batch_size=2", "seed=1", "+x=0.0"],
        ["experiment=smoke", "datamodule.batch_size=4", "seed=1", "+x=0.0"],
        ["experiment=smoke", "datamodule.batch_size=8", "seed=1", "+x=0.0"],
        ["experiment=smoke", "datamodule.batch_size=2", "seed=2", "+x=0.0"],
        ["experiment=smoke", "datamodule.batch_size=2", "seed=1", "+x=1.0"],
    ]


def test_library_argument_errors_name_the_config_key(tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    """What only the library can check (torch's optimizer, timm's model) still ends in one line, exit 2."""
    base = [*tiny_overrides(tiny_cifar, data_cache), "logger=none", "trainer.num_sanity_val_steps=0"]
    code, err = fails_in_process("train", [*base, "model.optimizer.betas=[0.9,1.5]"], tmp_path / "a")
    assert code == 2 and err.startswith("error: model.optimizer.betas=[0.9, 1.5]: Invalid beta parameter"), (
        err
    )
    assert len(err.strip().splitlines()) == 1
    code, err = fails_in_process("train", [*base, "model.net.drop_path_rate=abc"], tmp_path / "b")
    assert code == 2 and err.startswith("error: model.net.drop_path_rate=abc"), err
    # Lightning's own check of its arguments, as it starts: one line naming the key (Hydra's wrapper before)
    every_batches = ["trainer.check_val_every_n_epoch=null", "+trainer.val_check_interval=0.5"]
    code, err = fails_in_process("train", [*base, *every_batches], tmp_path / "c")
    assert code == 2 and err.startswith(
        "error: trainer.check_val_every_n_epoch=None: `val_check_interval` should be an integer or a time-based"
    ), err
    assert len(err.strip().splitlines()) == 1
    # a count of batches past the epoch's end: Lightning's ValueError from its fit loop, a traceback before
    code, err = fails_in_process("train", [*base, "+trainer.val_check_interval=1000"], tmp_path / "e")
    assert code == 2 and err.strip() == (
        "error: trainer.val_check_interval=1000: more than the 28 training batches of an epoch; give at most 28 "
        "(or a fraction of the epoch, e.g. 0.25), or count batches across epochs with "
        "trainer.check_val_every_n_epoch=null"
    ), err
    # a GPU the machine lacks: CUDA's driver traceback from the precision probe before, or Lightning's "No
    # supported gpu backend found!" with an explicit precision
    missing = torch.cuda.device_count() + 3
    for precision in ("auto", "32-true"):
        gpu = ["trainer.accelerator=cuda", f"trainer.devices=[{missing}]", f"trainer.precision={precision}"]
        code, err = fails_in_process("train", [*base, *gpu], tmp_path / f"d{precision}")
        assert code == 2 and err.startswith("error: trainer.accelerator=cuda needs a CUDA GPU"), err
        assert "trainer=cpu" in err and len(err.strip().splitlines()) == 1


def test_progress_lines_without_a_terminal_and_one_line_per_epoch(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path, caplog
):
    """Piped to a file (pytest's capture: stdout is no terminal), plain progress lines with step, loss,
    images/s and ETA; one summary line per epoch; no `v_num` on the bar."""
    overrides = [
        *tiny_overrides(tiny_cifar, data_cache),
        "trainer.max_epochs=2",
        "trainer.limit_train_batches=5",
        "trainer.limit_val_batches=1",
        "test=false",
        "trainer.num_sanity_val_steps=0",
        "callbacks.progress_log.interval_s=0",
        "logger=csv",
    ]
    with caplog.at_level(logging.INFO, logger="vitrain.progress"):
        _, objects = train(compose_cfg("train", overrides, tmp_path))
    lines = [r.getMessage() for r in caplog.records if r.name == "vitrain.progress"]
    steps = [ln for ln in lines if " step " in ln and "ETA" in ln]
    assert len(steps) == 2 * 5, lines[:3]
    assert re.fullmatch(
        r"epoch 1/2 batch 1/5 step 1/10 \| loss [\d.]+ \| [\d.]+ images/s \| ETA [\d:]+", steps[0]
    )
    epochs = [ln for ln in lines if " done in " in ln]
    assert len(epochs) == 2 and "val/acc1" in epochs[0] and "train loss" in epochs[0], epochs
    bar = objects.trainer.progress_bar_callback
    assert "v_num" not in bar.get_metrics(objects.trainer, objects.model)


def test_progress_lines_of_evaluation_and_prediction(
    tiny_checkpoint: Path, tiny_cifar: Path, tmp_path: Path, caplog
):
    """eval.py (split=val and test) and predict.py log plain lines too: every `interval_s` the batches,
    images/s and ETA (no terminal here), and a line when done with the images evaluated, which eval.log and
    predict.log keep (the tables go to the console only)."""
    from helpers import predicted

    last = tiny_checkpoint / "checkpoints" / "last.ckpt"
    every_batch = [
        "+callbacks.progress_log._target_=vitrain.callbacks.progress.ProgressLog",
        "+callbacks.progress_log.interval_s=0",
    ]
    with caplog.at_level(logging.INFO, logger="vitrain.progress"):
        val = [f"ckpt_path={last}", "split=val", "datamodule.eval_batch_size=4", *every_batch]
        evaluate(compose_cfg("eval", val, tmp_path / "val"))
        evaluate(
            compose_cfg("eval", [f"ckpt_path={last}", "datamodule.eval_batch_size=8"], tmp_path / "test")
        )
        predicted(last, tiny_cifar / "test", tmp_path / "predict", "batch_size=16")
    lines = [r.getMessage() for r in caplog.records if r.name == "vitrain.progress"]
    batches = [ln for ln in lines if ln.startswith("validation batch")]
    assert len(batches) == 4 and re.fullmatch(
        r"validation batch 1/4 \| [\d.]+ images/s \| ETA [\d:]+", batches[0]
    )
    done = [ln.split(" | ")[:2] for ln in lines if " done in " in ln]
    assert [(d[0].split(" done in ")[0], d[1]) for d in done] == [
        ("validation", "16 images"),
        ("test", "40 images"),
        ("predict", "40 images"),
    ], lines


def test_model_summary_shows_no_zero_flops(capsys):
    from vitrain.callbacks.progress import ModelSummary

    data = [
        (" ", ["0"]),
        ("Name", ["net"]),
        ("Type", ["VisionTransformer"]),
        ("Params", ["1.7 M"]),
        ("Mode", ["train"]),
        ("FLOPs", ["0"]),
    ]
    ModelSummary.summarize(data, 1_700_000, 1_700_000, 6.8, {"train": 10, "eval": 0}, 0)
    out = capsys.readouterr().out
    assert "FLOPs" not in out and "Total params" in out and "VisionTransformer" in out


def test_model_summary_does_not_warn_about_mixed_precision_sizes(capsys):
    """Under bf16-mixed the parameters are fp32: Lightning's size at 32 bits is right, its warning is not."""
    from vitrain.callbacks.progress import ModelSummary

    model = L.LightningModule()
    model.net = torch.nn.Linear(300, 200)
    trainer = L.Trainer(precision="bf16-mixed", accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    model.trainer = trainer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ModelSummary().on_fit_start(trainer, model)
    assert not [w for w in caught if "model summary" in str(w.message)], [str(w.message) for w in caught]
    assert "Total estimated model params size (MB): 0.241" in capsys.readouterr().out  # 60,200 x 4 bytes


def test_lightnings_notes_on_the_templates_own_choices_are_dropped():
    """Its cloud-logger advert and "already configured with model summary callbacks" go; its other lines stay."""
    from vitrain.callbacks.progress import ModelSummary
    from vitrain.tasks.harness import drop_lightning_notes

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    lightning_log = logging.getLogger("lightning.pytorch")
    handler = Keep(level=logging.INFO)
    lightning_log.addHandler(handler)
    level = lightning_log.level
    lightning_log.setLevel(logging.INFO)
    try:
        drop_lightning_notes()
        drop_lightning_notes()  # idempotent
        L.Trainer(accelerator="cpu", callbacks=[ModelSummary()], enable_checkpointing=False)
    finally:
        lightning_log.removeHandler(handler)
        lightning_log.setLevel(level)
    assert any(r.startswith("GPU available") for r in records), records
    assert not [r for r in records if "Tip" in r or "model summary callbacks" in r], records
    notes = logging.getLogger("lightning.pytorch.utilities.rank_zero").filters
    assert sum(type(f).__name__ == "DropLightningNotes" for f in notes) == 1


@pytest.fixture(scope="module")
def folder_checkpoint(tmp_path_factory, tiny_cifar: Path, data_cache: Path) -> Path:
    """A checkpoint of a short image-folder run (datamodule=image_folder: keys CIFAR-10's datamodule lacks)."""
    run_dir = tmp_path_factory.mktemp("folder_run")
    overrides = [
        *tiny_overrides(tiny_cifar, data_cache),
        "datamodule=image_folder",
        "datamodule.img_size=32",
        "datamodule.val_size=16",
        "trainer.limit_train_batches=2",
        "trainer.num_sanity_val_steps=0",
        "logger=none",
        "test=false",
    ]
    train(compose_cfg("train", overrides, run_dir))
    return run_dir / "checkpoints" / "last.ckpt"


def _eval_overrides(ckpt: Path, *extra: str) -> list[str]:
    return checkpoint_overrides([f"ckpt_path={ckpt}", "trainer.accelerator=cpu", *extra])


def test_eval_prints_and_checks_against_the_checkpoints_config(
    folder_checkpoint: Path, tmp_path: Path, capsys, monkeypatch
):
    """eval.py's `datamodule.*` overrides apply to (and are checked against) the checkpoint's config; the
    tree it prints is that config; the per-class table has image counts."""
    monkeypatch.delenv(EVAL_ADDED_ENV, raising=False)
    overrides = _eval_overrides(folder_checkpoint, "datamodule.in_memory=false", "datamodule.batch_size=4")
    check_overrides("eval", overrides)  # composes: no exit
    metrics, objects = evaluate(compose_cfg("eval", overrides, tmp_path))
    assert "test/acc1" in metrics
    assert type(objects.datamodule).__name__ == "ImageFolderDataModule"
    assert objects.datamodule.hparams.in_memory is False
    out = capsys.readouterr().out
    assert "ImageFolderDataModule" in out and "CIFAR10DataModule" not in out
    assert "images" in out and sum(objects.per_class_images.values()) == 40  # 4 test images x 10 classes


def test_eval_refuses_another_model_name_and_unknown_keys(
    folder_checkpoint: Path, tmp_path: Path, monkeypatch
):
    monkeypatch.delenv(EVAL_ADDED_ENV, raising=False)
    code, err = fails_in_process(
        "eval",
        _eval_overrides(folder_checkpoint, "model.net.model_name=vit_small_patch16_224"),
        tmp_path / "a",
    )
    assert code == 2 and "is a vit_tiny_patch16_224" in err and len(err.strip().splitlines()) == 1, err
    code, err = fails_in_process(
        "eval", _eval_overrides(folder_checkpoint, "datamodule.in_memry=false"), tmp_path
    )
    assert code == 2 and "unknown config key datamodule.in_memry" in err and "datamodule.in_memory?" in err, (
        err
    )


@pytest.mark.parametrize("offline", ["HF_HUB_OFFLINE", "no network"])
def test_pretrained_weights_offline_fail_before_the_data(offline: str, tmp_path: Path, monkeypatch):
    """Pretrained weights that cannot be had fail in seconds, before the data (here: absent) is looked at."""
    import socket

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *args, **kwargs: None)
    tried = []  # "in seconds" on any machine, counted rather than timed: the connections tried, their timeouts

    def unreachable(address, timeout=None, *args, **kwargs):
        tried.append((address, timeout))
        raise OSError("Network is unreachable")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    if offline == "HF_HUB_OFFLINE":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        for var in ("HF_HUB_OFFLINE", "HF_ENDPOINT", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.delenv(var, raising=False)
    overrides = ["experiment=finetune_folder", f"datamodule.data_dir={tmp_path}/absent", "logger=none"]
    with pytest.raises(UserError) as err:
        build(compose_cfg("train", overrides, tmp_path))
    # offline: no connection at all; no network: one, given up after 3 s (not the hub client's retries)
    assert tried == ([] if offline == "HF_HUB_OFFLINE" else [(("huggingface.co", 443), 3.0)]), tried
    message = str(err.value)
    assert "model.weights_file=" in message and "HF_HUB_OFFLINE=1" in message, message


def test_smoke_tests_on_a_small_subset(tmp_path: Path):
    cfg = compose_cfg("train", ["experiment=smoke"], tmp_path)
    assert (
        cfg.datamodule.test_subset <= 500 and cfg.trainer.limit_test_batches is None
    )  # a sample, not a prefix


def test_failed_download_leaves_no_empty_data_dir(tmp_path: Path, monkeypatch):
    import torchvision.datasets

    from vitrain.data.readers.cifar import download_cifar, load_cifar
    from vitrain.data.readers.cifar_spec import CIFAR10

    def offline(*args, **kwargs):
        raise OSError("Network is unreachable")

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", offline)
    target = tmp_path / "data" / "cifar10"
    with pytest.raises(DataError, match="downloading CIFAR-10 into"):
        download_cifar(target, CIFAR10)
    assert not target.exists()
    target.mkdir(parents=True)  # an empty folder (from an older failure, or made by hand)
    with pytest.raises(DataError, match="not found at"):
        load_cifar(target, tmp_path / "cache", CIFAR10)


def test_a_failed_start_is_one_line_and_leaves_no_run_dir(tmp_path: Path, data_cache: Path, capsys, caplog):
    """No config tree before the error, no "Output dir" after, no run directory left behind (nor the
    `<task>/runs/` folders Hydra made for it)."""
    run_dir = tmp_path / "logs" / "train" / "runs" / "2026-01-01_00-00-00"
    (run_dir / ".hydra").mkdir(parents=True)  # what Hydra writes before the task starts
    (run_dir / "train.log").write_text("")
    overrides = [*tiny_overrides(tmp_path / "nowhere", data_cache), "extras.print_config=true"]
    with caplog.at_level(logging.INFO):
        code, err = fails_in_process("train", overrides, run_dir)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "not found" in err, err
    assert "CONFIG" not in capsys.readouterr().out
    assert not any("Output dir" in r.getMessage() for r in caplog.records)
    assert list((tmp_path / "logs").iterdir()) == []


def test_a_checkpoint_dir_outside_the_run_dir_is_warned_about(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path, caplog
):
    overrides = [
        *tiny_overrides(tiny_cifar, data_cache),
        f"callbacks.model_checkpoint.dirpath={tmp_path}/runs",
    ]
    build(compose_cfg("train", overrides, tmp_path / "runs" / "one"))
    assert any(
        "shares one last.ckpt" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
    )


def test_the_report_names_cifar_cpus_hybrid_as_built(tmp_path: Path):
    from vitrain.callbacks.run_stats import describe_net

    cfg = compose_cfg("train", ["experiment=cifar_cpu"], tmp_path)
    text = describe_net(OmegaConf.to_container(cfg.model.net), 1_700_000)
    assert text.startswith("vit_tiny_patch16_224 architecture with patch embedding ConvStem")
    assert "depth=4" in text and "embed_dim=192" in text and "1.70 M parameters" in text
    assert text.endswith(", from scratch")
    seed = compose_cfg("train", ["experiment=cifar"], tmp_path)
    text = describe_net(OmegaConf.to_container(seed.model.net))
    assert text.endswith(
        ", started from timm's pretrained weights (hf-hub:timm/vit_base_patch32_224.augreg_in21k_ft_in1k)"
    ), text
    assert describe_net({"model_name": "resnet18", "pretrained": True}, None, "/w/last.ckpt") == (
        "resnet18, started from the weights in /w/last.ckpt"
    )
