"""Levers: training steps/s of experiment=cifar_cpu's network with one speed option changed at a time,
against the experiment as configured, interleaved in one run (a plain loop: no framework in the way).

Variants: SDPA attention instead of timm's matmul-softmax attention (`model.fused_attn`), fp32 instead of
bf16 autocast (`trainer.precision`), AdamW `foreach` instead of `fused` (`model.optimizer.fused`), NCHW
instead of channels-last convolutions (`model.channels_last`),
`torch.compile` (`model.compile`, whose compile time is reported against the time it saves), and compiled
block by block (`model.compile_scope=blocks`); for the seed's network (ViT-B/32) the compile time and step
time of each scope (network, blocks, stack), each in a fresh process and compiler cache. And one
lever outside the network, measured on whole `src/train.py` runs since it is set when a process starts:
glibc malloc's defaults instead of `extras.retain_freed_memory` (vitrain/utils/host_memory.py). On a host
without an NVIDIA driver, also torch's NVML-based CUDA check left on as Lightning sets it (a failing library
load at every AdamW step; vitrain/utils/cuda_check.py turns it off there).
"""

from __future__ import annotations

import os
import tempfile

from common import scratch_dir

# a fresh compiler cache: the compile time reported is a first run's, not a cache hit of an earlier one
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(scratch_dir("inductor")))

import contextlib
import copy
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from common import (
    ROOT,
    SMALL_VIT,
    SMOKE_NET,
    Result,
    compose,
    data_overrides,
    interleave,
    median,
    parse_args,
    probe_overrides,
    ratio,
    run_train,
    short_run,
)

from vitrain.distributed.parallelize import apply_compile, transformer_blocks
from vitrain.models.classifier import compile_choice
from vitrain.tasks.precision import resolve_precision

SMOKE = [
    *SMOKE_NET,
    "datamodule.batch_size=8",
    "datamodule.val_size=16",
]


MALLOC = "retained -> glibc default malloc (whole runs)"
NVML = "no driver: NVML check per step left on"
BLOCKS = "torch.compile per block"
# the seed's network, for the compile time of `model.compile_scope` (network, blocks, stack)
SEED_NET = "vit_base_patch32_224"

COMPILE_PROBE = """
import json, sys, time
import timm, torch, torch.nn.functional as F
from vitrain.distributed.parallelize import apply_compile, transformer_blocks

scope, name, batch, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
net = timm.create_model(name, num_classes=10, drop_path_rate=0.1)
optimizer = torch.optim.AdamW(net.parameters(), fused=True)
apply_compile(net, transformer_blocks(net), scope=scope)
x, y = torch.randn(batch, 3, 224, 224), torch.randint(0, 10, (batch,))


def step():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(net(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


t0 = time.perf_counter()
step()
first = time.perf_counter() - t0
step()
t0 = time.perf_counter()
for _ in range(steps):
    step()
print(json.dumps({"compile_s": first, "step_s": (time.perf_counter() - t0) / steps}))
"""


# the compile scopes under progressive resizing, host work per step: blocks (12 compiled calls forward and 12
# backward) against their stack (one each), on a 12-block ViT so narrow that the step is host work, as a GPU
# step is for its host; after a 16-24-32 px ramp, so that both run their graphs with a dynamic token count
RESIZE_PROBE = """
import json, sys, time
import timm, torch, torch.nn.functional as F
from torch import nn
from vitrain.distributed.parallelize import parallelize

depth, rounds, steps, smoke = (int(a) for a in sys.argv[1:5])
torch.set_num_threads(1)
if smoke:  # Dynamo's tracing, without Inductor's C++ build
    compile_ = nn.Module.compile
    nn.Module.compile = lambda self, **kw: compile_(self, backend="eager")


def build(scope):
    torch.manual_seed(0)
    net = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=depth,
                            num_heads=2, num_classes=10, dynamic_img_size=True, drop_path_rate=0.1)
    parallelize(net, None, compile=True, resizes=True, compile_scope=scope)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)

    def step(size):
        x, y = torch.randn(8, 3, size, size), torch.randint(0, 10, (8,))
        F.cross_entropy(net(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    for size in (16, 24, 32, 32):
        step(size)
    return step, time.perf_counter() - t0


built = {scope: build(scope) for scope in ("blocks", "stack")}
times = {scope: [] for scope in built}
for r in range(rounds):
    for scope in (list(built) if r % 2 == 0 else list(built)[::-1]):
        step = built[scope][0]
        t0 = time.perf_counter()
        for _ in range(steps):
            step(32)
        times[scope].append((time.perf_counter() - t0) / steps * 1e3)
print(json.dumps({"ms": times, "ramp_s": {k: v[1] for k, v in built.items()}}))
"""


