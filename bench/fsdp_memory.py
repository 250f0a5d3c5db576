"""FSDP memory: peak memory per rank, `trainer=fsdp` vs `trainer=ddp`, 2 processes, ViT-B/32 at 224 px, AdamW.

Each side is a real `src/train.py` run of a few training steps (fp32, 1 thread per process). On CPU the
figure is the process's peak resident memory (Linux VmHWM, window reset when training starts, so model
construction and sharding are not counted) on every rank. glibc is told to serve allocations above 64 KiB
with mmap (`MALLOC_MMAP_THRESHOLD_`), so freed tensors leave the resident set at once and the peak follows
live tensors, as a GPU's allocator statistics would. Two figures per rank:
- `peak`: the whole process (Python, libraries, the CIFAR-10 arrays, the model state, activations);
- `state`: peak minus the process's memory without a model (resident memory at setup minus the fp32
  parameters): weights, gradients, AdamW moments, activations and communication buffers, what sharding acts on.
The goal is judged on `state`; `peak` is shown next to it. On CUDA the figure is max_memory_allocated.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common import (
    Result,
    data_overrides,
    parse_args,
    probe_overrides,
    run_train,
    scratch_dir,
    short_run,
    train_command,
)
from probe import GB

MODEL = [
    "model=vit",
    "model.net.model_name=vit_base_patch32_224",
    "model.net.pretrained=false",
    "model.net.img_size=224",
    "model.net.patch_size=32",
]
SMOKE = [
    "model=vit",
    "model.net.model_name=vit_tiny_patch16_224",
    "model.net.pretrained=false",
    "model.net.img_size=32",
    "model.net.patch_size=8",
    "+model.net.depth=2",
    "datamodule.val_size=16",
]
ENV = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
# --smoke checks the script, not the figure: glibc's default threshold (a MALLOC_ variable is read when a
# process starts, so the tests could not start these runs from an interpreter that has imported torch)
SMOKE_ENV = {"OMP_NUM_THREADS": "1"}


def measure(args: Any, strategy: str, workdir: Path) -> dict[str, Any]:
    run_dir = workdir / strategy
    argv = [
        *data_overrides(args),
        *(SMOKE if args.smoke else MODEL),
        f"trainer={strategy}",
        "trainer.devices=2",
        "trainer.accelerator=cpu",
        *short_run(args.steps, bare=True),
        # glibc's own malloc (and ENV's low mmap threshold): RSS follows the live tensors
        "extras.retain_freed_memory=false",
        f"datamodule.batch_size={2 * args.batch_size}",
        f"hydra.run.dir={run_dir}",
    ]
    argv += probe_overrides(run_dir / "probe-__RANK__.json")
    env = SMOKE_ENV if args.smoke else ENV
    run_train(argv, env=env, log=run_dir / "output.log")
    ranks = []
    for rank in range(2):
        rec = json.loads((run_dir / f"probe-{rank}.json").read_text())
        base = rec["rss_setup"] - rec["param_bytes"]
        peak = rec.get("peak_cuda_allocated") or rec["peak_rss_train"]
        state = peak if rec.get("peak_cuda_allocated") else peak - base
        ends = rec["step_ends"]
        ranks.append(
            {
                "rank": rank,
                "peak_gb": round(peak / GB, 3),
                "state_gb": round(state / GB, 3),
                "base_gb": round(base / GB, 3),
                "param_gb": round(rec["param_bytes"] / GB, 3),
                "peak_reset": rec.get("peak_reset"),
                "s_per_step": round((ends[-1] - ends[0]) / (len(ends) - 1), 2) if len(ends) > 1 else None,
            }
        )
    return {
        "ranks": ranks,
        "command": train_command(argv, env),
        "peak_gb": max(r["peak_gb"] for r in ranks),
        "state_gb": max(r["state_gb"] for r in ranks),
    }


def main() -> None:
    args = parse_args(__doc__, batch_size=(int, 4, "images per process"), steps=(int, 3, "training steps"))
    if args.smoke:
        args.batch_size, args.steps = 2, 2
    result = Result("fsdp_memory", args)
    workdir = scratch_dir("fsdp")
    notes = []
    if not (Path(__file__).resolve().parents[1] / "configs" / "trainer" / "fsdp.yaml").is_file():
        result.save(
            "not measured: configs/trainer/fsdp.yaml does not exist yet",
            figures={},
            goal="FSDP/DDP peak memory per rank <= 0.6",
            met=None,
        )
        return
    ddp = measure(args, "ddp", workdir)
    fsdp = measure(args, "fsdp", workdir)
    state_ratio = fsdp["state_gb"] / ddp["state_gb"]
    peak_ratio = fsdp["peak_gb"] / ddp["peak_gb"]
    met = state_ratio <= 0.6
    line = (
        f"FSDP/DDP peak memory per rank = {state_ratio:.2f} of the training state "
        f"({fsdp['state_gb']:.2f} vs {ddp['state_gb']:.2f} GB; goal <= 0.6: {'met' if met else 'NOT met'}), "
        f"{peak_ratio:.2f} of the whole process ({fsdp['peak_gb']:.2f} vs {ddp['peak_gb']:.2f} GB)"
    )
    result.save(
        line,
        figures={
            "state_ratio": round(state_ratio, 3),
            "peak_ratio": round(peak_ratio, 3),
            "fsdp_state_gb": fsdp["state_gb"],
            "ddp_state_gb": ddp["state_gb"],
            "fsdp_peak_gb": fsdp["peak_gb"],
            "ddp_peak_gb": ddp["peak_gb"],
        },
        goal="FSDP/DDP peak memory per rank <= 0.6",
        met=met,
        notes=notes,
        ddp=ddp,
        fsdp=fsdp,
        per_process_batch=args.batch_size,
        steps=args.steps,
    )


if __name__ == "__main__":
    main()
