"""A real one-node SLURM cluster (munged, slurmctld, slurmd from Debian's packages) in a temporary directory.

Started as root by the `slurm` fixture of tests/test_slurm.py; `.ci/run` installs the packages. Everything
lives under the given root (config, state, spool, logs, munge key and socket), on free ports, so it runs
beside a system SLURM or another test session without touching either.
"""

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")


def unavailable() -> str | None:
    """Why a SLURM cluster cannot be started here, or None."""
    missing = [tool for tool in (*DAEMONS, *CLIENTS) if shutil.which(tool) is None]
    if missing:
        return (
            f"SLURM not installed ({', '.join(missing)} missing): "
            "apt-get install -y slurmctld slurmd slurm-client munge (.ci/run does this as root)"
        )
    if os.geteuid() != 0:
        return "the SLURM test cluster runs its daemons as root"
    return None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class SlurmCluster:
    def __init__(self, root: Path, cpus: int = 2) -> None:
        self.root, self.cpus = root, cpus
        self.node = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._daemons: list[subprocess.Popen] = []

    def _write_config(self) -> None:
        root = self.root
        for sub in ("state", "spool", "log", "munge"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        (root / "munge").chmod(0o700)
        self.conf.write_text(
            f"""ClusterName=vitraintest
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.socket
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobRequeue=1
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MinJobAge=600
KillWait=10
InactiveLimit=0
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN
PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
"""
        )

    def start(self, timeout: float = 60) -> None:
        self._write_config()
        root = self.root
        munge = root / "munge"
        self._spawn(
            "munged",
            "--foreground",
            "--force",
            f"--socket={munge}/munge.socket",
            f"--key-file={munge}/munge.key",
            f"--pid-file={munge}/munged.pid",
            f"--log-file={munge}/munged.log",
            f"--seed-file={munge}/munged.seed",
        )
        self._wait_for(lambda: (munge / "munge.socket").exists(), timeout, "munged")
        self._spawn("slurmctld", "-D", "-f", str(self.conf))
        self._spawn("slurmd", "-D", "-f", str(self.conf), "-N", self.node)
        self._wait_for(self._node_idle, timeout, "slurmd to register (sinfo idle)")

    def _spawn(self, *command: str) -> None:
        log = open(self.root / "log" / f"{command[0]}.out", "ab")  # noqa: SIM115 (closed with the process)
        self._daemons.append(
            subprocess.Popen(
                command, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        )

    def _node_idle(self) -> bool:
        done = self.run("sinfo", "-h", "-o", "%t", check=False)
        return done.returncode == 0 and done.stdout.strip() == "idle"

    def _wait_for(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p.args[0] for p in self._daemons if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"SLURM test cluster: waiting for {what} failed ({dead=}):\n{self.logs()}")
            time.sleep(0.2)

    def logs(self) -> str:
        return "\n".join(
            f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}"
            for path in sorted(self.root.glob("log/*"))
        )

    def stop(self) -> None:
        self.run("scancel", "--full", "--user=root", check=False)
        for process in reversed(self._daemons):  # slurmd, slurmctld, munged
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._daemons.clear()

    # --- client commands ------------------------------------------------------------------------------------

    def run(self, *command: str, check: bool = True, env: dict[str, str] | None = None, **kwargs):
        done = subprocess.run(
            command, env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=600, **kwargs
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr}")
        return done

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...)."""
        text = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(item.split("=", 1) for item in text.split() if "=" in item)

    def wait(self, job_id: str, until, timeout: float = 300) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if until(info):
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id}: {info.get('JobState')} after {timeout} s\n{self.logs()}")
            time.sleep(0.5)
