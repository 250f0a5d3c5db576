"""The suite's warm runs (tests/warm.py) are what a new interpreter would be for the script they run: the same
sys.argv, sys.path, working directory, environment, output and exit code; a run that sets an import-time
variable differently, or asks for it, is a new interpreter; a timeout kills the run and what it started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import warm

PROBE = """
import json, os, sys
print(json.dumps({
    "argv": sys.argv, "path": sys.path, "cwd": os.getcwd(), "name": __name__, "probe": os.environ.get("PROBE"),
    "warm": "torch" in sys.modules, "own_session": os.getsid(0) == os.getpid(),
}))
print("to stderr", file=sys.stderr)
if sys.argv[1] == "raise":
    raise ValueError("raised by the probe")
if sys.argv[1] == "sleep":
    import subprocess, time
    child = subprocess.Popen(["sleep", "60"])
    print(child.pid, flush=True)
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **extra}


def _fresh(target: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *target], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("code", ["0", "3"])
def test_a_warm_run_sees_what_a_new_interpreter_sees(code: str, tmp_path: Path):
    script = tmp_path / "bin" / "probe.py"
    script.parent.mkdir()
    script.write_text(PROBE)
    env = _env(PROBE="yes", PYTHONPATH=str(tmp_path / "lib"))
    ran = warm.run_script([script, code, "a=b"], env, tmp_path, timeout=60)
    fresh = _fresh([str(script), code, "a=b"], env, tmp_path)
    assert ran.returncode == fresh.returncode == int(code)
    assert ran.stderr == fresh.stderr == "to stderr\n"
    seen, expected = json.loads(ran.stdout), json.loads(fresh.stdout)
    assert seen.pop("warm") and not expected.pop("warm"), "the first ran warm, the second fresh"
    assert seen.pop("own_session")
    expected.pop("own_session")
    assert seen == expected


def test_a_module_run_and_an_uncaught_exception(tmp_path: Path):
    (tmp_path / "probe_mod.py").write_text(PROBE)
    env = _env()
    ran = warm.run_script(["-m", "probe_mod", "raise"], env, tmp_path, timeout=60)
    fresh = _fresh(["-m", "probe_mod", "raise"], env, tmp_path)
    assert ran.returncode == fresh.returncode == 1
    for done in (ran, fresh):
        assert (
            done.stderr.startswith("to stderr\nTraceback")
            and "ValueError: raised by the probe" in done.stderr
        )
    seen, expected = json.loads(ran.stdout), json.loads(fresh.stdout)
    assert (seen["argv"], seen["path"], seen["name"]) == (
        expected["argv"],
        expected["path"],
        expected["name"],
    )


def test_an_import_time_variable_or_fresh_true_gives_a_new_interpreter(tmp_path: Path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    threads = "7" if os.environ.get("OMP_NUM_THREADS") != "7" else "5"
    for env, fresh in ((_env(OMP_NUM_THREADS=threads), False), (_env(), True)):
        done = warm.run_script([script, "0"], env, tmp_path, timeout=60, fresh=fresh)
        assert done.returncode == 0 and not json.loads(done.stdout)["warm"]


def test_a_timeout_kills_the_run_and_what_it_started(tmp_path: Path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    with pytest.raises(subprocess.TimeoutExpired) as stopped:
        warm.run_script([script, "sleep"], _env(), tmp_path, timeout=5)
    grandchild = int(stopped.value.output.strip().splitlines()[-1])
    for _ in range(50):  # killed with its process group (a zombie until something reaps it)
        stat = Path(f"/proc/{grandchild}/stat")
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"`sleep` ({grandchild}) outlived the timed-out run")
