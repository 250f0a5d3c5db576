"""Entry-point runs in processes forked from a server that has already imported torch, Lightning and timm.

A fresh `python src/train.py` spends ~11 CPU-s here importing them before it does anything, and the suite
makes dozens of such runs on two cores. A warm run is still a process of its own (its own pid, session,
environment, working directory, sys.argv, sys.path and output files), forked from a forkserver whose only
work was those imports, and it runs `src/<script>` (or `-m module`) as `__main__`, as the interpreter would.
What it cannot show is a fault of the start-up itself (import order, environment read at import time), so a
run whose environment differs from the server's in a variable the libraries read on import starts fresh, and
the tests about the start-up ask for `fresh=True`. The processes a run starts itself (Lightning's other DDP
ranks, torchrun's workers, a benchmark's training runs) are new interpreters either way.

Only the standard library here: the forkserver imports this module to run `_child`.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import multiprocessing
import os
import re
import runpy
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Sequence
from pathlib import Path

PRELOAD = ["torch", "lightning", "timm", "torchmetrics", "hydra", "omegaconf"]
# what the preloaded libraries read when they are imported: a run that sets one of these differently from the
# server needs a new interpreter (PYTHONPATH is applied in the child, as Python does at start-up)
IMPORT_TIME = re.compile(
    r"^(OMP_|MKL_|KMP_|GOMP_|HF_|HUGGINGFACE_|TORCH|PYTORCH_|CUDA_|NCCL_|LD_|MALLOC_|PYTHON)"
)
SERVER_ENV = {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}

_server_env: dict[str, str] | None = None
_base_path: list[str] = []


def _start_server() -> dict[str, str]:
    """Start this process's forkserver (once) in a clean environment; return that environment."""
    global _server_env, _base_path
    if _server_env is None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | SERVER_ENV
        # a new interpreter's sys.path after its first entry (the script's folder or '')
        probe = "import json, sys; print(json.dumps(sys.path[1:]))"
        _base_path = json.loads(subprocess.check_output([sys.executable, "-c", probe], env=env, text=True))
        multiprocessing.set_forkserver_preload(PRELOAD)
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(env)
        try:
            from multiprocessing import forkserver

            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _server_env = env
    return _server_env


def warm_ok(env: dict[str, str]) -> bool:
    """True when `env` reads like the server's in everything the preloaded libraries read on import."""
    server = _start_server()
    names = {n for n in (*env, *server) if IMPORT_TIME.match(n) and n != "PYTHONPATH"}
    return all(env.get(n) == server.get(n) for n in names)


def _child(target: list[str], cwd: str, env: dict[str, str], out: str, err: str | None, base_path: list[str]):
    """In the forked process: become `python <script> args...` (or `python -m module args...`) and exit."""
    os.setsid()  # a session of its own: a timeout kills the run with everything it started
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    out_fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err_fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if err else out_fd
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    for fd in {out_fd, err_fd}:
        os.close(fd)
    # unbuffered text streams (PYTHONUNBUFFERED=1, as the tests' runs have)
    sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)  # noqa: SIM115
    module = target[1] if target[0] == "-m" else None
    args = target[2:] if module else target[1:]
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [cwd if module else os.path.dirname(target[0]), *extra, *base_path]
    sys.argv = [target[0] if not module else "-m", *args]
    if "numpy" in sys.modules:  # a new interpreter seeds numpy's global generator from the OS
        sys.modules["numpy"].random.seed()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    code = 0
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target[0], run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:  # what the interpreter prints for an uncaught exception
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()  # what interpreter shutdown runs (loggers' flush, W&B's finish)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class ScriptRun:
    """A started run, warm (forked from the server) or with `fresh=True`, or when `env` sets what the
    libraries read on import differently, a new interpreter; always in a session of its own, its output in
    files (a pipe would stay open while a process it started lives on). `wait()` gives what
    `subprocess.run(..., capture_output=True, text=True)` does."""

    def __init__(
        self,
        target: Sequence[str | Path],
        env: dict[str, str],
        cwd: Path,
        merge_stderr: bool = False,
        fresh: bool = False,
    ):
        target = [str(t) for t in target]
        self.args = [sys.executable, *target]
        self.warm = not fresh and warm_ok(env)
        self._tmp = tempfile.TemporaryDirectory(prefix="run-")
        self._out = os.path.join(self._tmp.name, "stdout")
        self._err = None if merge_stderr else os.path.join(self._tmp.name, "stderr")
        if self.warm:
            ctx = multiprocessing.get_context("forkserver")
            self._process = ctx.Process(
                target=_child, args=(target, str(cwd), dict(env), self._out, self._err, _base_path)
            )
            self._process.start()
            self.pid = self._process.pid
        else:
            with open(self._out, "wb") as out, open(self._err or os.devnull, "wb") as err:
                self._popen = subprocess.Popen(
                    self.args, cwd=cwd, env=env, stdout=out, stderr=err if self._err else subprocess.STDOUT,
                    start_new_session=True,
                )  # fmt: skip
            self.pid = self._popen.pid

    def kill(self) -> None:
        """SIGKILL to the run's process group: the run and whatever it started that is still there."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)

    def _join(self, timeout: float | None) -> int | None:
        if self.warm:
            self._process.join(timeout)
            return self._process.exitcode
        try:
            return self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def wait(self, timeout: float | None = None) -> subprocess.CompletedProcess:
        """Wait for the end; on a timeout kill the run and raise `subprocess.TimeoutExpired`."""
        code = self._join(timeout)
        if code is None:
            self.kill()
            self._join(None)

        def read(path: str | None) -> str:
            return Path(path).read_text(errors="replace") if path and os.path.exists(path) else ""

        stdout, stderr = read(self._out), read(self._err)
        self._tmp.cleanup()
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(self.args, code, stdout, stderr)


def run_script(
    target: Sequence[str | Path], env: dict[str, str], cwd: Path, timeout: float, fresh: bool = False
) -> subprocess.CompletedProcess:
    """`python *target` (a script and its arguments, or "-m", a module and its arguments) with `env` in
    `cwd`, like `subprocess.run(..., capture_output=True, text=True, timeout=timeout)`: see `ScriptRun`."""
    return ScriptRun(target, env, cwd, fresh=fresh).wait(timeout)
