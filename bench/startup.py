"""Start-up: seconds from launching `python src/train.py experiment=cifar_cpu ...` to the end of the first
optimizer step, with a cold data cache (unpack and decode the archive) and with a warm one, against the
time `python -c "import torch, lightning, timm"` takes. Warm runs and bare imports are interleaved.

The clock starts just before the child process is spawned and stops at bench/probe.py's wall-clock stamp
after the first training batch (config composition, imports, model, data, trainer set-up and the two
sanity-check validation batches are inside; what the run does after that step is not).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

from common import (
    PYTHON,
    ROOT,
    SMALL_VIT,
    SMOKE_NET,
    Result,
    interleave,
    median,
    parse_args,
    probe_overrides,
    ratio,
    run_train,
    scratch_dir,
    train_command,
    train_env,
)

SMOKE = [
    *SMOKE_NET,
    "datamodule.batch_size=8",
    "datamodule.val_size=16",
]
IMPORTS = "import torch, lightning, timm"


def to_first_step(args: Any, cache_dir: Path, workdir: Path, tag: str, commands: list[str]) -> float:
    run_dir = workdir / tag
    out = run_dir / "probe.json"
    argv = [
        SMALL_VIT,
        f"datamodule.data_dir={args.data_dir}",
        f"datamodule.cache_dir={cache_dir}",
        "trainer.max_steps=1",
        "test=false",
        f"hydra.run.dir={run_dir}",
        *(SMOKE if args.smoke else []),
    ]
    t0 = time.time()
    run_train([*argv, *probe_overrides(out)], log=run_dir / "output.log")
    commands.append(train_command(argv))
    return json.loads(out.read_text())["first_step_unix"] - t0


def import_seconds() -> float:
    t0 = time.perf_counter()
    subprocess.run([PYTHON, "-c", IMPORTS], check=True, cwd=ROOT, env=train_env())
    return time.perf_counter() - t0


def main() -> None:
    args = parse_args(__doc__, rounds=(int, 2, "warm-run / import rounds"))
    if args.smoke:
        args.rounds = 1
    result = Result("startup", args)
    workdir = scratch_dir("startup")
    cold_cache = workdir / "cache"  # empty: the first run unpacks and decodes the archive
    commands: list[str] = []
    if not args.smoke:  # page cache: the first import of the session reads the libraries from disk
        import_seconds()
    cold = to_first_step(args, cold_cache, workdir, "cold", commands)
    counter = iter(range(1000))
    runs = interleave(
        {
            "warm": lambda: to_first_step(args, cold_cache, workdir, f"warm{next(counter)}", commands),
            "imports": import_seconds,
        },
        args.rounds,
    )
    warm_ratio = ratio(runs["warm"], runs["imports"])
    met = warm_ratio <= 1.5
    line = (
        f"to first step: cold cache {cold:.1f} s, warm {median(runs['warm']):.1f} s = {warm_ratio:.2f}x "
        f"`{IMPORTS}` ({median(runs['imports']):.1f} s; goal <= 1.5x: {'met' if met else 'NOT met'})"
    )
    result.save(
        line,
        figures={
            "warm_over_imports": round(warm_ratio, 3),
            "cold_s": round(cold, 2),
            "warm_s": round(median(runs["warm"]), 2),
            "imports_s": round(median(runs["imports"]), 2),
        },
        goal="warm run <= 1.5x the bare imports",
        met=met,
        rounds={k: [round(v, 2) for v in vs] for k, vs in runs.items()},
        command=commands[0],
    )


if __name__ == "__main__":
    main()
