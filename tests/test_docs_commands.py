"""Every `src/train.py`, `eval.py`, `predict.py`, `export.py` command in README.md and docs/*.md composes as written.

The commands are taken from the fenced shell blocks (line continuations joined, comments dropped) and
composed with Hydra's compose API, as `check_overrides` does before a run: an unknown key, a config option
that does not exist or a value that cannot work fails here in milliseconds. Placeholders (`<run>`, `...`,
`$(date ...)`, `$SLURM_*`) stand for values; a sweep (`-m a=1,2`) composes with its first value; overrides
of Hydra itself (`hydra/launcher=...`, `hydra.sweeper.*`) are the launcher's and left out.
"""

import os
import re
import shlex
import shutil
import subprocess

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser

from helpers import CONFIGS, ROOT
from vitrain.tasks.cli import bad_value
from vitrain.tasks.runs import register_resolvers

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_FENCES = {"", "bash", "sh", "shell", "console"}


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(where, script, arguments) of every entry-point command in a fenced shell block of the docs."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for block in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
            if block.group(1) not in SHELL_FENCES:
                continue
            first_line = text[: block.start()].count("\n") + 2
            command, start = "", 0
            for offset, line in enumerate(block.group(2).split("\n")):
                start = start if command else offset
                if line.rstrip().endswith("\\"):  # continued on the next line
                    command += line.rstrip()[:-1] + " "
                    continue
                command, line = "", command + line
                match = re.search(r"(?:^|\s)(?:\S*/)?src/(train|eval|predict|export)\.py(\s|$)", line)
                if match is None or line.lstrip().startswith("#"):
                    continue
                if not re.search(
                    r"python|torchrun|srun", line[: match.start() + 1]
                ):  # a file list, not a command
                    continue
                words = shlex.split(_placeholders(line[match.end() :]), comments=True)
                found.append((f"{path.relative_to(ROOT)}:{first_line + start}", match.group(1), words))
    return found


def _placeholders(text: str) -> str:
    text = re.sub(r"\$\(date [^)]*\)", "2026-01-01_00-00-00", text)
    text = text.replace('"$@"', "")
    text = re.sub(r"\$\{?[A-Z_]+\}?", "1", text)
    text = re.sub(r"\[(split=\w+)\]", r"\1", text)  # an optional argument, shown in brackets
    text = re.sub(r"<(\w+)>", r"\1", text)  # logs/train/runs/<run>/...: a name of the reader's
    return text.replace("=...", "=/data/x").replace("/.../", "/x/")


def overrides_of(words: list[str]) -> list[str]:
    parser = OverridesParser.create()
    kept = []
    for word in words:
        if word.startswith("-"):
            continue
        key = word.split("=", 1)[0].lstrip("+~")
        if key.startswith(("hydra.", "hydra/")):
            continue
        override = parser.parse_override(word)
        if override.is_sweep_override():
            value = next(iter(override.sweep_string_iterator()))
            word = f"{word.split('=', 1)[0]}={value}"
        kept.append(word)
    return kept


COMMANDS = documented_commands()


def test_the_docs_have_commands():
    scripts = {script for _, script, _ in COMMANDS}
    assert len(COMMANDS) > 40 and scripts == {"train", "eval", "predict", "export"}, COMMANDS


@pytest.fixture(scope="module")
def hydra_configs():
    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        yield
    GlobalHydra.instance().clear()


@pytest.mark.parametrize(("where", "script", "words"), COMMANDS, ids=[c[0] for c in COMMANDS])
def test_documented_command_composes(where: str, script: str, words: list[str], hydra_configs):
    cfg = compose(config_name=script, overrides=overrides_of(words))
    assert bad_value(cfg) is None, f"{where}: {bad_value(cfg)}"


# --- the Makefile's shortcuts ---------------------------------------------------------------------------------


def _make(*args: str) -> subprocess.CompletedProcess:
    if shutil.which("make") is None:
        if os.environ.get("CI"):  # CI installs make (.ci/run): a skip there would hide a broken set-up
            pytest.fail("make is not installed")
        pytest.skip("make is not installed")
    return subprocess.run(["make", "--no-print-directory", *args], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize(
    ("target", "usage"),
    [
        ("eval", "error: make eval CKPT="),
        ("predict", "error: make predict CKPT="),
        ("export", "error: make export CKPT="),
        ("report", "error: make report RUN="),
        ("shards", "error: make shards SRC="),
    ],
)
def test_a_make_target_without_its_variable_says_what_it_needs(target: str, usage: str):
    """`make eval` without CKPT (and the others without theirs): one line naming the variable, exit 2, and
    nothing run (make's -n below shows what runs when it is given)."""
    done = _make(target)
    assert done.returncode == 2 and done.stderr.startswith(usage), done.stderr
    assert "src/" not in done.stdout and "vitrain" not in done.stdout


def test_make_targets_run_the_documented_commands():
    def runs(*args: str) -> str:
        done = _make("-n", *args)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert ".venv/bin/python src/eval.py ckpt_path=/w/last.ckpt" in runs("eval", "CKPT=/w/last.ckpt")
    assert ".venv/bin/python src/predict.py ckpt_path=/w/a.ckpt inputs=/p" in runs(
        "predict", "CKPT=/w/a.ckpt", "IMAGES=/p"
    )
    assert "src/export.py ckpt_path=/w/a.ckpt output=/m" in runs("export", "CKPT=/w/a.ckpt", "OUT=/m")
    assert "output=" not in runs("export", "CKPT=/w/a.ckpt")
    assert "-m vitrain.reporting logs/train/runs/x" in runs("report", "RUN=logs/train/runs/x")
    assert "-m vitrain.data.shards /src s3://b/p --val-size 0.1" in runs(
        "shards", "SRC=/src", "DST=s3://b/p", "SHARDS_ARGS=--val-size 0.1"
    )
    assert "src/train.py experiment=cifar" in runs("train")
