"""Entry-point runs in processes forked from a server that has already imported torch, Lightning and timm.

A fresh `python src/train.py` spends ~11 CPU-s here importing them before it does anything, and the suite
makes dozens of such runs on two cores. A warm run is still a process of its own (its own pid, session,
environment, working directory, sys.argv, sys.path and output files), forked from a forkserver whose only
work was those imports, and it runs `src/<script>` (or `-m module`) as `__main__`, as the interpreter would.

The processes a warm run starts as `python <script> ...` or `python [-u] -m <module> ...` (Lightning's other
DDP ranks, torchrun's workers, a benchmark's training runs) are warm too: before its script runs, each warm
process forks a "zygote", an idle copy of itself in the same session and process group, and its
`subprocess.Popen` asks that copy to fork such children. A child so made has its own pid, its command line,
environment, working directory and standard streams (pipes included), runs in the caller's process group
(or a new session if asked), takes signals at its own pid, and its exit status reaches the caller's `Popen`
(`poll`, `wait`, `communicate`, `returncode`) through the zygote, which is its parent. Any other command,
or one with `preexec_fn`, `pass_fds`, a user or group change, goes to the real `Popen`.

Processes that no warm process starts (SLURM's tasks and submitit's jobs, which slurmstepd starts; the MLflow
server the tests start) get a `python` that asks an exec server, forked from the warm server, for the run and
stands in for it (`ExecServer`).

What none of this can show is a fault of the start-up itself (import order, environment read at import
time), so a run or child whose environment differs from the server's in a variable the libraries read on
import is a new interpreter, with everything it starts, and the tests about the start-up ask for
`fresh=True`.

Only the standard library here: the forkserver imports this module to run `_child`.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import json
import multiprocessing
import os
import re
import runpy
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Sequence
from pathlib import Path

# tensorboard's writer too: every run with the default logger imports it (~0.25 CPU-s each)
PRELOAD = ["torch", "lightning", "timm", "torchmetrics", "hydra", "omegaconf", "torch.utils.tensorboard"]
# what the preloaded libraries read when they are imported: a run that sets one of these differently from the
# server needs a new interpreter (PYTHONPATH is applied in the child, as Python does at start-up);
# TORCHELASTIC_* and TORCH_NCCL_* are what torchrun sets for its workers, read when used, not on import;
# KMP_DUPLICATE_LIB_OK and KMP_INIT_AT_FORK are what scikit-learn and joblib set in their own process on
# import (Optuna imports scikit-learn): only Intel's/LLVM's OpenMP reads them, and the OpenMP runtime that
# torch and scikit-learn ship here is GNU libgomp, which reads no KMP_* variable;
# TORCHINDUCTOR_CACHE_DIR is read each time Inductor looks for its cache (torch/_inductor/runtime/
# cache_dir_utils.py), as the template sets it from `paths.cache_dir`;
# PYTORCH_NVML_BASED_CUDA_CHECK is set by Lightning's import and unset by vitrain's harness where NVML cannot
# load (vitrain/utils/cuda_check.py): torch reads it at each CUDA availability question, not on import
IMPORT_TIME = re.compile(
    r"^(OMP_|MKL_|KMP_|GOMP_|HF_|HUGGINGFACE_|TORCH|PYTORCH_|CUDA_|NCCL_|LD_|MALLOC_|PYTHON)"
)
RUN_TIME = re.compile(
    r"^(PYTHONPATH$|TORCHELASTIC_|TORCH_NCCL_|TORCHINDUCTOR_CACHE_DIR$|KMP_DUPLICATE_LIB_OK$|KMP_INIT_AT_FORK$|"
    r"PYTORCH_NVML_BASED_CUDA_CHECK$)"
)
SERVER_ENV = {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
# signals a zygote ignores: what is sent to a run's process group is for the run and its children
_SHIELDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
# a warm process (and the DataLoader workers it forks) writes every thread's Python stack to its stderr on
# this signal, sent to a timed-out run's process group before it is killed: a hang in CI then says where
# each rank and worker waited. SIGUSR2: what neither the template nor Lightning uses (SLURM's requeue is USR1)
STACKS_SIGNAL = signal.SIGUSR2

_server_env: dict[str, str] | None = None
_base_path: list[str] = []
_zygote: socket.socket | None = None  # this process's line to its zygote
_RealPopen = subprocess.Popen
# the class of a main process's `multiprocessing.current_process()` (the module deletes its name): this
# module is imported in the test process, and in a forked child before it becomes a multiprocessing child
_MAIN_PROCESS = type(multiprocessing.process._current_process)


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


def warm_forkserver() -> str:
    """The start method whose processes come from this process's warm server (its imports done), started if
    need be: for `torch.multiprocessing.start_processes(..., start_method=warm_forkserver())`. Such a
    process has the server's environment and this process's sys.path and working directory; a spawned one
    would spend ~10 CPU-s importing torch first."""
    _start_server()
    return "forkserver"


def warm_ok(env: dict[str, str]) -> bool:
    """True when `env` reads like the server's in everything the preloaded libraries read on import."""
    server = _start_server()
    names = {n for n in (*env, *server) if IMPORT_TIME.match(n) and not RUN_TIME.match(n)}
    return all(env.get(n) == server.get(n) for n in names)


