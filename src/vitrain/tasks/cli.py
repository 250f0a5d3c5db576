"""Command-line overrides checked before Hydra runs, so config mistakes end in one actionable line.

Hydra reports a misspelled key as "Could not override ... To append to your config use +key=..." over
several lines: for a typo that advice is wrong. We compose once ourselves, and on failure name the key,
suggest the closest existing one and exit 2.
"""

import difflib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ValueType
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from hydra.types import RunMode
from omegaconf import OmegaConf

from vitrain.errors import UserError, chain

CONFIG_DIR = Path(__file__).resolve().parents[3] / "configs"
# flags after which Hydra does something other than run the task: leave those to Hydra
HYDRA_FLAGS = (
    "-m",
    "--multirun",
    "-h",
    "--help",
    "--hydra-help",
    "-i",
    "--info",
    "-c",
    "--cfg",
    "--shell-completion",
    "-sc",
    "-p",
    "--package",
    "-cp",
    "--config-path",
    "-cn",
    "--config-name",
    "-cd",
    "--config-dir",
    "--experimental-rerun",
)


def _keys(node: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in node.items():
        out.append(f"{prefix}{key}")
        if isinstance(value, dict):
            out.extend(_keys(value, f"{prefix}{key}."))
    return out


def _unknown_key_message(config_name: str, overrides: Sequence[str], bad: str) -> str:
    """'unknown config key a.b (did you mean a.c?)', looking at the config composed without it."""
    rest = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != bad]
    try:
        close = _closest(bad, compose(config_name=config_name, overrides=rest))
    except Exception:
        close = None
    hint = f"did you mean {close}?" if close else f"to add a new key use +{bad}=..."
    return f"unknown config key {bad} ({hint})"


def _closest(key: str, node: Any) -> str | None:
    """The key of config `node` closest to `key` (a typo's likely meaning), if any is close."""
    known = _keys(OmegaConf.to_container(node, resolve=False)) if OmegaConf.is_config(node) else []
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    return close[0] if close else None


def describe(err: Exception, config_name: str, overrides: Sequence[str]) -> str:
    """One line for a Hydra composition error."""
    if isinstance(err, MissingConfigException):
        missing = (err.missing_cfg_file or "").split("/")
        group, choice = ("/".join(missing[:-1]), missing[-1]) if len(missing) > 1 else ("", missing[0])
        options = ", ".join(sorted(err.options or []))
        if group:
            return (
                f"unknown {group}={choice}: choose one of {options}"
                if options
                else f"unknown {group}={choice}"
            )
        return str(err).splitlines()[0]
    if isinstance(err, OverrideParseException):
        return f"cannot parse the override: {str(err).splitlines()[0]}"
    message = str(err)
    if message.startswith("Could not override '"):
        key = message.split("'", 2)[1]
        return _unknown_key_message(config_name, overrides, key)
    if message.startswith("Ambiguous value for argument '"):
        arg = message.split("'", 2)[1]
        return f"{arg}: a sweep over values needs -m (a list is key=[a,b], a string key='a,b')"
    if "Could not append to config" in message:
        key = message.split("'", 2)[1] if "'" in message else "it"
        return f"{key} exists already: set it without the leading +"
    first = next((line.strip() for line in message.splitlines() if line.strip()), type(err).__name__)
    return first


# Lightning's precision names (lightning.fabric.connector's, which loads torch), and their short forms
PRECISIONS = {
    "transformer-engine", "transformer-engine-float16", "16-true", "16-mixed", "bf16-true", "bf16-mixed",
    "32-true", "64-true", "64", "32", "16", "bf16",
}  # fmt: skip