def fresh_probe(script: str, *argv: str, what: str) -> dict[str, Any]:
    """`python <script file> *argv` in a fresh process with a fresh compiler cache (a probe must not find an
    earlier one's kernels); its last stdout line, as JSON. A script file, not `-c`: the tests' smoke run
    starts it warm (tests/warm.py), a process forked before any compile."""
    workdir = Path(tempfile.mkdtemp(dir=scratch_dir("inductor-probe")))
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(workdir / "cache"),
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    (workdir / "probe.py").write_text(script)
    done = subprocess.run(
        [sys.executable, str(workdir / "probe.py"), *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def resize_scopes(smoke: bool) -> dict[str, Any]:
    """`RESIZE_PROBE`: per scope the ms per step of each round, and the ramp's seconds (both sizes' compiles)."""
    shape = ("2", "2", "2", "1") if smoke else ("12", "8", "10", "0")
    return fresh_probe(RESIZE_PROBE, *shape, what="resize probe")


def compile_probe(scope: str, model: str, batch: int, steps: int) -> dict[str, float]:
    """First step (the compile) and step time of `model` compiled as `scope`, each scope in a fresh process
    and compiler cache."""
    return fresh_probe(COMPILE_PROBE, scope, model, str(batch), str(steps), what=f"compile probe ({scope})")


class Variant:
    """One network + optimizer, stepped on random images of the model's input size."""

    def __init__(
        self,
        cfg: Any,
        x: torch.Tensor,
        y: torch.Tensor,
        *,
        fused_attn: bool | None,
        bf16: bool,
        fused_adamw: bool,
        compile: bool | str,
        channels_last: bool,
    ) -> None:
        import hydra
        from timm.optim import param_groups_weight_decay

        from vitrain.models.classifier import hydra_partial, set_fused_attn

        torch.manual_seed(0)
        self.net = hydra.utils.instantiate(cfg.model).net.train()
        layout = torch.channels_last if channels_last else torch.contiguous_format
        self.net.to(memory_format=layout)  # as ImageClassifier(channels_last=...) does, either way
        x = x.contiguous(memory_format=layout)
        if fused_attn is not None:
            set_fused_attn(self.net, fused_attn)
        factory = hydra_partial(cfg.model.optimizer)
        kwargs = {k: v for k, v in factory.keywords.items() if k not in ("fused", "foreach")}
        groups = param_groups_weight_decay(self.net, weight_decay=kwargs.get("weight_decay", 0.0))
        self.optimizer = factory.func(
            groups, **kwargs, **({"fused": True} if fused_adamw else {"foreach": True})
        )
        self.x, self.y, self.bf16 = x, y, bf16
        self.compile_s: float | None = None
        if compile:
            # as model.compile_scope does (vitrain/distributed/parallelize.py): the whole network, or each block
            apply_compile(
                self.net, transformer_blocks(self.net), scope="blocks" if compile == "blocks" else "network"
            )
            t0 = time.perf_counter()
            self.step()  # the first call compiles forward and backward
            self.compile_s = time.perf_counter() - t0
        for _ in range(3):  # allocator, oneDNN primitive caches
            self.step()

    def step(self) -> None:
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()
        with ctx:
            loss = F.cross_entropy(self.net(self.x), self.y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def steps_per_s(self, steps: int) -> float:
        self.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        return steps / (time.perf_counter() - t0)


def train_steps_per_s(args: Any, workdir: Path, retain: bool, steps: int, warmup: int = 5) -> float:
    """Steps/s of one `src/train.py experiment=cifar_cpu` run (no callbacks or logger: the step alone)."""
    run_dir = Path(tempfile.mkdtemp(dir=workdir))
    overrides = [
        SMALL_VIT,
        *data_overrides(args),
        *short_run(warmup + steps + 1, bare=True),
        f"extras.retain_freed_memory={str(retain).lower()}",
        f"hydra.run.dir={run_dir}",
        *(SMOKE if args.smoke else []),
    ]
    run_train([*overrides, *probe_overrides(run_dir / "probe.json")], log=run_dir / "output.log")
    ends = json.loads((run_dir / "probe.json").read_text())["step_ends"][warmup:]
    return (len(ends) - 1) / (ends[-1] - ends[0])


def main() -> None:
    args = parse_args(
        __doc__,
        rounds=(int, 3, "rounds"),
        steps=(int, 6, "timed steps per segment"),
        compile=(int, 1, "1: include torch.compile (its compile time counts against the budget)"),
        train_steps=(int, 40, "timed steps of each whole run (the malloc lever)"),
    )
    if args.smoke:
        args.rounds, args.steps, args.compile = 1, 2, 0
    result = Result("levers", args)
    # as src/train.py does (extras.retain_freed_memory): the in-process loops run with the template's malloc
    from vitrain.utils.cuda_check import NVML_CHECK, skip_failing_nvml_check
    from vitrain.utils.host_memory import retain_freed_memory

    retain_freed_memory()
    nvml_skipped = skip_failing_nvml_check()  # as src/train.py does
    cfg = compose(
        [SMALL_VIT, "extras.print_config=false", *(SMOKE if args.smoke else [])],
        scratch_dir("levers"),
    )
    shipped = {
        "fused_attn": cfg.model.get("fused_attn"),
        # `auto`: as the shipped run resolves it on this machine
        "bf16": str(resolve_precision(cfg.trainer)).startswith("bf16"),
        "fused_adamw": bool(cfg.model.optimizer.get("fused")),
        # `auto` is off on a CPU (vitrain/models/classifier.py: compile_choice without a GPU strategy)
        "compile": compile_choice(cfg.model.get("compile"), None),
        "channels_last": bool(cfg.model.get("channels_last")),
    }
    batch, size = int(cfg.datamodule.batch_size), int(cfg.model.net.img_size)
    x, y = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))
    sdpa = shipped["fused_attn"] in (None, True)  # timm's default is SDPA
    changes = {
        "SDPA -> matmul attention" if sdpa else "matmul -> SDPA attention": {"fused_attn": not sdpa},
        "bf16 -> fp32" if shipped["bf16"] else "fp32 -> bf16": {"bf16": not shipped["bf16"]},
        "fused -> foreach AdamW" if shipped["fused_adamw"] else "foreach -> fused AdamW": {
            "fused_adamw": not shipped["fused_adamw"]
        },
        "channels-last -> NCHW" if shipped["channels_last"] else "NCHW -> channels-last": {
            "channels_last": not shipped["channels_last"]
        },
    }
    if args.compile and not shipped["compile"]:
        changes["torch.compile"] = {"compile": True}
        changes[BLOCKS] = {"compile": "blocks"}
    variants = {"as configured": Variant(cfg, x, y, **shipped)}
    for name, change in changes.items():
        variants[name] = Variant(cfg, x, y, **{**copy.deepcopy(shipped), **change})
    if nvml_skipped:  # the network as configured, with the check Lightning turns on
        variants[NVML] = Variant(cfg, x, y, **shipped)
    calls = {k: (lambda v=v: v.steps_per_s(args.steps)) for k, v in variants.items()}
    if nvml_skipped:
        nvml = variants[NVML]

        def nvml_steps() -> float:
            with mock.patch.dict(os.environ, {NVML_CHECK: "1"}):
                return nvml.steps_per_s(args.steps)

        calls[NVML] = nvml_steps
    runs = interleave(calls, args.rounds)
    # whole runs, as configured vs glibc's defaults: the "as configured" figures above stay the in-process ones
    workdir = scratch_dir("levers-malloc")
    train_steps = 2 if args.smoke else args.train_steps
    malloc = interleave(
        {
            "retain": lambda: train_steps_per_s(args, workdir, True, train_steps),
            "defaults": lambda: train_steps_per_s(args, workdir, False, train_steps),
        },
        1 if args.smoke else 2,
    )
    base = runs["as configured"]
    rel = {k: round(ratio(v, base), 3) for k, v in runs.items() if k not in ("as configured", MALLOC)}
    rel[MALLOC] = round(ratio(malloc["defaults"], malloc["retain"]), 3)
    figures: dict[str, Any] = {f"{k} (x steps/s)": v for k, v in rel.items()}
    figures["as configured (steps/s)"] = round(median(base), 3)
    compiled = variants.get("torch.compile")
    notes = []
    if compiled is not None:
        step_s = 1 / median(runs["torch.compile"])
        saved_per_step = 1 / median(base) - step_s
        figures["compile seconds"] = round(compiled.compile_s or 0.0, 1)
        if saved_per_step > 0:
            figures["steps to repay compile"] = round((compiled.compile_s or 0) / saved_per_step)
        notes.append(
            "torch.compile: worth it when the run is much longer than the compile time "
            "(`steps to repay compile` x the step time)"
        )
    scopes: dict[str, dict[str, float]] = {}
    if args.compile:  # model.compile_scope on the seed's network, each in a fresh process and cache
        scopes = {scope: compile_probe(scope, SEED_NET, 16, 5) for scope in ("network", "blocks", "stack")}
        net_s = scopes["network"]
        figures[f"{SEED_NET} first step (compile) s, network / blocks / stack"] = " / ".join(
            f"{scopes[k]['compile_s']:.1f}" for k in ("network", "blocks", "stack")
        )
        for scope in ("blocks", "stack"):
            figures[f"{SEED_NET} compile time, {scope} / network"] = round(
                scopes[scope]["compile_s"] / net_s["compile_s"], 2
            )
            figures[f"{SEED_NET} steps/s, {scope} / network"] = round(
                net_s["step_s"] / scopes[scope]["step_s"], 3
            )
        notes.append(
            f"model.compile_scope on the seed's network ({SEED_NET}, batch 16, bf16 autocast, one fresh process "
            "and compiler cache each, one run each): the first step holds the compile"
        )
    resize = resize_scopes(args.smoke) if args.compile or args.smoke else None
    if resize is not None:
        ms = resize["ms"]
        saved = [b - s for b, s in zip(ms["blocks"], ms["stack"], strict=True)]
        figures["resizing, ms per step: blocks / stack"] = (
            f"{median(ms['blocks']):.2f} / {median(ms['stack']):.2f}"
        )
        figures["resizing, ms per step the stack saves (median of paired rounds)"] = round(median(saved), 2)
        figures["resizing, rounds the stack was faster"] = f"{sum(d > 0 for d in saved)} of {len(saved)}"
        figures["resizing, ramp seconds (both compiles): blocks / stack"] = (
            f"{resize['ramp_s']['blocks']:.1f} / {resize['ramp_s']['stack']:.1f}"
        )
        notes.append(
            "Compile scopes under progressive resizing (`compile_scope=auto` takes the stack since 2026-11-30): "
            "a 12-block ViT of width 32 at batch 8, one thread, so that the step is host work, as a GPU step "
            "is for its host; a 16-24-32 px ramp first (each scope's two compiles, the second with a dynamic "
            "token count), then both stepped at 32 px in interleaved rounds of 10 steps, in a fresh process "
            "and compiler cache. The blocks make 12 compiled calls forward and 12 backward a step, the stack "
            "one each; on a CPU the stack's graph also fuses across blocks."
        )
    line = (
        "; ".join(f"{k}: {v:.2f}x" for k, v in rel.items())
        + " (steps/s relative to the experiment as configured)"
        + (
            f"; under progressive resizing the blocks' stack {median(saved):.1f} ms a step less host work than "
            f"the blocks one by one (faster in {sum(d > 0 for d in saved)} of {len(saved)} rounds)"
            if resize is not None
            else ""
        )
    )
    result.save(
        line,
        figures=figures,
        goal=None,
        met=None,
        notes=notes,
        shipped=shipped,
        rounds={k: [round(v, 3) for v in vs] for k, vs in runs.items()},
        malloc_rounds={k: [round(v, 3) for v in vs] for k, vs in malloc.items()},
        compile_scopes={k: {n: round(x, 3) for n, x in v.items()} for k, v in scopes.items()},
        batch_size=batch,
        img_size=size,
    )


if __name__ == "__main__":
    main()