def _child(
    target: list[str],
    cwd: str,
    env: dict[str, str],
    out: str,
    err: str | None,
    server: tuple,
    file_size_limit: int | None = None,
):
    """In the process forked by the forkserver: a session of its own, output to files, then `_become`."""
    global _server_env, _base_path
    # the forkserver's heap (what it preloaded, never freed) out of this process's and its children's full
    # collections, as a run's own start-up freezes it (vitrain/utils/host_memory.py: there after a collection,
    # which here would traverse, and copy on write, every page of that heap)
    gc.freeze()
    _server_env, _base_path = server
    os.setsid()  # a session of its own: a timeout kills the run with everything it started
    _limit_file_size(file_size_limit)
    out_fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err_fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if err else out_fd
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    for fd in {out_fd, err_fd}:
        os.close(fd)
    _become(target, cwd, env)


def _limit_file_size(limit: int | None) -> None:
    """No file written past `limit` bytes: the write fails with EFBIG (as on a full disk with ENOSPC) instead
    of SIGXFSZ killing the process."""
    if limit is not None:
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def _become(target: list[str], cwd: str, env: dict[str, str]) -> None:
    """Become `python <script> args...` (or `python -m module args...`) on fds 0-2 as they are, and exit."""
    _start_zygote()  # first: the zygote is this process as the forkserver left it
    faulthandler.register(STACKS_SIGNAL, all_threads=True, chain=False)
    subprocess.Popen = _WarmPopen
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    # unbuffered text streams (PYTHONUNBUFFERED=1, as the tests' runs have)
    sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)  # noqa: SIM115
    module = target[1] if target[0] == "-m" else None
    args = target[2:] if module else target[1:]
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [cwd if module else os.path.dirname(os.path.abspath(target[0])), *extra, *_base_path]
    sys.argv = [target[0] if not module else "-m", *args]
    # multiprocessing as in a new main process: its default start method (fork, not the forkserver this
    # process came from: DataLoader workers would start a forkserver of their own and import everything
    # again), no parent, the main process's name
    if _MAIN_PROCESS.__name__ == "_MainProcess":  # not where a multiprocessing child imported this module
        multiprocessing.process._current_process = _MAIN_PROCESS()
        multiprocessing.process._parent_process = None
    multiprocessing.set_start_method(None, force=True)
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


# --- the zygote: forks this process's warm children, and is their parent -----------------------------------


def _start_zygote() -> None:
    global _zygote
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    if os.fork() == 0:
        ours.close()
        try:
            _serve(theirs)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(0)
    theirs.close()
    _zygote = ours


def _server_signals() -> tuple[int, int]:
    """A forking server's signals: the ones meant for its runs ignored, and a pipe (read end, write end) that
    wakes its `select` when a child ends."""
    for sig in _SHIELDED:
        signal.signal(sig, signal.SIG_IGN)
    wake = os.pipe()
    for fd in wake:
        os.set_blocking(fd, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake[1])
    return wake


def _fork_run(wake: tuple[int, int], lines: Sequence[socket.socket]) -> int:
    """os.fork(); in the child, without the server's wake-up pipe and its `lines`."""
    pid = os.fork()
    if pid == 0:
        signal.set_wakeup_fd(-1)
        for fd in wake:
            os.close(fd)
        for line in lines:
            line.close()
    return pid


def _ended(wake_r: int) -> list[tuple[int, int]]:
    """The pid and wait status of every child that has ended (reaped), the wake-up pipe drained."""
    with contextlib.suppress(BlockingIOError):
        os.read(wake_r, 4096)
    ended = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        ended.append((pid, status))
    return ended


