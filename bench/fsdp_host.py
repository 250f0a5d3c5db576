"""FSDP's host cost: what FSDP2 (`fully_shard`) adds to a training step's host work, on one process.

On one H100 the one-GPU FSDP run was bound by the host (31 ms of kernels in a 147 ms step, docs/benchmarks.md
section 7b). Host work is measured here on the CPU, where it can be isolated: a network with ViT-B's parameter
tensors (12 blocks, the same 152 weights and biases) at a width so small that the arithmetic is negligible,
trained by a plain loop (fused AdamW, the batch already in memory; in fp32, and under bf16 autocast), then the
same loop with the network sharded by the template's own `apply_fsdp` (each block, then the root; the unit
backward starts with keeps its gathered weights; one gloo rank, one thread), without and with the bf16 policy
(`trainer.strategy.mixed_precision=bf16`; compared with the bf16 plain loop, since bf16 kernels on a CPU have
costs of their own), with `reshard_after_forward=false`, with all twelve blocks in one unit (what
`trainer.strategy.unit_params`, default 1e8, makes of ViT-B's blocks, 85 M parameters), with that and AdamW
stepping on the local shards (`steps_on_local_shards`: the template's FSDP defaults); those defaults without the
bf16 policy, fp32 weights gathered and the step under bf16 autocast (`trainer=fsdp` as configured; compared with
the bf16 plain loop), and with each block compiled (`model.compile_scope=blocks`, `auto` before 2026-11-30;
compared with the plain loop's blocks compiled alike), and with the blocks' container compiled as one graph
instead (`_stack`: what `compile_scope=auto` takes under FSDP where all blocks are one group sharded as their
container). The `_list` variants hand the group of all blocks to FSDP2 as the list of its blocks, each then hooked
by FSDP2 (the template until 2026-11-30), where the template now hands it their container (`fsdp.group_module`).
Variants are interleaved (A, B, B, A, ...), each segment timing a few steps; the figure is each variant's median
ms per step, and the top-level aten ops per step (torch.profiler: on a GPU each is at least one kernel launch).
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import Result, interleave, median, parse_args, top_level_ops

from vitrain.distributed import fsdp
from vitrain.distributed.fsdp import UNIT_PARAMS
from vitrain.distributed.parallelize import BlockStack

VARIANTS = {
    # name: (shard, bf16: FSDP's policy when sharded, else autocast; reshard_after_forward, unit_params,
    # compiled (True: each block; "stack": their container), the optimizer stepping on the local shards[,
    # sharded fp32 under bf16 autocast[, the group of all blocks as a list]])
    "plain": (False, False, True, 0, False, False),
    "plain_bf16": (False, True, True, 0, False, False),
    "fsdp": (True, False, True, 0, False, False),
    "fsdp_bf16": (True, True, True, 0, False, False),
    "fsdp_bf16_keep_gathered": (True, True, False, 0, False, False),
    "fsdp_bf16_one_unit": (True, True, True, UNIT_PARAMS, False, False),
    "fsdp_bf16_defaults": (True, True, True, UNIT_PARAMS, False, True),
    # `trainer=fsdp` as configured: fp32 weights gathered, bf16 autocast (no FSDP policy), the defaults
    "fsdp_autocast_defaults": (True, False, True, UNIT_PARAMS, False, True, True),
    # the same with the group of all blocks handed to FSDP2 as a list of blocks, hooked one by one (the
    # template until 2026-11-30), not as their container
    "fsdp_autocast_defaults_list": (True, False, True, UNIT_PARAMS, False, True, True, True),
    "plain_compiled": (False, False, True, 0, True, False),
    "fsdp_compiled": (True, False, True, 0, True, False),
    "fsdp_compiled_defaults": (True, False, True, UNIT_PARAMS, True, True),
    "fsdp_compiled_defaults_list": (True, False, True, UNIT_PARAMS, True, True, False, True),
    # the blocks' container compiled as one graph (`compile_scope=stack`, what `auto` now takes under FSDP where
    # all blocks are one group sharded as it), on the plain loop and under the FSDP defaults
    "plain_compiled_stack": (False, False, True, 0, "stack", False),
    "fsdp_compiled_stack_defaults": (True, False, True, UNIT_PARAMS, "stack", True),
}


def build(
    shard: bool,
    bf16: bool,
    reshard: bool,
    unit_params: int,
    compiled: bool | str,
    local: bool,
    sharded_autocast: bool = False,
    as_list: bool = False,
    *,
    depth: int,
    backend: str = "inductor",
) -> tuple[Callable[[], None], int]:
    """One training step of the variant's network (fresh weights, the same seed), and its parameter tensors."""
    import timm
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    net = timm.create_model(
        "vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=depth, num_heads=2,
        num_classes=10,
    )  # fmt: skip
    if compiled == "stack":  # the container as one graph, as `compile_scope=stack` compiles it
        net.blocks.__class__ = BlockStack
        net.blocks.compile(backend=backend)
    elif compiled:  # before sharding, as vitrain/distributed/parallelize.py orders it (no drop path here)
        for block in net.blocks:
            block.compile(backend=backend)
    if shard:  # the template's own sharding (which unit keeps its weights gathered included)
        # as_list: no container found for a group, so FSDP2 gets the list of its blocks
        with (
            mock.patch.object(fsdp, "sequential_of", lambda *_: None) if as_list else contextlib.nullcontext()
        ):
            fsdp.apply_fsdp(net, init_device_mesh("cpu", (1,)), units=list(net.blocks),
                            mixed_precision="bf16" if bf16 else None, reshard_after_forward=reshard,
                            unit_params=unit_params)  # fmt: skip
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    if local:
        from vitrain.distributed.local_step import steps_on_local_shards

        assert steps_on_local_shards(optimizer)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    # the unsharded bf16 reference computes in bf16 as the bf16 policy does: on this CPU bf16 kernels take
    # their own time (attention's backward most), which the comparison must not count as FSDP's
    autocast = (not shard and bf16) or sharded_autocast

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(net(x), y, label_smoothing=0.1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, len(list(net.parameters()))


def ops_per_step(step: Callable[[], None], steps: int = 3) -> float:
    """Top-level aten ops per step (ops called by other aten ops not counted)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return top_level_ops(prof) / steps


def main() -> None:
    args = parse_args(__doc__)
    result = Result("fsdp_host", args)
    torch.set_num_threads(1)
    with socket.socket() as s:  # a free port: the tests run other process groups at the same time
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    depth, steps, rounds = (2, 2, 2) if args.smoke else (12, 10, 6)
    # --smoke checks the script, not the figures: Dynamo traces the blocks as it would for Inductor, without
    # Inductor's C++ build (about 30 CPU-s with a cold compiler cache, as on a fresh CI machine)
    backend = "aot_eager" if args.smoke else "inductor"
    built = {name: build(*spec, depth=depth, backend=backend) for name, spec in VARIANTS.items()}
    variants = {name: step for name, (step, _) in built.items()}
    params = built["plain"][1]
    for step in variants.values():  # warm-up: allocator, autograd graph, FSDP's lazy init, compiling
        for _ in range(3):
            step()

    def segment(step: Callable[[], None]) -> Callable[[], float]:
        def run() -> float:
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            return (time.perf_counter() - t0) / steps * 1e3

        return run

    times = interleave({name: segment(step) for name, step in variants.items()}, rounds)
    ms = {name: median(values) for name, values in times.items()}
    ops = {name: ops_per_step(step) for name, step in variants.items()}
    dist.destroy_process_group()

    def paired(slower: str, faster: str) -> list[float]:
        """`slower` minus `faster`, round by round (each pair ran back to back): robust to a busy machine."""
        return [a - b for a, b in zip(times[slower], times[faster], strict=True)]

    # the container against the list
    saved = {
        kind: paired(f"fsdp_{kind}_defaults_list", f"fsdp_{kind}_defaults")
        for kind in ("compiled", "autocast")
    }
    # one graph for the blocks against one per block
    stack_saves = {
        "plain": paired("plain_compiled", "plain_compiled_stack"),
        "fsdp": paired("fsdp_compiled_defaults", "fsdp_compiled_stack_defaults"),
    }
    added = ms["fsdp_bf16"] - ms["plain_bf16"]
    added_fp32 = ms["fsdp"] - ms["plain"]
    line = (
        f"FSDP2 with the bf16 policy adds {added:.1f} ms of host work per step to the same loop in bf16 "
        f"({ms['fsdp_bf16']:.1f} vs {ms['plain_bf16']:.1f} ms; {1e3 * added / params:.0f} us per parameter "
        f"tensor, {params} tensors) and {ops['fsdp_bf16'] - ops['plain_bf16']:.0f} top-level ops; in fp32 "
        f"{added_fp32:.1f} ms ({ms['fsdp']:.1f} vs {ms['plain']:.1f}); bf16 with reshard_after_forward=false "
        f"{ms['fsdp_bf16_keep_gathered']:.1f} ms, with one unit for all blocks (the default `unit_params`) "
        f"{ms['fsdp_bf16_one_unit']:.1f} ms, and with AdamW stepping on the local shards too (the template's "
        f"FSDP defaults) {ms['fsdp_bf16_defaults']:.1f} ms, adding {ms['fsdp_bf16_defaults'] - ms['plain_bf16']:.1f} "
        f"ms; fp32 weights under bf16 autocast with the defaults (trainer=fsdp as configured) "
        f"{ms['fsdp_autocast_defaults']:.1f} ms, adding {ms['fsdp_autocast_defaults'] - ms['plain_bf16']:.1f} "
        f"ms ({ops['fsdp_autocast_defaults'] - ops['plain_bf16']:.0f} ops); "
        f"blocks compiled: fp32 FSDP {ms['fsdp_compiled']:.1f} ms, adding "
        f"{ms['fsdp_compiled'] - ms['plain_compiled']:.1f} ms to the same loop compiled alike, "
        f"{ms['fsdp_compiled_defaults'] - ms['plain_compiled']:.1f} ms with the FSDP defaults; the defaults' "
        f"group of all blocks sharded as their container, not as a list of blocks: "
        f"{median(saved['compiled']):.1f} ms a step less with the blocks compiled ({ms['fsdp_compiled_defaults']:.1f} "
        f"vs {ms['fsdp_compiled_defaults_list']:.1f}; less in {sum(d > 0 for d in saved['compiled'])} of "
        f"{rounds} rounds), {median(saved['autocast']):.1f} ms less eager under autocast "
        f"({ms['fsdp_autocast_defaults']:.1f} vs {ms['fsdp_autocast_defaults_list']:.1f}; less in "
        f"{sum(d > 0 for d in saved['autocast'])} of {rounds}), the same ops per step "
        f"({ops['fsdp_compiled_defaults']:.0f} vs {ops['fsdp_compiled_defaults_list']:.0f}); the blocks' "
        f"container compiled as one graph instead of each block: {median(stack_saves['fsdp']):.1f} ms a step less "
        f"under the FSDP defaults ({ms['fsdp_compiled_stack_defaults']:.1f} vs {ms['fsdp_compiled_defaults']:.1f}; "
        f"less in {sum(d > 0 for d in stack_saves['fsdp'])} of {rounds}), {median(stack_saves['plain']):.1f} ms "
        f"on the plain loop ({ms['plain_compiled_stack']:.1f} vs {ms['plain_compiled']:.1f}; less in "
        f"{sum(d > 0 for d in stack_saves['plain'])} of {rounds})"
    )
    result.save(
        line,
        figures={
            **{f"{name}_ms_per_step": round(v, 2) for name, v in ms.items()},
            **{f"{name}_ops_per_step": round(v) for name, v in ops.items()},
            "parameter_tensors": params,
            # median of the rounds' paired differences, list minus container
            **{f"container_saves_{kind}_ms_per_step": round(median(d), 2) for kind, d in saved.items()},
            **{f"stack_saves_{kind}_ms_per_step": round(median(d), 2) for kind, d in stack_saves.items()},
        },
        notes=[
            "Host time on this CPU, one thread: a GPU's host adds a kernel launch per op and runs FSDP's "
            "collectives through NCCL, so the milliseconds differ there; what carries over is where the time "
            "grows (per parameter tensor, per all-gather) and what each option removes.",
            "Compiling each block shrinks the network's own host work (fewer eager ops) but not FSDP2's: its "
            "hooks, all-gathers and gradient reduction run between the compiled blocks, eagerly, either way.",
            "The group of all blocks as their container or as a list: the same all-gather, reduce-scatter and "
            "ops; what the list adds is FSDP2's Python hooks on every block (pre- and post-forward, and the "
            "backward hooks registered on each block's output every step), which the container runs once.",
        ],
        segments_ms=times,
        depth=depth,
    )


if __name__ == "__main__":
    main()
