"""Shared fixtures. Each part of the suite appends its own below."""

import os
from pathlib import Path

import pytest
import torch

from data_factory import make_class_folders
from vitrain.tasks.decisions import BATCH_SIZE_SEARCH, CPU_BF16_SPEEDUP, RESUME_FROM, RankZeroDecisions

# pytest-xdist runs several test processes at once (pyproject addopts): one compute thread each, here and in
# the processes a test starts (they inherit OMP_NUM_THREADS), so the tests share the cores instead of
# fighting over a pool of threads per process
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# fixtures that start one thing per test process (a server, a cluster, a decode into a shared cache): the
# tests using them run in one xdist process, so it is started once
ONE_PROCESS_FIXTURES = {
    "slurm": "slurm",
    "real_cifar10_cache": "real_cifar10",
    "mlflow_server": "mlflow",
}


# module-scoped runs (2-process launches, reference trainings) that several tests of one module check: xdist
# would make each once per test process that runs one of those tests; grouped by module, they are made once
MODULE_RUNS = {
    "single_run",
    "ddp_run",
    "fsdp_run",
    "two_ranks",
    "uninterrupted",
    "ema_run",
    "fsdp_ema_run",
    "run_dir",
    "photos",
    "local_shards",
    "folders",
    "drawn",
}


def xdist_group(item: pytest.Item) -> str | None:
    """The one xdist group of a test (xdist joins several groups into a new one): a one-per-session thing
    first, else its module's shared runs, requested as arguments or by name (`request.getfixturevalue`)."""
    names = set(getattr(item, "fixturenames", ()))
    group = next((g for f, g in ONE_PROCESS_FIXTURES.items() if f in names), None)
    if group is None:
        params = getattr(getattr(item, "callspec", None), "params", {})
        requested = names | {v for v in params.values() if isinstance(v, str)}
        if requested & MODULE_RUNS:
            group = item.module.__name__
    return group


def pytest_collection_finish(session: pytest.Session) -> None:
    """The heap the test modules imported (torch, Lightning, timm, MLflow...) frozen, as a run's start-up heap
    is (vitrain/utils/host_memory.py): the full collections of the tests' in-process runs skip it."""
    from vitrain.utils.host_memory import freeze_startup_heap

    freeze_startup_heap()