def _serve(control: socket.socket) -> None:
    """Fork a child per request; send each caller its child's pid, then its wait status. Ends when the
    process it serves is gone (with every copy of its end of `control`) and no child is left."""
    wake = _server_signals()
    callers: dict[int, socket.socket] = {}
    serving = True
    while serving or callers:
        ready, _, _ = select.select([control, wake[0]] if serving else [wake[0]], [], [], 5.0)
        if control in ready:
            try:
                msg, fds, _, _ = socket.recv_fds(control, 1 << 20, 4)
            except OSError:
                msg, fds = b"", []
            if not msg:
                serving = False
                control.close()
            else:
                caller = socket.socket(fileno=fds[0])
                pid = _fork_run(wake, [control, caller, *callers.values()])
                if pid == 0:
                    _warm_child(json.loads(msg), fds[1:])
                for fd in fds[1:]:
                    os.close(fd)
                with contextlib.suppress(OSError):
                    caller.sendall(struct.pack("q", pid))
                callers[pid] = caller
        for pid, status in _ended(wake[0]):  # each ended child's caller gets the status waitpid gave
            caller = callers.pop(pid, None)
            if caller is not None:
                with contextlib.suppress(OSError):
                    caller.sendall(struct.pack("q", status))
                caller.close()


def _warm_child(request: dict, stdio: list[int]) -> None:
    """In the zygote's new child: the caller's standard streams, signals as a new process has them, a new
    session if asked; then the script."""
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for sig in _SHIELDED:
            signal.signal(sig, signal.SIG_DFL)
        for fd, target in zip(stdio, (0, 1, 2), strict=True):
            os.dup2(fd, target)
        for fd in set(stdio) - {0, 1, 2}:
            os.close(fd)
        if request["new_session"]:
            os.setsid()
        _become(request["target"], request["cwd"], request["env"])
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(1)


# --- `python` on PATH for processes no warm process started (SLURM's tasks) ---------------------------------

# what a shim passes on to its run: what SLURM sends a job step's processes (scancel --signal, the time limit's
# warning, the end of a requeued or cancelled job) and a terminal's keys
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


class ExecServer:
    """A `python` (in the folder `bin`, for the front of PATH) whose `python <script>` and `python -m
    <module>` runs are warm, for the processes that no warm process starts: SLURM's tasks, which slurmstepd
    starts as `srun python src/train.py ...` (about 12 CPU-s of imports each otherwise).

    That `python` is a shim (`shim`): it sends its command line, environment, working directory and
    standard streams to this server, a process forked from the warm server, which forks the run from itself
    (in a session of its own). The shim stays in the job step in the run's place: it passes on the signals
    SLURM sends it and exits with the run's status (killed by a signal: by the same signal); when it is
    killed (SIGKILL), the server kills the run's process group. The run's sys.executable is the shim, as an
    interpreter started by that path reports it: what it starts with sys.executable comes here too (submitit's
    jobs, `<sys.executable> -m submitit.core._submit`). Anything else (`python -c`, an environment
    that reads differently on import) runs in the real interpreter, which the shim then execs."""

    def __init__(self) -> None:
        server = _start_server()
        self._dir = tempfile.mkdtemp(prefix="warm-exec-")  # short: a Unix socket's path has < 108 bytes
        self.socket = os.path.join(self._dir, "socket")
        self.bin = os.path.join(self._dir, "bin")
        os.mkdir(self.bin)
        shim = os.path.join(self.bin, "python")
        with open(shim, "w") as f:  # -S: the standard library alone, no site-packages to scan
            f.write(
                f"#!{sys.executable} -S\nimport sys\nsys.path.insert(0, {os.path.dirname(__file__)!r})\n"
                f"import warm\nwarm.shim({sys.executable!r}, {self.socket!r})\n"
            )
        os.chmod(shim, 0o755)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(self.socket)
        listener.listen(16)
        ctx = multiprocessing.get_context("forkserver")
        self._process = ctx.Process(target=_exec_serve, args=(listener, (server, _base_path)), daemon=True)
        self._process.start()
        listener.close()

    def close(self) -> None:
        self._process.kill()
        self._process.join(10)
        shutil.rmtree(self._dir, ignore_errors=True)