# values checked before torch and Lightning load: key -> (what it must be, test)
VALUE_CHECKS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "model.optimizer.lr": ("a positive number", lambda v: _number(v) and v > 0),
    "model.optimizer.weight_decay": ("a number >= 0", lambda v: _number(v) and v >= 0),
    "model.label_smoothing": ("a number in [0, 1)", lambda v: _number(v) and 0 <= v < 1),
    "model.net.drop_path_rate": (
        "a number in [0, 1) or null (the model's)",
        lambda v: v is None or (_number(v) and 0 <= v < 1),
    ),
    "model.scheduler.warmup_fraction": ("a number in [0, 1]", lambda v: _number(v) and 0 <= v <= 1),
    "model.scheduler.min_lr_ratio": ("a number in [0, 1]", lambda v: _number(v) and 0 <= v <= 1),
    "model.mixup.mixup_alpha": ("a number >= 0 (0: off)", lambda v: _number(v) and v >= 0),
    "model.mixup.cutmix_alpha": ("a number >= 0 (0: off)", lambda v: _number(v) and v >= 0),
    "model.mixup.prob": ("a number in [0, 1]", lambda v: _number(v) and 0 <= v <= 1),
    "model.mixup.switch_prob": ("a number in [0, 1]", lambda v: _number(v) and 0 <= v <= 1),
    "model.tta_flip": ("true or false", lambda v: isinstance(v, bool)),
    "datamodule.batch_size": ("a positive whole number", lambda v: _whole(v) and v > 0),
    "datamodule.num_workers": (
        "a whole number >= 0 or null (its share of the cores)",
        lambda v: v is None or (_whole(v) and v >= 0),
    ),
    "seed": ("a whole number or null", lambda v: v is None or _whole(v)),
    "datamodule.eval_batch_size": (
        "a positive whole number or null",
        lambda v: v is None or (_whole(v) and v > 0),
    ),
    "trainer.max_epochs": (
        "a whole number (-1: no limit) or null",
        lambda v: v is None or (_whole(v) and v >= -1),
    ),
    "trainer.precision": (
        "auto or one of Lightning's: 32-true, bf16-mixed, 16-mixed, bf16-true, 16-true, 64-true",
        lambda v: v == "auto" or str(v) in PRECISIONS,
    ),
    "trainer.max_steps": ("a whole number (-1: no limit)", lambda v: _whole(v) and v >= -1),
    "trainer.num_nodes": ("a positive whole number", lambda v: _whole(v) and v > 0),
    # 0 ends in a ZeroDivisionError at the first epoch's end; null validates on val_check_interval only
    "trainer.check_val_every_n_epoch": (
        "a positive whole number or null",
        lambda v: v is None or (_whole(v) and v > 0),
    ),
    # Lightning's forms; a count of 0 ends in a ZeroDivisionError at the first batch
    "trainer.val_check_interval": (
        "null, a count of training batches >= 1, a fraction of the epoch in [0, 1] or a duration 'DD:HH:MM:SS'",
        lambda v: _validation_interval(v),
    ),
    **{
        f"trainer.limit_{split}_batches": (
            "null (all), a count >= 0 or a fraction in [0, 1]",
            lambda v: v is None or (_whole(v) and v >= 0) or (_number(v) and 0 <= v <= 1),
        )
        for split in ("train", "val", "test")
    },
    "trainer.accumulate_grad_batches": ("a positive whole number", lambda v: _whole(v) and v > 0),
    # Lightning skips clipping for a value <= 0: a negative one (a typo for a norm) would train unclipped, silently
    "trainer.gradient_clip_val": ("a number >= 0 or null", lambda v: v is None or (_number(v) and v >= 0)),
    # trainer=fsdp only (absent otherwise); FSDP2Strategy refuses them too, for runs that skip this check
    "trainer.strategy.prefetch": ("a whole number >= 0", lambda v: _whole(v) and v >= 0),
    "trainer.strategy.unit_params": ("a whole number >= 0", lambda v: _whole(v) and v >= 0),
    "trainer.strategy.mixed_precision": ("null or bf16", lambda v: v is None or v == "bf16"),
    "trainer.strategy.hybrid_shard": (
        "false, true or a shard group size >= 1",
        lambda v: isinstance(v, bool) or (_whole(v) and v >= 0),
    ),
    # predict.py's own keys (configs/predict.yaml)
    "top_k": ("a positive whole number", lambda v: _whole(v) and v > 0),
    "batch_size": ("a positive whole number", lambda v: _whole(v) and v > 0),
    "num_workers": (
        "a whole number >= 0 or null (the cores less one)",
        lambda v: v is None or (_whole(v) and v >= 0),
    ),
    "bad_images": ("stop or skip", lambda v: v in ("stop", "skip")),
    "trainer.devices": (
        "a positive whole number, a list of device ids, -1 or auto",
        lambda v: not _number(v) or v != 0,
    ),
}


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _validation_interval(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, str):  # days:hours:minutes:seconds, whole numbers each
        parts = value.split(":")
        return len(parts) == 4 and all(part.strip().isdigit() for part in parts)
    if _whole(value):
        return value >= 1
    return _number(value) and (0 <= value <= 1 or (value > 1 and value % 1 == 0))


def bad_value(cfg: Any) -> str | None:
    """The first value of VALUE_CHECKS that cannot work (`model.optimizer.lr=-1: must be a positive
    number`), or None. Values that need the run (interpolations of Hydra's runtime) are left to it."""
    absent = object()
    for key, (wanted, ok) in VALUE_CHECKS.items():
        try:
            value = OmegaConf.select(cfg, key, default=absent, throw_on_missing=False)
        except Exception:  # an interpolation that needs the run
            continue
        if value is absent or (OmegaConf.is_config(value) and key == "trainer.devices"):
            continue
        if OmegaConf.is_config(value) or not ok(value):
            return f"{key}={value}: must be {wanted}"
    return None


