"""The benchmark suite (`make bench`): every bench/<name>.py in turn, then docs/benchmarks.md from the JSON.

    python bench/run.py                      # all, results in bench/results/, doc rendered
    python bench/run.py --only overhead,startup
    python bench/run.py --smoke --out /tmp/b # seconds: checks that every script runs
    python bench/run.py --wait-quiet 60      # first wait up to 60 min for a 1-minute load below 0.8

Each benchmark runs in its own process (threads, memory and caches do not leak between them); its
output goes to <out>/logs/<name>.log and its one-line figure to the console.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from common import BENCH, PYTHON, RESULTS, ROOT, load_average

# the 10-minute accuracy run first: it is the one an absolute clock judges, so it gets the quiet machine
# that --wait-quiet waited for; the others compare interleaved variants and tolerate a busier one
SUITE = [
    "accuracy",
    "startup",
    "overhead",
    "data_pipeline",
    "data_sources",
    "levers",
    "ddp_scaling",
    "fsdp_memory",
    "fsdp_host",
    "checkpoint_stall",
    "float8",
    "gpu",
]


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def wait_quiet(minutes: float, threshold: float = 0.8) -> float:
    """Poll the 1-minute load average until it is below `threshold` or `minutes` have passed."""
    deadline = time.monotonic() + 60 * minutes
    while load_average() >= threshold and time.monotonic() < deadline:
        print(f"load {load_average()} >= {threshold}: waiting", flush=True)
        time.sleep(30)
    return load_average()


def carry_notes(path: Path, earlier: list[str]) -> dict:
    """The result a re-run wrote to `path`, with the notes its predecessor carried (what earlier sessions
    found and wrote beside their figures) kept before its own: a re-run replaces figures, not history. A
    note the script writes itself (its words up to the first figure the same as one of the new notes'), of
    the run it replaces, is replaced too: "the same checkpoint scores 81.71 %" was of the old checkpoint."""
    result = json.loads(path.read_text())
    own = [note for note in result.get("notes") or [] if note not in earlier]
    kept = [note for note in earlier if _words(note) not in {_words(mine) for mine in own}]
    if earlier:
        result["notes"] = [*kept, *own]
        path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _words(note: str) -> str:
    """A note's words before its first digit: what a script's note says, without its figures."""
    return re.split(r"\d", note, maxsplit=1)[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--only", default="", help="comma-separated subset of " + ",".join(SUITE))
    parser.add_argument("--doc", type=Path, default=None, help="default: docs/benchmarks.md (not in --smoke)")
    parser.add_argument("--wait-quiet", type=float, default=0.0, help="minutes to wait for a quiet machine")
    parser.add_argument("passthrough", nargs="*", help="extra arguments for every script (after --)")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or SUITE
    unknown = set(names) - set(SUITE)
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(sorted(unknown))}; known: {', '.join(SUITE)}")
    if args.wait_quiet:
        wait_quiet(args.wait_quiet)

    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started, load_before = time.perf_counter(), load_average()
    failed = []
    replaced = []  # a subset re-run replaces results: keep what they said, for the record
    kept = []  # GPU figures need a GPU: on a machine without one, the last GPU run's results stay
    if not args.smoke and "gpu" in names and (args.out / "gpu.json").is_file() and not cuda_available():
        names = [n for n in names if n != "gpu"]
        kept.append("gpu")
        print(
            f"gpu: kept {args.out / 'gpu.json'} (no CUDA device here: run `make bench-gpu` on one)",
            flush=True,
        )
    for name in names:
        earlier_notes: list[str] = []
        if args.only and (args.out / f"{name}.json").is_file():
            old = json.loads((args.out / f"{name}.json").read_text())
            replaced.append({k: old.get(k) for k in ("name", "line", "date", "load_before", "load_after")})
            earlier_notes = list(old.get("notes") or [])
        cmd = [
            PYTHON,
            str(BENCH / f"{name}.py"),
            "--out",
            str(args.out),
            *(["--smoke"] if args.smoke else []),
            *args.passthrough,
        ]
        t0 = time.perf_counter()
        with open(logs / f"{name}.log", "w") as log:
            done = subprocess.run(
                cmd,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        took = time.perf_counter() - t0
        if done.returncode != 0:
            failed.append(name)
            print(
                f"{name}: FAILED ({done.returncode}) after {took:.0f} s, see {logs / f'{name}.log'}",
                flush=True,
            )
            continue
        result = carry_notes(args.out / f"{name}.json", earlier_notes)
        print(f"{name} ({took:.0f} s): {result['line']}", flush=True)

    seconds = time.perf_counter() - started
    run = {
        # what was typed: `make bench` passes BENCH_ARGS through to this script
        "command": "make bench" + (f' BENCH_ARGS="{shlex.join(sys.argv[1:])}"' if sys.argv[1:] else ""),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "seconds": round(seconds, 1),
        "benchmarks": names,
        "kept": kept,
        "failed": failed,
        "load_before": load_before,
        "load_after": load_average(),
        "smoke": args.smoke,
    }
    path = args.out / "run.json"
    previous = json.loads(path.read_text()) if args.only and path.is_file() else None
    if previous and not previous.get("smoke") and not args.smoke:
        # a subset re-run: the full run stays the record, the re-run is listed under it
        previous.setdefault("reruns", []).append({**run, "replaced": replaced})
        run = previous
    path.write_text(json.dumps(run, indent=2) + "\n")
    print(f"total {seconds / 60:.1f} min; {len(failed)} failed", flush=True)
    doc = args.doc or (None if args.smoke else ROOT / "docs" / "benchmarks.md")
    if doc is not None:
        subprocess.run(
            [PYTHON, str(BENCH / "render.py"), "--results", str(args.out), "--doc", str(doc)], check=True
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