def _exec_serve(listener: socket.socket, server: tuple) -> None:
    """The exec server's loop: a warm child per shim that asks, signals passed on, each status sent back."""
    global _server_env, _base_path
    _server_env, _base_path = server
    wake = _server_signals()
    runs: dict[socket.socket, int | None] = {}  # a shim's line -> its run's pid
    lines: dict[int, socket.socket] = {}  # a run's pid -> its shim's line
    while True:
        ready, _, _ = select.select([listener, wake[0], *runs], [], [], 5.0)
        if listener in ready:
            line, _ = listener.accept()
            runs[line] = None
        for line in [r for r in ready if r in runs]:
            try:
                msg, fds, _, _ = socket.recv_fds(line, 1 << 20, 3)
            except OSError:
                msg, fds = b"", []
            pid = runs[line]
            if not msg:  # the shim is gone (killed): so is its run
                if pid is not None:
                    with contextlib.suppress(OSError):
                        os.killpg(pid, signal.SIGKILL)
                runs.pop(line)
                line.close()
                continue
            request = json.loads(msg)
            if "signal" in request:
                if pid is not None:
                    with contextlib.suppress(OSError):
                        os.kill(pid, request["signal"])
                continue
            target = _warm_target([sys.executable, *request["argv"]], None, request["env"])
            if target is None or len(fds) != 3:
                for fd in fds:
                    os.close(fd)
                with contextlib.suppress(OSError):  # a shim gone meanwhile: the next select sees it
                    line.send(b'{"exec": true}')
                continue
            pid = _fork_run(wake, [listener, *runs])
            if pid == 0:
                # what an interpreter started by that path reports (it does not resolve links): the runs it
                # starts with sys.executable (submitit's jobs, Lightning's other ranks) come here too
                sys.executable = request["executable"]
                _warm_child({**request, "target": target, "new_session": True}, fds)
            for fd in fds:
                os.close(fd)
            runs[line], lines[pid] = pid, line
            with contextlib.suppress(OSError):
                line.send(json.dumps({"pid": pid}).encode())
        for pid, status in _ended(wake[0]):  # each ended run's shim gets the status waitpid gave
            line = lines.pop(pid, None)
            if line is not None and line in runs:
                with contextlib.suppress(OSError):
                    line.send(json.dumps({"status": status}).encode())
                runs.pop(line)
                line.close()


def shim(real: str, path: str) -> None:
    """`python ...` as the exec server at `path` runs it (`ExecServer`), or as `real` does where it cannot."""
    argv = sys.argv[1:]
    line = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stdio = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            stdio.append(fd)
        except OSError:  # a closed standard stream: the run gets /dev/null there
            stdio.append(os.open(os.devnull, os.O_RDWR))
    try:
        line.connect(path)
        request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "executable": sys.argv[0]}
        socket.send_fds(line, [json.dumps(request).encode()], stdio)
        reply = json.loads(line.recv(1 << 16) or b'{"exec": true}')
    except OSError:  # no server (any more): the real interpreter
        reply = {"exec": True}
    if reply.get("exec"):
        line.close()
        os.execv(real, [real, *argv])

    def forward(signum: int, frame) -> None:
        with contextlib.suppress(OSError):
            line.send(json.dumps({"signal": signum}).encode())

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    while True:
        msg = line.recv(1 << 16)
        if not msg:  # the server went away without a status
            os._exit(1)
        status = json.loads(msg).get("status")
        if status is not None:
            break
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # ended by a signal: so does the shim, for whoever waits on it
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)


def _warm_target(args, executable, env: dict) -> list[str] | None:
    """The script (or "-m", module) and its arguments when `args` is `python [-u] <that>` and `env` reads
    like the server's on import, else None."""
    if executable is not None or isinstance(args, (str, bytes, os.PathLike)) or not args:
        return None
    argv = [os.fspath(a) for a in args]
    if any(not isinstance(a, str) for a in argv) or os.path.abspath(argv[0]) != os.path.abspath(
        sys.executable
    ):
        return None
    rest = argv[1:]
    while rest and rest[0] == "-u":  # unbuffered: warm children are (their streams are line-buffered)
        rest = rest[1:]
    if not rest or (rest[0].startswith("-") and (rest[0] != "-m" or len(rest) < 2)):
        return None
    if any(not isinstance(k, str) or not isinstance(v, str) for k, v in env.items()):
        return None
    return rest if warm_ok(env) else None


