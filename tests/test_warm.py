"""The suite's warm runs (tests/warm.py) are what a new interpreter would be for the script they run: the same
sys.argv, sys.path, working directory, environment, output and exit code; a run that sets an import-time
variable differently, or asks for it, is a new interpreter; a timeout kills the run and what it started. The
`python <script>` children a warm run starts are warm and see what a new interpreter's would, and their
caller's `Popen` sees their pipes, exit codes and deaths by signal."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import warm

PROBE = """
import json, multiprocessing, os, sys
print(json.dumps({
    "argv": sys.argv, "path": sys.path, "cwd": os.getcwd(), "name": __name__, "probe": os.environ.get("PROBE"),
    "warm": "torch" in sys.modules, "own_session": os.getsid(0) == os.getpid(),
    "start_method": multiprocessing.get_start_method(), "process": multiprocessing.current_process().name,
    "parent": multiprocessing.parent_process() is not None,
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


def test_the_nvml_check_variable_keeps_a_run_warm(tmp_path: Path):
    """Lightning sets PYTORCH_NVML_BASED_CUDA_CHECK on import and the harness may unset it in the test process
    (vitrain/utils/cuda_check.py): torch reads it when asked, so a run with either value is warm, and sees it."""
    script = tmp_path / "probe.py"
    script.write_text(
        PROBE.replace('os.environ.get("PROBE")', 'os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")')
    )
    for value in ("0", "1"):
        done = warm.run_script([script, "0"], _env(PYTORCH_NVML_BASED_CUDA_CHECK=value), tmp_path, timeout=60)
        seen = json.loads(done.stdout)
        assert done.returncode == 0 and seen["warm"] and seen["probe"] == value


def test_a_timeout_kills_the_run_and_what_it_started(tmp_path: Path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    with pytest.raises(subprocess.TimeoutExpired) as stopped:
        warm.run_script([script, "sleep"], _env(), tmp_path, timeout=5)
    grandchild = int(stopped.value.output.strip().splitlines()[-1])
    # before the kill, the run wrote where it waited (faulthandler, on the harness's signal), and the failure
    # shows it
    assert re.search(r'File "[^"]*probe\.py", line \d+ in <module>', str(stopped.value)), str(stopped.value)
    for _ in range(50):  # killed with its process group (a zombie until something reaps it)
        stat = Path(f"/proc/{grandchild}/stat")
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"`sleep` ({grandchild}) outlived the timed-out run")


PARENT = """
import json, os, signal, subprocess, sys
child = os.path.join(os.path.dirname(os.path.abspath(__file__)), "probe.py")
env = {**os.environ, "PROBE": "child"}
done = subprocess.run([sys.executable, child, "3", "c=d"], capture_output=True, text=True, env=env, cwd=sys.argv[1])
threads = "7" if os.environ.get("OMP_NUM_THREADS") != "7" else "5"
other = subprocess.run([sys.executable, child, "0"], capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": threads})
sleeper = subprocess.Popen([sys.executable, "-u", child, "sleep"], stdout=subprocess.PIPE, text=True, start_new_session=True)
seen_sleeping = json.loads(sleeper.stdout.readline())
os.kill(int(sleeper.stdout.readline()), signal.SIGKILL)  # its `sleep 60`
running = sleeper.poll()
sleeper.send_signal(signal.SIGKILL)
print(json.dumps({
    "code": done.returncode, "seen": json.loads(done.stdout), "stderr": done.stderr,
    "other_warm": json.loads(other.stdout)["warm"], "running": running, "killed": sleeper.wait(timeout=30),
    "sleeping_own_session": seen_sleeping["own_session"],
}))
"""


def test_the_python_children_of_a_warm_run_are_warm_and_see_what_new_ones_would(tmp_path: Path):
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "parent.py").write_text(PARENT)
    (tmp_path / "work").mkdir()
    env = _env()
    ran = warm.run_script([tmp_path / "parent.py", tmp_path / "work"], env, tmp_path, timeout=120)
    fresh = _fresh([str(tmp_path / "parent.py"), str(tmp_path / "work")], env, tmp_path)
    assert ran.returncode == fresh.returncode == 0, ran.stderr + fresh.stderr
    seen, expected = json.loads(ran.stdout), json.loads(fresh.stdout)
    assert seen["seen"].pop("warm") and not expected["seen"].pop("warm"), "a warm child, then a new one"
    assert seen["code"] == 3 and seen["stderr"] == "to stderr\n" and seen["seen"]["probe"] == "child"
    assert seen["seen"]["cwd"] == str(tmp_path / "work") and not seen["seen"]["own_session"]
    assert seen["running"] is None and seen["killed"] == -9 and seen["sleeping_own_session"]
    assert not seen["other_warm"], "an import-time variable set otherwise: a new interpreter"
    assert seen == expected


SIGNALLED = """
import os, signal, sys, time
got = []
signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
print(os.getpid(), "torch" in sys.modules, os.environ.get("PROBE"), os.getcwd(), sys.executable, flush=True)
sys.stdin.readline()  # the shim's own standard input: the test writes this line
while not got:
    time.sleep(0.05)
if sys.argv[1] == "term":
    os.kill(os.getpid(), signal.SIGTERM)
sys.exit(7)
"""


@pytest.fixture(scope="module")
def exec_server():
    server = warm.ExecServer()
    yield server
    server.close()


def test_the_exec_servers_python_runs_a_script_warm_and_stands_in_for_it(exec_server, tmp_path: Path):
    """What SLURM's tasks get (tests/test_slurm.py): `python <script>` started by someone else, warm, with the
    shim's environment, working directory and standard streams; the shim passes on SIGUSR1 and exits with
    the run's status, a death by signal included; `python -c` runs in the real interpreter."""
    script = tmp_path / "signalled.py"
    script.write_text(SIGNALLED)
    python = os.path.join(exec_server.bin, "python")
    env = _env(PROBE="shim")
    for how, code in (("exit", 7), ("term", -15)):
        shim = subprocess.Popen(
            [python, str(script), how], cwd=tmp_path, env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        pid, is_warm, probe, cwd, executable = shim.stdout.readline().split()
        assert (is_warm, probe, cwd, executable) == ("True", "shim", str(tmp_path), python)
        assert int(pid) != shim.pid, "the run is the server's child, not the shim"
        shim.stdin.write("go\n")
        shim.stdin.flush()
        time.sleep(0.2)
        shim.send_signal(signal.SIGUSR1)
        assert shim.wait(60) == code, shim.stderr.read()
    done = subprocess.run([python, "-c", "import sys; print(sys.flags.no_site); sys.exit(3)"], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert (done.returncode, done.stdout) == (3, "0\n"), "not -S: the real interpreter ran it"


def test_a_killed_shim_takes_its_run_with_it(exec_server, tmp_path: Path):
    script = tmp_path / "signalled.py"
    script.write_text(SIGNALLED)
    shim = subprocess.Popen(
        [os.path.join(exec_server.bin, "python"), str(script), "exit"], env=_env(), text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    run = int(shim.stdout.readline().split()[0])
    shim.kill()
    shim.wait(10)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(run, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the run {run} outlived its killed shim")
