"""Start-up: seconds from launching `python src/train.py experiment=cifar_cpu ...` to the end of the first
optimizer step, with a cold data cache (unpack and decode the archive) and with a warm one, against the
time a new interpreter takes to run `import torch, lightning, timm` (a script file of that line). Warm runs
and bare imports are interleaved.

And what a full garbage collection costs once the template is imported: with the start-up heap as imported,
and frozen as a run freezes it (vitrain/utils/host_memory.py), in paired rounds in one new interpreter.

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


COLLECT = """
import gc, json, sys, time
import torch, lightning, timm
import vitrain.tasks.training
gc.collect()
objects = len(gc.get_objects()) + gc.get_freeze_count()
ms = {"as imported": [], "frozen": []}
for _ in range(int(sys.argv[1])):
    for name, times in ms.items():
        gc.freeze() if name == "frozen" else gc.unfreeze()
        t0 = time.perf_counter()
        gc.collect()
        times.append(1000 * (time.perf_counter() - t0))
print(json.dumps({"objects": objects, "ms": ms}))
"""


def collection_ms(rounds: int, workdir: Path) -> dict[str, Any]:
    """A full collection's milliseconds in a process that imported the template, heap as is and frozen. A
    script file, not `-c`: the tests' smoke run starts it warm (tests/warm.py), its heap then unfrozen first."""
    script = workdir / "collect.py"
    script.write_text(COLLECT)
    done = subprocess.run(
        [PYTHON, str(script), str(rounds)],
        check=True,
        cwd=ROOT,
        env=train_env(),
        capture_output=True,
        text=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def import_seconds(workdir: Path) -> float:
    """`python <script>` whose script is the bare imports: a new interpreter in a benchmark; a script file,
    not `-c`, so that the tests' smoke run starts it warm (tests/warm.py), as it does the training runs."""
    script = workdir / "imports.py"
    script.write_text(IMPORTS + "\n")
    t0 = time.perf_counter()
    subprocess.run([PYTHON, str(script)], check=True, cwd=ROOT, env=train_env())
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
        import_seconds(workdir)
    cold = to_first_step(args, cold_cache, workdir, "cold", commands)
    counter = iter(range(1000))
    runs = interleave(
        {
            "warm": lambda: to_first_step(args, cold_cache, workdir, f"warm{next(counter)}", commands),
            "imports": lambda: import_seconds(workdir),
        },
        args.rounds,
    )
    collect = collection_ms(1 if args.smoke else 10, workdir)
    heap_ms, frozen_ms = (median(collect["ms"][k]) for k in ("as imported", "frozen"))
    warm_ratio = ratio(runs["warm"], runs["imports"])
    met = warm_ratio <= 1.5
    line = (
        f"to first step: cold cache {cold:.1f} s, warm {median(runs['warm']):.1f} s = {warm_ratio:.2f}x "
        f"`{IMPORTS}` ({median(runs['imports']):.1f} s; goal <= 1.5x: {'met' if met else 'NOT met'}); "
        f"a full garbage collection after the imports {heap_ms:.0f} ms, {frozen_ms:.2f} ms with the start-up "
        f"heap frozen ({collect['objects']:,} objects)"
    )
    result.save(
        line,
        figures={
            "warm_over_imports": round(warm_ratio, 3),
            "cold_s": round(cold, 2),
            "warm_s": round(median(runs["warm"]), 2),
            "imports_s": round(median(runs["imports"]), 2),
            "collect_ms": round(heap_ms, 1),
            "collect_frozen_ms": round(frozen_ms, 2),
            "startup_objects": collect["objects"],
        },
        goal="warm run <= 1.5x the bare imports",
        met=met,
        rounds={k: [round(v, 2) for v in vs] for k, vs in runs.items()},
        collect_ms_rounds={k: [round(v, 2) for v in vs] for k, vs in collect["ms"].items()},
        command=commands[0],
    )


if __name__ == "__main__":
    main()