class _WarmPopen(_RealPopen):
    """`subprocess.Popen` in a warm process: `python <script>` children come from the zygote (module
    docstring), everything else as usual. Overrides the POSIX `Popen`'s fork/exec and waitpid steps only."""

    _warm_line: socket.socket | None = None

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, *more):  # fmt: skip
        # what a forked child cannot do as asked goes to the real Popen: a shell, code run before exec, extra
        # fds, another user, group, umask or process group
        forkable = not shell and preexec_fn is None and not pass_fds and umask == -1
        forkable = forkable and (gid, gids, uid) == (None, None, None) and all(m == -1 for m in more)
        full_env = dict(os.environ if env is None else env)
        target = _warm_target(args, executable, full_env) if forkable and _zygote is not None else None
        if target is not None:
            mine, theirs = socket.socketpair()
            request = {
                "target": target,
                "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
                "env": full_env,
                "new_session": bool(start_new_session),
            }
            stdio = [p2cread, c2pwrite, errwrite]
            stdio = [fd if fd != -1 else own for fd, own in zip(stdio, (0, 1, 2), strict=True)]
            try:
                socket.send_fds(_zygote, [json.dumps(request).encode()], [theirs.fileno(), *stdio])
                pid = struct.unpack("q", _read(mine, 8))[0]
            except OSError:
                target = None  # the zygote is gone: a new interpreter then
                mine.close()
            finally:
                theirs.close()
        if target is None:
            return super()._execute_child(
                args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags,
                shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, restore_signals, gid, gids,
                uid, umask, start_new_session, *more,
            )  # fmt: skip
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        self.pid = pid
        self._child_created = True
        self._warm_line = mine

    def _status(self, block: bool) -> int | None:
        """The child's wait status from the zygote; None while it runs. A line closed without a status (the
        zygote killed with the run's process group) reads as SIGKILL."""
        self._warm_line.setblocking(block)
        try:
            data = _read(self._warm_line, 8)
        except BlockingIOError:
            return None
        return struct.unpack("q", data)[0] if len(data) == 8 else signal.SIGKILL

    def _internal_poll(self, _deadstate=None, *args, **kwargs):
        if self._warm_line is None:
            return super()._internal_poll(_deadstate, *args, **kwargs)
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None:
                    status = self._status(block=False)
                    if status is not None:
                        self._handle_exitstatus(status)
            finally:
                self._waitpid_lock.release()
        return self.returncode

    def _try_wait(self, wait_flags):
        if self._warm_line is None:
            return super()._try_wait(wait_flags)
        status = self._status(block=not wait_flags & os.WNOHANG)
        return (0, 0) if status is None else (self.pid, status)


def _read(line: socket.socket, size: int) -> bytes:
    """Up to `size` bytes: fewer only at the end of the stream; BlockingIOError if none are there yet."""
    data = b""
    while len(data) < size:
        try:
            part = line.recv(size - len(data))
        except BlockingIOError:
            if data:
                line.setblocking(True)
                continue
            raise
        if not part:
            break
        data += part
    return data


class RunTimedOut(subprocess.TimeoutExpired):
    """A run killed after its timeout; its message ends with the run's last output (stacks, log lines)."""

    def __str__(self) -> str:
        tail = (self.stderr or self.output or "")[-20000:]
        return f"{super().__str__()}; the end of its output:\n{tail}"


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
        file_size_limit: int | None = None,
    ):
        target = [str(t) for t in target]
        self.args = [sys.executable, *target]
        self.warm = not fresh and warm_ok(env)
        self._tmp = tempfile.TemporaryDirectory(prefix="run-")
        self._out = os.path.join(self._tmp.name, "stdout")
        self._err = None if merge_stderr else os.path.join(self._tmp.name, "stderr")
        if self.warm:
            ctx = multiprocessing.get_context("forkserver")
            server = (_server_env, _base_path)
            self._process = ctx.Process(
                target=_child,
                args=(target, str(cwd), dict(env), self._out, self._err, server, file_size_limit),
            )
            self._process.start()
            self.pid = self._process.pid
        else:
            with open(self._out, "wb") as out, open(self._err or os.devnull, "wb") as err:
                self._popen = subprocess.Popen(
                    self.args, cwd=cwd, env=env, stdout=out, stderr=err if self._err else subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=None if file_size_limit is None else lambda: _limit_file_size(file_size_limit),
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
        """Wait for the end; on a timeout kill the run and raise `RunTimedOut` (a `subprocess.TimeoutExpired`)
        that shows the end of its stderr, where a warm run's processes wrote their stacks first."""
        code = self._join(timeout)
        if code is None:
            if self.warm:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.pid, STACKS_SIGNAL)
                self._join(2)  # time to write the stacks (and little to write after them)
            self.kill()
            self._join(None)

        def read(path: str | None) -> str:
            return Path(path).read_text(errors="replace") if path and os.path.exists(path) else ""

        stdout, stderr = read(self._out), read(self._err)
        self._tmp.cleanup()
        if code is None:
            raise RunTimedOut(self.args, timeout or 0, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(self.args, code, stdout, stderr)


def run_script(
    target: Sequence[str | Path],
    env: dict[str, str],
    cwd: Path,
    timeout: float,
    fresh: bool = False,
    file_size_limit: int | None = None,
) -> subprocess.CompletedProcess:
    """`python *target` (a script and its arguments, or "-m", a module and its arguments) with `env` in
    `cwd`, like `subprocess.run(..., capture_output=True, text=True, timeout=timeout)`: see `ScriptRun`."""
    return ScriptRun(target, env, cwd, fresh=fresh, file_size_limit=file_size_limit).wait(timeout)
