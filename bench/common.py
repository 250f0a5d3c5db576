"""What every benchmark shares: arguments, machine facts, interleaved timing, the JSON result, configs.

A benchmark is a script `bench/<name>.py` that measures, prints ONE line with its figure and writes
`<out>/<name>.json` (`bench/results/` by default; `--smoke` runs it in seconds for the tests and writes
elsewhere). `bench/render.py` turns the JSON files into docs/benchmarks.md; `bench/run.py` runs them all.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
PYTHON = sys.executable
if str(ROOT / "src") not in sys.path:  # the package is used from the source tree, as src/train.py does
    sys.path.insert(0, str(ROOT / "src"))
# the real CIFAR-10 beside the checkout (`<root>/../shared/data`, as the tests find it);
# `--data-dir` / `--cache-dir` point elsewhere
_SHARED_DATA = Path(os.environ.get("VITRAIN_SHARED_DATA", ROOT.parent / "shared" / "data"))
DATA_DIR = Path(os.environ.get("VITRAIN_BENCH_DATA", _SHARED_DATA / "cifar10-jpeg.tar.gz"))
CACHE_DIR = Path(os.environ.get("VITRAIN_BENCH_CACHE", Path.home() / ".cache" / "vitrain-tests"))

# the CPU experiment's model, for benchmarks that need "a small ViT"
SMALL_VIT = "experiment=cifar_cpu"
# --smoke: that network shrunk to run in seconds
# a plain ViT small enough for CPU smoke runs (4x4 patches of 8 px at 32 px input)
TINY_VIT_NET = [
    "model.net.model_name=vit_tiny_patch16_224",
    "model.net.img_size=32",
    "model.net.patch_size=8",
    "+model.net.embed_dim=32",
    "+model.net.depth=2",
    "+model.net.num_heads=2",
]
SMOKE_NET = [
    "model.net.embed_layer.backbone.channels=[8,8,16,16,32,32]",
    "model.net.embed_dim=32",
    "model.net.depth=2",
    "model.net.num_heads=2",
]


def parse_args(doc: str | None, **extra: tuple[type, Any, str]) -> argparse.Namespace:
    """--smoke (seconds, tiny sizes), --out (result dir), --data-dir/--cache-dir, plus script options."""
    parser = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0])
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes: checks that it runs, measures nothing"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for <name>.json")
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR, help="CIFAR-10 (archive, folder, batches)")
    parser.add_argument("--cache-dir", type=Path, default=CACHE_DIR, help="decoded-data cache")
    for name, (kind, default, help_) in extra.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default, help=help_)
    return parser.parse_args()


def cpu_model() -> str:
    """The CPU's name, with its family and model numbers: a VM often names only the vendor's line ("AMD EPYC"
    for Zen 3, 4 and 5 alike), and the benchmarks' sections from another CPU kind must not read as this one's."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
            if key.strip() == "flags":  # the first processor's fields are all read
                break
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def machine() -> dict[str, Any]:
    """The facts docs/benchmarks.md prints next to the figures."""
    import lightning
    import timm
    import torch

    from vitrain.tasks.precision import cpu_bf16_choice, cpu_bf16_support, measured_cpu_bf16_speedup

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    native = cpu_bf16_support()[0]
    faster = cpu_bf16_choice()[0]  # measures bf16 against fp32 where bf16 is native
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "avx512_bf16": "avx512_bf16" in cpu_flags(),
        # bf16 instructions that oneDNN may use: the kind of CPU
        "cpu_native_bf16": native,
        # bf16 matmuls over fp32 (the probe of `trainer.precision=auto`), and what auto chooses on CPU
        "cpu_bf16_speedup": measured_cpu_bf16_speedup() if native else None,
        "cpu_auto_precision": "bf16-mixed" if faster else "32-true",
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3, 1),
        "gpu": gpu,
        "gpus": torch.cuda.device_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "timm": timm.__version__,
    }