# tryfirst: xdist's own hook turns the markers into groups (a suffix on the node id) and would otherwise run
# before this one in a test process, grouping nothing
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        group = xdist_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session", autouse=True)
def xdist_groups_in_effect(request: pytest.FixtureRequest) -> None:
    """Every test errors if xdist's grouping is not in effect: it fails silently (pytest-xdist#1386), and the
    suite would then start a server, a cluster or a module's runs once per test process."""
    if not request.config.getoption("loadgroup", False):
        return
    items = request.session.items
    ungrouped = [i.nodeid for i in items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
    if ungrouped:
        pytest.fail(
            f"--dist loadgroup is not grouping ({ungrouped[0]} has no @group suffix): a pytest or "
            "pytest-xdist version that breaks it (requirements.txt pins a working pair)",
            pytrace=False,
        )


# the rank-zero decisions (vitrain/tasks/decisions.py) live in the environment for the rest of a launch, and a
# test process is one launch for many tests
DECISIONS = [RankZeroDecisions.variable(name) for name in (RESUME_FROM, CPU_BF16_SPEEDUP, BATCH_SIZE_SEARCH)]


@pytest.fixture(autouse=True)
def environment_stays_in_its_test():  # -> Iterator[None]
    """What a test leaves in a decision or launch variable, or a process group, goes with it. Else a CPU bf16
    speed-up that one test fed (0.5, 2.4) or that this CPU measured would decide `trainer.precision=auto` for
    every later test in the same xdist process and for every run those start (an outcome of the test order and
    of the CPU), and an in-process FSDP run's MASTER_PORT would name a later plain run."""
    from helpers import LAUNCH_VARS  # here: the test runner's own process need not import Lightning for it

    # MLflow's `set_tracking_uri` (Lightning's MLFlowLogger calls it) writes MLFLOW_TRACKING_URI into the
    # environment: a later test's logger without a URI would log to this test's server
    before = {name: os.environ.get(name) for name in [*DECISIONS, *LAUNCH_VARS, "MLFLOW_TRACKING_URI"]}
    yield
    # Lightning leaves an in-process DDP/FSDP run's default process group up (for a next fit): a later test's
    # `init_process_group` in the same xdist process would fail with "initialize ... twice"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def tiny_cifar(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small CIFAR-10-like class-folder dataset (10 classes, 32x32 PNGs): 24 train, 4 test per class."""
    return make_class_folders(tmp_path_factory.mktemp("tiny_cifar"), n_per_class_train=24, n_per_class_test=4)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One decode cache for the session: the tiny dataset is decoded once."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory, tiny_cifar: Path, data_cache: Path) -> Path:
    """A run dir of one trained epoch of the tiny ViT (`tiny_overrides`, logger=csv): checkpoints/last.ckpt
    and the best epoch*.ckpt. Trained once, in-process, for every test that only needs a checkpoint to
    start from; a test that writes into it works on a copy (shutil.copytree)."""
    from helpers import compose_cfg, tiny_overrides
    from vitrain.tasks.training import train

    run_dir = tmp_path_factory.mktemp("tiny_checkpoint")
    train(
        compose_cfg("train", [*tiny_overrides(tiny_cifar, data_cache), "logger=csv", "test=false"], run_dir)
    )
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    return run_dir


ROOT = Path(__file__).resolve().parents[1]
# data shared by checkouts lives beside the repository (`<root>/../shared/data`, as CI clones have it);
# VITRAIN_SHARED_DATA points elsewhere
SHARED_DATA = Path(os.environ.get("VITRAIN_SHARED_DATA", ROOT.parent / "shared" / "data")).expanduser()
REAL_CIFAR10_ARCHIVE = SHARED_DATA / "cifar10-jpeg.tar.gz"


@pytest.fixture(scope="session")
def real_cifar10_cache() -> tuple[Path, Path]:
    """(cache_dir, archive) for the real CIFAR-10 JPEG archive; the cache lives outside the repo and
    survives sessions (env VITRAIN_TEST_CACHE or ~/.cache/vitrain-tests), so it is decoded once per machine."""
    if not REAL_CIFAR10_ARCHIVE.is_file():
        pytest.skip(f"real CIFAR-10 archive {REAL_CIFAR10_ARCHIVE} is absent")
    cache = Path(os.environ.get("VITRAIN_TEST_CACHE", Path.home() / ".cache" / "vitrain-tests")).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    return cache, REAL_CIFAR10_ARCHIVE


# --- S3: moto in server mode, a real HTTP endpoint on 127.0.0.1 (boto3 is not mocked) ---------------------

S3_TEST_ACCESS_KEY_ID = "AKIAVITRAINTEST00001"
S3_TEST_SECRET_ACCESS_KEY = "vitrain-test-secret-key-0123456789abcdef"


@pytest.fixture(scope="session")
def s3_server():  # -> Iterator[str]
    """One moto S3 server on a free loopback port for the session; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_env(s3_server: str, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Fake credentials and the endpoint in the environment, the way a user's .env sets them."""
    no_aws_dir = tmp_path_factory.mktemp("no_aws_config")
    env = {
        "AWS_ACCESS_KEY_ID": S3_TEST_ACCESS_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": S3_TEST_SECRET_ACCESS_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": s3_server,
        # a developer's ~/.aws or an instance role must not leak into the tests
        "AWS_CONFIG_FILE": str(no_aws_dir / "config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(no_aws_dir / "credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "S3_BUCKET", "S3_PREFIX"):
        monkeypatch.delenv(name, raising=False)
    return s3_server


@pytest.fixture
def s3_bucket(s3_env: str) -> str:
    """A fresh, empty bucket for one test."""
    import uuid

    import boto3

    name = f"vitrain-test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_env).create_bucket(Bucket=name)
    return name


# --- a `python` whose script and module runs are warm, for processes no warm process starts ----------------


@pytest.fixture(scope="session")
def warm_python():  # -> Iterator[str]
    """The folder of a `python` that stands in for a warm run (tests/warm.py, `ExecServer`): for SLURM's
    tasks and submitit's jobs (slurmstepd starts them) and the MLflow server (its command-line process
    and its uvicorn process): each new interpreter spends ~12 CPU-s importing first."""
    from warm import ExecServer

    server = ExecServer()
    yield server.bin
    server.close()


# --- MLflow: a real tracking server (`mlflow server`) on 127.0.0.1, SQLite store, served artifacts -------


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory, warm_python: str):  # -> Iterator[str]
    """One `mlflow server` for the session on a free loopback port; yields its URL."""
    import os
    import socket
    import subprocess
    import time
    import urllib.request

    root = tmp_path_factory.mktemp("mlflow_server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    command = [
        *(os.path.join(warm_python, "python"), "-m", "mlflow", "server", "--host", "127.0.0.1"),
        *("--port", str(port)),
        *("--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}"),
        *("--artifacts-destination", str(root / "artifacts")),
    ]
    from warm import SERVER_ENV

    # no background job runner: one process less to start; the warm server's environment on import
    # (unbuffered, offline hub), so that the warm `python` runs it warm
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **SERVER_ENV}
    log = (root / "server.log").open("w")
    server = subprocess.Popen(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180  # a loaded 2-core machine needs ~20-60 s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            pytest.fail(f"mlflow server did not start: {(root / 'server.log').read_text()[-3000:]}")
        time.sleep(0.5)
    yield url
    server.terminate()
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()
    log.close()
