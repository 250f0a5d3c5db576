"""DDP scaling on CPU: images/s of 2 processes x 1 thread (`trainer=ddp trainer.devices=2`) vs 1 process x 1
thread (`trainer=cpu`), the same per-process batch, the small ViT of experiment=cifar_cpu, interleaved,
and, as the reference for what the machine allows, two independent 1-process runs at the same time
(no communication: any shortfall from 2.0x there is the hardware's, shared caches, memory bandwidth, SMT).

Each side is a real `src/train.py` run with the default callbacks and logger; bench/probe.py times the
training steps of global rank 0 (every step ends with the gradient all-reduce, so rank 0's step time is
the job's). The first `warmup` steps are
not timed; start-up, validation and checkpointing are outside the window.

Where a DDP step's time goes, per variant (`one`, `two`, `independent`; medians over ranks and rounds):
`cpu_ms_per_step` is the CPU time of a process's main thread per step, `off_cpu_share` the part of the
step it was not on the CPU. On 2 DDP ranks the latter is the wait for the other rank and the all-reduce; a
higher CPU time than the independent pair's means the same kernels ran slower in DDP.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from common import (
    SMALL_VIT,
    SMOKE_NET,
    Result,
    data_overrides,
    interleave,
    median,
    parse_args,
    probe_overrides,
    ratio,
    run_train,
    scratch_dir,
    short_run,
    train_command,
)

SMOKE = [
    *SMOKE_NET,
    "datamodule.val_size=16",
]


def overrides(args: Any, processes: int, run_dir: Path) -> list[str]:
    common = [
        SMALL_VIT,
        *data_overrides(args),
        # callbacks and logger as configured by default: the template as a user runs it
        *short_run(args.warmup + args.steps + 1),
        f"datamodule.batch_size={args.batch_size * processes}",
        f"hydra.run.dir={run_dir}",
        *(SMOKE if args.smoke else []),
    ]
    if processes == 1:
        return [*common, "trainer=cpu"]
    return [*common, "trainer=ddp", f"trainer.devices={processes}", "trainer.accelerator=cpu"]


def images_per_s(
    args: Any, processes: int, workdir: Path, runs: list[str], tag: str, anatomy: list[dict[str, float]]
) -> float:
    """Images/s of one run, timed on rank 0. Appends to `anatomy` what a step of each rank was made of: CPU
    milliseconds of its main thread, and the share of the step it was off the CPU (on 2 ranks: waiting for
    the other rank and the all-reduce)."""
    run_dir = workdir / tag
    out = run_dir / "probe-__RANK__.json"
    argv = [*overrides(args, processes, run_dir), *probe_overrides(out)]
    run_train(argv, env={"OMP_NUM_THREADS": "1"}, log=run_dir / "output.log")
    runs.append(train_command(argv, {"OMP_NUM_THREADS": "1"}))
    records = [json.loads((run_dir / f"probe-{rank}.json").read_text()) for rank in range(processes)]
    record = records[0]
    assert record["world_size"] == processes and record["threads"] == 1, record
    anatomy.extend(step_anatomy(rec, args.warmup) for rec in records)
    ends = record["step_ends"][args.warmup :]
    return processes * args.batch_size * (len(ends) - 1) / (ends[-1] - ends[0])


def step_anatomy(record: dict[str, Any], warmup: int) -> dict[str, float]:
    ends, cpu = record["step_ends"][warmup:], record["step_cpu"][warmup:]
    wall, busy = ends[-1] - ends[0], cpu[-1] - cpu[0]
    return {
        "rank": record["rank"],
        "cpu_ms": 1000 * busy / (len(ends) - 1),
        # the two clocks are read one after the other: a step spent wholly on the CPU can measure a hair more
        # CPU than wall time, which is no negative wait
        "wait": max(0.0, 1 - busy / wall),
        "grad_mb": record["param_bytes"] / 1e6,  # fp32 parameters: the bytes all-reduced per step
    }


def independent_pair(args: Any, workdir: Path, runs: list[str], anatomy: list[dict[str, float]]) -> float:
    """Two 1-process runs at once, no communication: how far this machine itself scales to 2 processes."""
    tag = f"pair{len(runs)}"
    with ThreadPoolExecutor(2) as pool:
        rates = pool.map(lambda i: images_per_s(args, 1, workdir, runs, f"{tag}-{i}", anatomy), range(2))
        return sum(rates)


def main() -> None:
    args = parse_args(
        __doc__,
        rounds=(int, 3, "A/B rounds"),
        batch_size=(int, 128, "images per process"),
        # long enough that one slow second (other jobs on a shared machine) does not decide the figure
        steps=(int, 40, "timed steps"),
        warmup=(int, 3, "untimed steps first"),
    )
    if args.smoke:
        args.rounds, args.batch_size, args.steps, args.warmup = 1, 8, 2, 1
    result = Result("ddp_scaling", args)
    workdir = scratch_dir("ddp")
    commands: list[str] = []
    anatomy: dict[str, list[dict[str, float]]] = {"one": [], "two": [], "independent": []}
    runs = interleave(
        {
            "one": lambda: images_per_s(args, 1, workdir, commands, f"one{len(commands)}", anatomy["one"]),
            "two": lambda: images_per_s(args, 2, workdir, commands, f"two{len(commands)}", anatomy["two"]),
            "independent": lambda: independent_pair(args, workdir, commands, anatomy["independent"]),
        },
        args.rounds,
    )
    speedup = ratio(runs["two"], runs["one"])
    machine_limit = ratio(runs["independent"], runs["one"])
    met = speedup >= 1.8
    # where a DDP step's time goes: more CPU per step than one process alone (what the independent pair
    # shows of shared caches and memory), and time off the CPU waiting for the other rank and the all-reduce
    cpu_ms = {k: median([a["cpu_ms"] for a in v]) for k, v in anatomy.items()}
    wait = {k: median([a["wait"] for a in v]) for k, v in anatomy.items()}
    notes = []
    if not met:
        per_rank = [median([a["wait"] for a in anatomy["two"] if a["rank"] == r]) for r in (0, 1)]
        notes.append(
            f"Why: a DDP rank spends {wait['two']:.1%} of each step off the CPU (rank 0 {per_rank[0]:.1%}, "
            f"rank 1 {per_rank[1]:.1%}; independent processes {wait['independent']:.1%}): waiting for the "
            f"all-reduce of {anatomy['two'][0]['grad_mb']:.1f} MB of gradients and for the other rank, "
            "which every step of synchronous data parallelism does and independent processes do not"
            + (
                " (rank 1 longer: rank 0 also runs the progress bar, logger and checkpoint callbacks). "
                if per_rank[1] > per_rank[0]
                else ". "
            )
            + "Each rank's own CPU time per step is "
            f"{cpu_ms['two'] / cpu_ms['independent']:.2f}x an independent process's. On a shared "
            "2-core machine the ranks also drift apart within a step whenever one core is slowed, "
            "and the faster one waits: the round-to-round spread of this figure is in `rounds`."
        )
    line = (
        f"2 processes x 1 thread / 1 x 1 = {speedup:.2f}x images/s (goal >= 1.8x: "
        f"{'met' if met else 'NOT met'}); {median(runs['two']):.0f} vs {median(runs['one']):.0f} images/s; "
        f"two independent 1-process runs at once reach {machine_limit:.2f}x (this machine's own limit); "
        f"a DDP rank waits {100 * wait['two']:.1f} % of its step, and computes for "
        f"{cpu_ms['two'] / cpu_ms['one']:.2f}x the CPU time of a lone process (independent pair: "
        f"{cpu_ms['independent'] / cpu_ms['one']:.2f}x)"
    )
    result.save(
        line,
        notes=notes,
        figures={
            "speedup": round(speedup, 3),
            "images_per_s_2x1": round(median(runs["two"]), 1),
            "images_per_s_1x1": round(median(runs["one"]), 1),
            "efficiency": round(speedup / 2, 3),
            "independent_pair_speedup": round(machine_limit, 3),
            "ddp_over_independent": round(ratio(runs["two"], runs["independent"]), 3),
            **{f"cpu_ms_per_step_{k}": round(v, 1) for k, v in cpu_ms.items()},
            **{f"off_cpu_share_{k}": round(v, 4) for k, v in wait.items()},
        },
        goal="2x1 / 1x1 >= 1.8 (2.0 is the limit)",
        met=met,
        rounds={k: [round(v, 1) for v in vs] for k, vs in runs.items()},
        anatomy={k: [{m: round(x, 4) for m, x in a.items()} for a in v] for k, v in anatomy.items()},
        per_process_batch=args.batch_size,
        steps=args.steps,
        warmup=args.warmup,
        commands=commands[:2],
    )


if __name__ == "__main__":
    main()
