"""The library installs with pip; requirements.txt (exact, tested) agrees with pyproject.toml (ranges)."""

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from helpers import ROOT

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11


def pinned() -> dict[str, str]:
    """requirements.txt as {normalised name: exact version}."""
    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            requirement = Requirement(line)
            (spec,) = requirement.specifier
            assert spec.operator == "==", f"requirements.txt pins exact versions: {line}"
            pins[_norm(requirement.name)] = spec.version
    return pins


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_requirements_pins_satisfy_the_declared_ranges():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [Requirement(r) for r in project["dependencies"]]
    declared += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    pins = pinned()
    for requirement in declared:
        name = _norm(requirement.name)
        if name == "vitrain":  # an extra naming other extras
            continue
        if name == "mlflow-skinny":  # pinned through mlflow, which requires the same version
            name = "mlflow"
        assert name in pins, f"{requirement} is declared in pyproject.toml but not pinned in requirements.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"requirements.txt pins {name}=={pins[name]}, outside pyproject.toml's {requirement}"
        )


def test_pre_commit_runs_the_pinned_ruff():
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    [ruff] = [r for r in config["repos"] if r["repo"].endswith("ruff-pre-commit")]
    assert ruff["rev"] == f"v{pinned()['ruff']}"
    assert {h["id"] for h in ruff["hooks"]} == {"ruff-check", "ruff-format"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pip_install_into_a_fresh_venv(tmp_path: Path):
    """`pip install .` into a new virtual environment that reuses this one's packages (no second torch
    download), then the report CLI from outside the repository, without PYTHONPATH."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # `venv --system-site-packages` would expose the base interpreter's packages, not this venv's
    (Path(site) / "parent_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    # setuptools builds in the source tree (build/, *.egg-info): build from a copy
    source = tmp_path / "source"
    shutil.copytree(
        ROOT / "src" / "vitrain", source / "src" / "vitrain", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "--python", str(python), "install"),
            *("--no-deps", "--no-build-isolation", "--no-index", "--quiet", str(source)),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    where = subprocess.run(
        [python, "-c", "import vitrain, vitrain.reporting.report; print(vitrain.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert where.returncode == 0, where.stderr[-2000:]
    assert Path(where.stdout.strip()).is_relative_to(venv), (
        "vitrain came from the repository, not the install"
    )
    cli = subprocess.run(
        [python, "-m", "vitrain.reporting", "--help"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert cli.returncode == 0 and "usage:" in cli.stdout, cli.stderr[-2000:]
    requires = subprocess.run(
        [python, "-c", "import importlib.metadata as m; print('\\n'.join(m.requires('vitrain')))"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "torch>=2.6" in requires and 'wandb>=0.19; extra == "wandb"' in requires