def scratch_dir(prefix: str) -> Path:
    """A scratch folder for a benchmark's runs (checkpoints, logs), removed when the script exits: the
    results live in `<out>/<name>.json`, and a failed run's error carries its output's tail."""
    path = Path(tempfile.mkdtemp(prefix=f"bench-{prefix}-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def interleave(variants: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Run A, B, B, A, A, B, ... for `rounds` rounds; each call measures one segment and returns its figure.

    Other jobs on the machine slow every variant alike only when the segments alternate quickly, so a
    ratio of two figures measured this way holds where absolute numbers do not. Every other round runs
    in reverse order, so no variant always comes first (warm-up) or last.
    """
    results: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for i in range(rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            results[name].append(float(variants[name]()))
    return results


def synced_clock(device: Any) -> float:
    """perf_counter after the device has finished its queued work (CUDA runs asynchronously)."""
    if getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.synchronize(device)
    return time.perf_counter()


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """Median of the per-round ratios: each round's pair ran back to back, under the same load."""
    return median([a / b for a, b in zip(numerator, denominator, strict=True)])


class Result:
    """One benchmark's JSON: figure, goal, whether it was met, details, the command and the machine."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        self.name, self.args = name, args
        self.started = time.perf_counter()
        self.data: dict[str, Any] = {
            "name": name,
            "smoke": bool(args.smoke),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": command_line(),
            "load_before": load_average(),
        }

    def save(
        self,
        line: str,
        figures: dict[str, Any],
        goal: str | None = None,
        met: bool | None = None,
        notes: Sequence[str] = (),
        verdict: str | None = None,
        **details: Any,
    ) -> Path:
        """Print the one-line summary and write `<out>/<name>.json`; `verdict` words a partial result."""
        self.data.update(
            line=line,
            figures=figures,
            goal=goal,
            met=None if self.args.smoke else met,
            verdict=None if self.args.smoke else verdict,
            notes=list(notes),
            details=details,
            seconds=round(time.perf_counter() - self.started, 1),
            load_after=load_average(),
            machine=machine(),
        )
        self.args.out.mkdir(parents=True, exist_ok=True)
        path = self.args.out / f"{self.name}.json"
        path.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        print(f"{self.name}: {line}", flush=True)
        return path


def command_line() -> str:
    script = Path(sys.argv[0]).resolve()
    rel = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    return shlex.join(["python", str(rel), *sys.argv[1:]])


# --- Hydra configs and the template's own objects -------------------------------------------------------


def time_next_calls(datamodule: Any, record: Callable[[float, float], None]) -> None:
    """Make every `next()` on the datamodule's training loader call `record(start, seconds)`: the loader is
    the one the datamodule builds (same class, workers, sampler), only its iteration is timed."""
    make_loader = datamodule.train_dataloader

    def timed_loader() -> Any:
        loader = make_loader()

        class Timed(type(loader)):
            def __iter__(self) -> Any:
                inner = super().__iter__()
                while True:
                    t = time.perf_counter()
                    try:
                        batch = next(inner)
                    except StopIteration:
                        return
                    record(t, time.perf_counter() - t)
                    yield batch

        loader.__class__ = Timed
        return loader

    datamodule.train_dataloader = timed_loader


def short_run(train_batches: int, val_batches: int = 0, bare: bool = False) -> list[str]:
    """Overrides for a measured run: `train_batches` steps of one epoch, `val_batches` of validation (no
    sanity check when 0), no time limit, no test; `bare`: without callbacks and logger (the step alone).
    Every step at the data's full size: experiment=cifar_cpu's progressive resizing would mix cheaper 16 and
    24 px steps into a speed figure (and the plain loops compared against have none)."""
    return [
        "trainer.max_epochs=1",
        "trainer.max_time=null",
        "model.progressive_resize.start_size=null",
        f"trainer.limit_train_batches={train_batches}",
        f"trainer.limit_val_batches={val_batches}",
        *(["trainer.num_sanity_val_steps=0"] if val_batches == 0 else []),
        *(["callbacks=none", "logger=none"] if bare else []),
        "test=false",
        "extras.print_config=false",
    ]


def data_overrides(args: argparse.Namespace) -> list[str]:
    return [f"datamodule.data_dir={args.data_dir}", f"datamodule.cache_dir={args.cache_dir}"]


def compose(overrides: Sequence[str], output_dir: Path) -> Any:
    """`configs/train.yaml` composed as `src/train.py` composes it, with the run dir at `output_dir`."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from vitrain.tasks.runs import register_resolvers

    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = hydra_compose(config_name="train", overrides=list(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        cfg.paths.output_dir = str(output_dir)
        del cfg.hydra
        if cfg.model.net.get("num_classes") is None:  # models built here without a datamodule: CIFAR-10's
            cfg.model.net.num_classes = 10
    return cfg


def probe_overrides(out: Path, **options: Any) -> list[str]:
    """Adds bench/probe.py's BenchProbe to a `src/train.py` run (needs PYTHONPATH=bench, see train_env)."""
    extra = [f"+callbacks.bench_probe.{k}={v}" for k, v in options.items()]
    return ["+callbacks.bench_probe._target_=probe.BenchProbe", f"+callbacks.bench_probe.out={out}", *extra]


def train_env(**env: str) -> dict[str, str]:
    """The environment of a `src/train.py` child: bench/ importable, no launcher variables, offline hub."""
    full = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **env}
    full["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(BENCH), str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p
    )
    for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        if var not in env:
            full.pop(var, None)
    return full


def run_train(
    overrides: Sequence[str],
    env: dict[str, str] | None = None,
    timeout: float = 1800,
    log: Path | None = None,
) -> subprocess.CompletedProcess:
    """`python src/train.py overrides...` as a user types it; raises with the output's tail on failure."""
    done = subprocess.run(
        [PYTHON, str(ROOT / "src" / "train.py"), *overrides],
        cwd=ROOT,
        env=train_env(**(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"src/train.py failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done


def train_command(overrides: Sequence[str], env: dict[str, str] | None = None) -> str:
    """The command line a user would type for `run_train(overrides, env)`, for the doc."""
    prefix = [f"{k}={v}" for k, v in (env or {}).items()]
    return shlex.join([*prefix, "python", "src/train.py", *overrides])


def top_level_ops(prof: Any) -> int:
    """aten ops a torch.profiler run recorded as called from Python, not from inside another aten op: on a GPU
    each is at least one kernel launch (views excepted), host work per op."""
    return sum(
        1
        for e in prof.events()
        if e.name.startswith("aten::")
        and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    )