# what eval.py's `ckpt_path` (`???` in configs/eval.yaml) takes
CKPT_PATH_TAKES = (
    "a .ckpt file, an FSDP checkpoint folder or s3://bucket/key, e.g. "
    "ckpt_path=logs/train/runs/<run>/checkpoints/last.ckpt"
)


# what predict.py's `inputs` takes
INPUTS_TAKE = (
    "a folder of images (searched with its sub-folders), an image file, or a list: inputs=[a.jpg,photos/]"
)


def missing_value(cfg: Any, config_name: str, overrides: Sequence[str]) -> str | None:
    """eval.py's, predict.py's and export.py's checkpoint (and predict.py's images) left out: OmegaConf's
    MissingMandatoryValue traceback otherwise; `ckpt_path=` is what `make eval` without CKPT gives;
    `ckpt_path=last` names a training run to resume, not a checkpoint."""
    if config_name not in ("eval", "predict", "export"):
        return None
    if OmegaConf.is_missing(cfg, "ckpt_path") or cfg.ckpt_path in (None, ""):
        return f"ckpt_path is required: {CKPT_PATH_TAKES}"
    if "ckpt_path=last" in overrides:
        return f"{config_name}.py takes a checkpoint, not ckpt_path=last (a training run's resume): {CKPT_PATH_TAKES}"
    if config_name == "predict" and (OmegaConf.is_missing(cfg, "inputs") or cfg.inputs in (None, "")):
        return f"inputs is required: {INPUTS_TAKE}"
    return None


def launch_problem(cfg: Any) -> str | None:
    """`check_launch_env`'s verdict on the launch variables, here where it needs no torch (devices given as a
    number or as ids): a SLURM task count that disagrees with the trainer then ends in a second on every task,
    not after ~10 s of imports. `auto` and -1 devices are left to the run, which counts the GPUs."""
    from vitrain.distributed.ranks import LaunchError, check_launch_env

    try:
        # the three keys it reads: the trainer's other values may need the run (the run dir's interpolations)
        trainer = {}
        for key in ("num_nodes", "devices", "accelerator"):
            value = OmegaConf.select(cfg, f"trainer.{key}", default=None)
            if value is not None:
                trainer[key] = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        if str(trainer.get("devices", 1)).strip() in ("auto", "-1"):
            return None
        check_launch_env(trainer)
    except LaunchError as err:
        return str(err)
    except Exception:  # an interpolation that needs the run, a value the run reports on: left to the run
        return None
    return None


MULTIRUN_FLAGS = ("-m", "--multirun")
# a sweep is checked value by value (one composition each): beyond this many, the jobs check the rest
_SWEEP_CHECKS = 64


def sweep_variants(overrides: Sequence[str]) -> list[list[str]]:
    """The single runs that check every value of a sweep: the first value of each swept key, then each other
    value with the rest at their first (a sum of compositions, not the product Hydra launches), so that
    `datamodule.batch_size=64,-3` stops before job 0 trains, not after it. An interval (Optuna's) is checked
    at its ends; a glob over a config group, and a sweep inside `hydra.*`, are left to Hydra."""
    choices: list[list[str]] = []
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        if not override.is_sweep_override():
            choices.append([override.input_line])
            continue
        if override.is_hydra_override():  # Hydra's own node takes a sweep's text as it is
            continue
        if override.is_interval_sweep():
            values = [str(override.value().start), str(override.value().end)]
        elif override.is_discrete_sweep() and override.value_type is not ValueType.GLOB_CHOICE_SWEEP:
            values = list(override.sweep_string_iterator())
        else:
            continue
        if values:  # an empty range launches no job
            choices.append([f"{override.get_key_element()}={value}" for value in values])
    first = [values[0] for values in choices]
    variants = [first]
    for i, values in enumerate(choices):
        variants.extend([*first[:i], value, *first[i + 1 :]] for value in values[1:])
    return variants[:_SWEEP_CHECKS]


@contextmanager
def ctrl_c_in_one_line() -> Iterator[None]:
    """Ctrl-C before the task runs (the config check, the ~10 s of importing torch, Lightning and timm): one
    line and exit 130, as the task says it once it runs (vitrain/tasks/harness.py), not the traceback of
    whichever import it landed in."""
    try:
        yield
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        sys.exit(130)


def float_intervals(overrides: Sequence[str]) -> dict[str, str]:
    """key -> `interval(a, b)` for the sweeps over an interval of floats (Optuna samples floats from it)."""
    out = {}
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        if override.is_interval_sweep() and not override.is_hydra_override():
            value = override.value()
            if not (isinstance(value.start, int) and isinstance(value.end, int)):
                out[override.key_or_group] = f"interval({value.start:g}, {value.end:g})"
    return out


def interval_hint(problem: str | None, intervals: dict[str, str]) -> str | None:
    """A whole number refused at an end of a float interval: say how to sample whole numbers."""
    for key, interval in intervals.items():
        if problem and problem.startswith(f"{key}=") and "whole number" in problem:
            return f"{problem} ({interval} samples floats; int({interval}) samples whole numbers)"
    return problem


def check_overrides(config_name: str, argv: Sequence[str] | None = None) -> None:
    """Compose the config from the command line; on a mistake print one line and exit 2. A sweep (`-m`, or a
    config such as hparams_search=... that sets hydra.mode=MULTIRUN) is checked for each of its values,
    those of `hydra.sweeper.params` included."""
    args = list(sys.argv[1:] if argv is None else argv)
    flags = {a.split("=", 1)[0] for a in args if a.startswith("-")}
    if flags & (set(HYDRA_FLAGS) - set(MULTIRUN_FLAGS)):
        return
    overrides = [a for a in args if not a.startswith("-")]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        try:
            parsed = OverridesParser.create().parse_overrides(overrides)
        except OverrideParseException as err:
            _exit(describe(err, config_name, overrides))
        plain = [o.input_line for o in parsed if not o.is_sweep_override()]
        cfg = _composed(config_name, plain)
        if not flags and cfg.hydra.mode != RunMode.MULTIRUN:
            if len(plain) < len(overrides):  # a sweep without -m: Hydra's "Ambiguous value"
                cfg = _composed(config_name, overrides)
            _exit(_problem(cfg, config_name, overrides))
            if "ckpt_path=last" in overrides:
                _check_run_dir(config_name, overrides)
            return
        typed = {o.key_or_group for o in parsed}
        params = OmegaConf.select(cfg, "hydra.sweeper.params") or {}
        swept = [f"{key}={value}" for key, value in params.items() if key not in typed]
        intervals = float_intervals([*swept, *overrides])
        for variant in sweep_variants([*swept, *overrides]):
            _exit(interval_hint(_problem(_composed(config_name, variant), config_name, variant), intervals))


def _composed(config_name: str, overrides: list[str]) -> Any:
    """The config with Hydra's node (its mode and sweeper), or exit 2 with what composition refused."""
    try:
        return compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
    except (ConfigCompositionException, MissingConfigException, OverrideParseException) as err:
        _exit(describe(err, config_name, overrides))


def _problem(cfg: Any, config_name: str, overrides: list[str]) -> str | None:
    return missing_value(cfg, config_name, overrides) or bad_value(cfg) or launch_problem(cfg)


def _exit(problem: str | None) -> None:
    if problem:
        print(f"error: {problem}", file=sys.stderr, flush=True)
        sys.exit(2)


def _check_run_dir(config_name: str, overrides: list[str]) -> None:
    """Resolve the run dir as Hydra will: `ckpt_path=last` with no run to resume stops here, before Hydra
    creates a new run directory."""
    cfg = compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
    try:
        str(cfg.hydra.run.dir)
    except Exception as err:
        cause = next((e for e in chain(err) if isinstance(e, UserError)), None)
        if cause is None:
            raise
        print(f"error: {cause}", file=sys.stderr, flush=True)
        sys.exit(2)


# keys typed `+model.x=...` / `+datamodule.x=...` for eval: new keys, not checked against the checkpoint's
EVAL_ADDED_ENV = "VITRAIN_EVAL_ADDED_KEYS"


def checkpoint_overrides(args: Sequence[str]) -> list[str]:
    """`src/eval.py`'s `model.*` / `datamodule.*` overrides apply to the checkpoint's config, not to eval.yaml's
    defaults (an image-folder checkpoint takes `datamodule.in_memory`, CIFAR-10's datamodule does not): written
    `++key=value` so eval.yaml composes with them; evaluation checks them against the checkpoint's config
    (vitrain.tasks.evaluation.saved_config). Keys typed with `+` are recorded as meant to be new."""
    out, added = [], []
    for arg in args:
        key = arg.split("=", 1)[0]
        bare = key.lstrip("+~")
        if "=" in arg and bare.startswith(("model.", "datamodule.")) and not key.startswith(("~", "++")):
            if key.startswith("+"):
                added.append(bare)
            arg = "++" + arg.lstrip("+")
        out.append(arg)
    if added:
        os.environ[EVAL_ADDED_ENV] = ",".join(added)
    return out


def closest_key(key: str, node: Any) -> str:
    """` (did you mean x?)` for the key of `node` closest to `key`, else ''."""
    close = _closest(key, node)
    return f" (did you mean {close}?)" if close else ""
