"""`make gpu-check`: every GPU path of the template, exercised in a few minutes on the GPUs of this machine.

Runs `src/train.py` / `src/eval.py` as a user does (Lightning's own launcher for N GPUs), on a generated
class-folder dataset (no internet, no download, random init), then checks what each run left behind and
prints a PASS/FAIL table; the figures (images/s, MFU, GPU memory, utilisation, batch size...) go to
`<out>/gpu_check.json`. Works with one GPU (DDP and FSDP then run with devices=1, through the strategies).

    python bench/gpu_check.py                 # all visible GPUs, ViT-B/32 at 224 px (the seed's model)
    python bench/gpu_check.py --gpus 1 --only single_gpu,fsdp
    python bench/gpu_check.py --list          # the checks and what each one shows

docs/gpu.md says what each check shows and what the CPU tests cover instead.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for extra in (ROOT / "src", ROOT / "tests", ROOT / "bench"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

import torch  # noqa: E402
from common import TINY_VIT_NET  # noqa: E402

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
# a compiled block (or its activation-checkpointing wrapper) compiled again: what the blocks' own
# stochastic-depth rates did before they became tensors (vitrain/distributed/drop_path.py; ViT-B/32: 7
# recompiles per rank, then Dynamo's limit)
RECOMPILED_BLOCK = re.compile(r"Recompiling function forward in ")
# what the runs import (module -> pip name); nvidia-ml-py is checked by the environment check
NEEDED = {"hydra": "hydra-core", "omegaconf": "omegaconf", "lightning": "lightning", "timm": "timm",
          "torchvision": "torchvision", "torchmetrics": "torchmetrics", "tensorboard": "tensorboard",
          "rich": "rich", "dotenv": "python-dotenv", "psutil": "psutil", "matplotlib": "matplotlib",
          "litdata": "litdata"}  # fmt: skip


@dataclass
class Outcome:
    status: str
    detail: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


class CheckFailed(AssertionError):
    pass


def expect(condition: Any, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


# ---------------------------------------------------------------------------------------------- the runs
@dataclass
class Ctx:
    args: argparse.Namespace
    out: Path
    data: Path
    cache: Path
    gpus: int
    cpu: bool = False  # --cpu-dry-run: the same commands on CPU processes (checks the script, not the GPU)
    runs: dict[str, Path] = field(default_factory=dict)

    def on(self, trainer: str) -> list[str]:
        """`trainer=<gpu|ddp|fsdp>` and its device overrides (CPU processes in a dry run)."""
        if not self.cpu:
            return [f"trainer={trainer}"]
        return ["trainer=cpu"] if trainer == "gpu" else [f"trainer={trainer}", "trainer.accelerator=cpu"]

    @property
    def precision(self) -> str:
        return "32-true" if self.cpu else self.args.precision

    def base(
        self, batch_size: int | None = None, steps: int | None = None, eval_batches: int = 4, epochs: int = 1
    ) -> list[str]:
        """The seed's model (random init), the generated data, short epochs, logs every 10 steps."""
        a = self.args
        model = (
            TINY_VIT_NET
            if self.cpu
            else [
                f"model.net.model_name={a.model}",
                f"model.net.img_size={a.img_size}",
                f"model.net.patch_size={a.patch_size}",
            ]
        )
        return [
            "experiment=cifar",
            "model.net.pretrained=false",
            *model,
            "datamodule.download=false",
            f"datamodule.data_dir={self.data}",
            f"datamodule.cache_dir={self.cache}",
            f"datamodule.batch_size={batch_size or a.batch_size * self.gpus}",
            f"datamodule.val_size={32 if self.cpu else 256}",
            "datamodule.num_workers=2",
            f"trainer.max_epochs={epochs}",
            f"trainer.limit_train_batches={steps or a.steps}",
            f"trainer.limit_val_batches={eval_batches}",
            f"trainer.limit_test_batches={eval_batches}",
            "trainer.log_every_n_steps=10",
            "callbacks.throughput.window_size=10",
            "callbacks.run_stats.gpu_sample_interval=1.0",
            "logger=tensorboard",
            "extras.print_config=false",
        ]

    def run(self, name: str, script: str, overrides: list[str], env: dict[str, str] | None = None) -> Path:
        run_dir = self.out / name
        cmd = [sys.executable, str(ROOT / "src" / script), *overrides, f"hydra.run.dir={run_dir}"]
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "bench"), full_env.get("PYTHONPATH", "")])
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir.parent / f"{name}.command.txt").write_text(" ".join(cmd) + "\n")
        with (run_dir.parent / f"{name}.log").open("w") as log:
            done = subprocess.run(
                cmd, cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT, timeout=self.args.timeout
            )
        self.runs[name] = run_dir
        if done.returncode != 0:
            tail = (run_dir.parent / f"{name}.log").read_text(errors="replace").strip().splitlines()[-15:]
            raise CheckFailed(
                f"exit code {done.returncode}; log {run_dir.parent / f'{name}.log'}:\n" + "\n".join(tail)
            )
        return run_dir


def setting(overrides: list[str], **values: Any) -> list[str]:
    """`overrides` with `key=value` for each of `values` (dots as "__"), earlier settings of the key dropped:
    Hydra refuses a key given twice."""
    keys = {k.replace("__", "."): v for k, v in values.items()}
    kept = [o for o in overrides if o.lstrip("+").split("=", 1)[0] not in keys]
    return [*kept, *(f"{k}={v}" for k, v in keys.items())]


def num(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def report_of(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "report.json"
    expect(path.is_file(), f"no report.json in {run_dir}")
    return json.loads(path.read_text())


def gpu_figures(report: dict[str, Any]) -> dict[str, Any]:
    """What the run report says about the GPUs: memory, utilisation, MFU, images/s."""
    memory = report.get("memory") or {}
    util = report.get("gpu_utilization") or {}
    per_mem = memory.get("per_device") or []
    per_util = util.get("per_device") or []
    return {
        "device": memory.get("device_name"),
        "precision": report.get("precision"),
        "world_size": report.get("world_size"),
        "images_per_s": report.get("throughput_monitor_images_per_s")
        or report.get("throughput_images_per_s"),
        "mfu": report.get("mfu"),
        "peak_flops_per_device": (report.get("flops") or {}).get("peak_flops_per_device"),
        "peak_memory_gb": report.get("peak_memory_gb"),
        "memory_per_rank_gb": [d.get("max_reserved_gb") for d in per_mem],
        "allocated_per_rank_gb": [d.get("max_allocated_gb") for d in per_mem],
        "utilisation_available": util.get("available"),
        "utilisation_reason": util.get("reason"),
        "utilisation_mean_pct": [d.get("mean_pct") for d in per_util],
        "test": (report.get("metrics") or {}).get("test"),
    }


def expect_gpu_report(ctx: Ctx, fig: dict[str, Any], world: int) -> None:
    expect(fig["world_size"] == world, f"world size {fig['world_size']}, expected {world}")
    if ctx.cpu:
        return
    expect(fig["peak_memory_gb"] and fig["peak_memory_gb"] > 0, "no GPU memory in the report")
    expect(fig["utilisation_available"], f"no GPU utilisation in the report ({fig['utilisation_reason']})")
    expect(fig["mfu"] is not None, f"no MFU in the report (peak FLOPs for {fig['device']} unknown?)")
    low, high = ctx.args.mfu_range
    expect(
        low <= fig["mfu"] <= high,
        f"MFU {fig['mfu']:.3f} outside the plausible {low}-{high} (wrong peak or dtype?)",
    )


def expect_no_syncs(ctx: Ctx, run_dir: Path, fig: dict[str, Any]) -> dict[str, Any]:
    """What the run's SyncProbe counted (into `fig`): no host sync in the steps it measured."""
    probe = json.loads((run_dir / "sync_probe.json").read_text())
    fig["host_syncs_between_log_steps"] = probe
    expect(ctx.cpu or probe["windows"] > 0, "the sync probe measured no step")
    expect(
        probe["syncs"] == 0, f"{probe['syncs']} host syncs in {probe['windows']} steps: {probe['where'][:5]}"
    )
    return probe


def checkpoint_in(run_dir: Path, name: str = "last") -> Path:
    folder = run_dir / "checkpoints"
    found = sorted(folder.glob(f"{name}*")) if folder.is_dir() else []
    expect(found, f"no {name} checkpoint in {folder}")
    return found[0]


def device_tensors(obj: Any, where: str = "") -> list[str]:
    """Paths of the tensors in `obj` that are not on the CPU."""
    if isinstance(obj, torch.Tensor):
        return [f"{where} on {obj.device}"] if obj.device.type != "cpu" else []
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in device_tensors(v, f"{where}/{k}")]
    if isinstance(obj, list | tuple):
        return [p for i, v in enumerate(obj) for p in device_tensors(v, f"{where}[{i}]")]
    return []


# -------------------------------------------------------------------------------------------- the checks
def check_environment(ctx: Ctx) -> Outcome:
    """GPUs, capabilities, versions; NVML (nvidia-ml-py) for the report's utilisation without nvidia-smi."""
    import lightning

    if ctx.cpu:
        return Outcome(SKIP, "CPU dry run")
    names = [torch.cuda.get_device_name(i) for i in range(ctx.gpus)]
    caps = [".".join(map(str, torch.cuda.get_device_capability(i))) for i in range(ctx.gpus)]
    figures: dict[str, Any] = {
        "gpus": names,
        "capability": caps,
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "cuda": torch.version.cuda,
        "nccl": str(torch.cuda.nccl.version()),
    }
    try:
        import pynvml  # noqa: F401  (nvidia-ml-py)

        figures["utilisation_now_pct"] = torch.cuda.utilization(0)
    except Exception as err:  # reported, not fatal here: the runs' reports say it again
        return Outcome(FAIL, f"NVML unusable ({err}): pip install nvidia-ml-py", figures)
    from vitrain.callbacks.throughput import peak_flops

    figures["peak_bf16_tflops"] = [(peak_flops(n, torch.bfloat16) or 0) / 1e12 for n in names]
    expect(all(figures["peak_bf16_tflops"]), f"no dense bf16 peak known for {names}: MFU will be missing")
    return Outcome(PASS, f"{ctx.gpus} x {names[0]} (cc {caps[0]})", figures)


def check_single_gpu(ctx: Ctx) -> Outcome:
    """1 GPU, trainer.precision=auto (bf16-mixed from compute capability 8.0), the seed's model: trains, validates, tests; the report has GPU
    memory, utilisation and a plausible MFU; no host sync inside the steps between two log steps."""
    run_dir = ctx.run(
        "single_gpu",
        "train.py",
        [
            *ctx.base(ctx.args.batch_size),
            *ctx.on("gpu"),
            f"trainer.precision={ctx.precision}",
            "+callbacks.sync_probe._target_=gpu_check.SyncProbe",
        ],
    )
    fig = gpu_figures(report_of(run_dir))
    expect(
        ctx.cpu
        or "bf16" in str(fig["precision"])
        or ctx.args.precision not in ("auto", "bf16-mixed")
        or torch.cuda.get_device_capability(0) < (8, 0),
        f"precision {fig['precision']}",
    )
    expect_gpu_report(ctx, fig, 1)
    expect_no_syncs(ctx, run_dir, fig)
    return Outcome(
        PASS,
        f"{num(fig['images_per_s'], '.0f')} img/s, MFU {num(fig['mfu'], '.1%')}, {num(fig['peak_memory_gb'], '.1f')} GB",
        fig,
    )


def check_recipes(ctx: Ctx) -> Outcome:
    """1 GPU, the options added after the first GPU run (2026-11-23): an image folder held in memory with
    RandAugment and random erasing on the GPU, EMA of the weights, progressive resizing, flip TTA: trains,
    validates, tests; no host sync inside the steps between two log steps; compiled (on a GPU), the blocks
    compile twice at most (the second time for a dynamic token count)."""
    size, patch = (32, 8) if ctx.cpu else (ctx.args.img_size, ctx.args.patch_size)
    # experiment=cifar's model, trainer and schedule, with an image folder in place of its CIFAR datamodule
    base = [o for o in ctx.base(ctx.args.batch_size) if not o.startswith("datamodule.download")]
    run_dir = ctx.run(
        "recipes",
        "train.py",
        [
            *base,
            "datamodule=image_folder",
            "~datamodule.download",
            "datamodule.in_memory=true",
            "datamodule.auto_augment=rand-m9-n2-mstd0.5",
            "datamodule.re_prob=0.25",
            "callbacks=[default,ema]",
            "+model.net.dynamic_img_size=true",
            f"model.progressive_resize.start_size={max(size // 2 // patch, 1) * patch}",
            f"model.progressive_resize.multiple={patch}",
            "model.tta_flip=true",
            *ctx.on("gpu"),
            f"trainer.precision={ctx.precision}",
            "+callbacks.sync_probe._target_=gpu_check.SyncProbe",
        ],
        env={"TORCH_LOGS": "recompiles"},
    )
    fig = gpu_figures(report_of(run_dir))
    expect_gpu_report(ctx, fig, 1)
    log = (run_dir.parent / "recipes.log").read_text(errors="replace")
    fig["block_recompiles"] = len(RECOMPILED_BLOCK.findall(log))
    expect(
        fig["block_recompiles"] <= 1, f"the blocks compiled {fig['block_recompiles']} more times (1 expected)"
    )
    expect("image folder: in memory" in log, "the image folder was not held in memory")
    ckpt = torch.load(checkpoint_in(run_dir), weights_only=True, map_location="cpu")
    expect("current_model_state" in ckpt and "averaging_state" in ckpt, "no EMA state in the checkpoint")
    probe = expect_no_syncs(ctx, run_dir, fig)
    return Outcome(
        PASS,
        f"{num(fig['images_per_s'], '.0f')} img/s, {probe['windows']} steps without a host sync",
        fig,
    )


def check_ddp(ctx: Ctx) -> Outcome:
    """DDP on N GPUs: 2 epochs, then resume from last.ckpt for a 3rd: every rank loads it to the CPU (no N
    copies on GPU 0: per-rank memory stays balanced); the checkpoint holds CPU tensors (the background save
    copies the state to host memory) and our IO loads to the CPU whatever a file holds."""
    overrides = [
        *ctx.base(epochs=2),
        *ctx.on("ddp"),
        f"trainer.devices={ctx.gpus}",
        f"trainer.precision={ctx.precision}",
    ]
    run_dir = ctx.run("ddp", "train.py", overrides)
    fig = gpu_figures(report_of(run_dir))
    expect_gpu_report(ctx, fig, ctx.gpus)
    last = checkpoint_in(run_dir)
    from vitrain.checkpoints import AtomicCheckpointIO

    raw = torch.load(last, weights_only=True)  # plain data; where the tensors were saved (host memory)
    fig["saved_on"] = sorted({p.rsplit(" on ", 1)[1] for p in device_tensors(raw)})
    del raw
    on_device = device_tensors(AtomicCheckpointIO().load_checkpoint(last))
    expect(not on_device, f"AtomicCheckpointIO loaded tensors to GPUs: {on_device[:3]}")
    resumed = ctx.run("ddp_resume", "train.py", setting(overrides, trainer__max_epochs=3, ckpt_path=last))
    rfig = gpu_figures(report_of(resumed))
    fig["resume"] = rfig
    mem = [m for m in rfig["allocated_per_rank_gb"] if m]
    if len(mem) > 1:
        expect(max(mem) / min(mem) < 1.25, f"per-rank peak memory unbalanced after resume: {mem} GB")
    return Outcome(
        PASS, f"{ctx.gpus} ranks, {num(fig['images_per_s'], '.0f')} img/s, resumed; peak/rank {mem} GB", fig
    )


def check_cpu_resume(ctx: Ctx) -> Outcome:
    """A checkpoint written on GPUs resumes on a machine without one (CUDA_VISIBLE_DEVICES empty)."""
    if "ddp" not in ctx.runs:
        return Outcome(SKIP, "needs the ddp check's checkpoint")
    last = checkpoint_in(ctx.runs["ddp"])
    ctx.run(
        "cpu_resume",
        "train.py",
        [
            *ctx.base(8, steps=2, eval_batches=1, epochs=3),
            "trainer=cpu",
            "trainer.precision=32-true",
            "test=false",
            f"ckpt_path={last}",
        ],
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    return Outcome(PASS, f"resumed {last.name} on the CPU")


def check_fsdp(ctx: Ctx) -> Outcome:
    """FSDP2 on N GPUs (bf16 mixed precision): start-up (no collective on CPU tensors), validation then
    training (inference mode), sharded checkpoint (meta.pt CPU-only), resume from it under Lightning's
    inference_mode=true (the strategy's own gather fix), MFU against the bf16 peak, eval.py on the folder."""
    overrides = [
        *ctx.base(epochs=2),
        *ctx.on("fsdp"),
        f"trainer.devices={ctx.gpus}",
        "trainer.strategy.mixed_precision=bf16",
        "trainer.precision=32-true",
    ]
    run_dir = ctx.run("fsdp", "train.py", overrides)
    fig = gpu_figures(report_of(run_dir))
    expect_gpu_report(ctx, fig, ctx.gpus)
    last = checkpoint_in(run_dir)
    expect(last.is_dir(), f"{last} is not a sharded folder")
    meta = torch.load(last / "meta.pt", weights_only=True)  # as Lightning reads it: no map_location
    on_device = device_tensors(meta)
    expect(not on_device, f"GPU tensors in meta.pt: {on_device[:3]}")
    resumed = ctx.run(
        "fsdp_resume",
        "train.py",
        setting(overrides, trainer__max_epochs=3, trainer__inference_mode="true", ckpt_path=last),
    )
    fig["resume"] = gpu_figures(report_of(resumed))
    ctx.run(
        "fsdp_eval",
        "eval.py",
        [
            f"ckpt_path={last}",
            *ctx.on("gpu"),
            "trainer.limit_test_batches=4",
            f"datamodule.data_dir={ctx.data}",
            f"datamodule.cache_dir={ctx.cache}",
        ],
    )
    return Outcome(PASS, f"{ctx.gpus} ranks, MFU {num(fig['mfu'], '.1%')} (bf16 peak), resumed + eval", fig)


def check_fsdp_compile(ctx: Ctx) -> Outcome:
    """FSDP2 + activation checkpointing + torch.compile per block before fully_shard (parallelize.py); the
    blocks share one graph (no block recompiled: TORCH_LOGS=recompiles); hybrid sharding (2-D mesh) when
    N >= 2."""
    shard = max(1, ctx.gpus // 2)
    overrides = [
        *ctx.base(),
        *ctx.on("fsdp"),
        f"trainer.devices={ctx.gpus}",
        "trainer.strategy.mixed_precision=bf16",
        "trainer.strategy.activation_checkpointing=true",
        f"trainer.strategy.hybrid_shard={shard}",
        "model.compile=true",
        "test=false",
    ]
    t0 = time.perf_counter()
    run_dir = ctx.run("fsdp_compile", "train.py", overrides, env={"TORCH_LOGS": "recompiles"})
    fig = gpu_figures(report_of(run_dir))
    fig["wall_s_with_compile"] = round(time.perf_counter() - t0, 1)
    fig["mesh"] = [ctx.gpus // shard, shard]
    log = (run_dir.parent / "fsdp_compile.log").read_text(errors="replace")
    fig["block_recompiles"] = len(RECOMPILED_BLOCK.findall(log))
    if fig["block_recompiles"]:
        return Outcome(
            FAIL, f"the blocks compiled {fig['block_recompiles']} more times (one graph expected)", fig
        )
    return Outcome(
        PASS,
        f"mesh {ctx.gpus // shard}x{shard}, one graph for all blocks, {num(fig['images_per_s'], '.0f')} img/s "
        "after compile",
        fig,
    )


def check_batch_size_search(ctx: Ctx) -> Outcome:
    """`+tune=batch_size` on the run's first device (the last GPU here: devices=[N-1]); it stops at an
    out-of-memory error or max_val, and its answer trains."""
    index = ctx.gpus - 1
    run_dir = ctx.run(
        "batch_size_search",
        "train.py",
        [
            *ctx.base(8),
            *ctx.on("gpu"),
            "trainer.devices=1" if ctx.cpu else f"trainer.devices=[{index}]",
            f"trainer.precision={ctx.precision}",
            "+tune=batch_size",
            f"tune.batch_size.max_val={ctx.args.max_batch}",
            "tune.batch_size.steps_per_trial=2",
        ],
    )
    found = json.loads((run_dir / "batch_size_search.json").read_text())
    expect(found["per_device"] >= 1, f"found {found['per_device']}")
    expect(
        ctx.cpu or found.get("device_index") == index,
        f"searched on cuda:{found.get('device_index')}, not cuda:{index}",
    )
    return Outcome(PASS, f"{found['per_device']} per device on cuda:{index} ({found['stopped_by']})", found)


# ------------------------------------------------------------------ GPU JPEG decode (h13b, issue 13 part B)
def check_gpu_decode(ctx: Ctx) -> Outcome:
    """`datamodule.decode_device=cuda`: nvJPEG batch decode + GPU crop/flip/normalise gives the CPU decode's
    pixels (rounding aside), the batched resize F.interpolate's per crop, images/s on the GPU vs one CPU
    core; then a few training steps of `datamodule=streaming` with the GPU decoder, from shards of the
    generated data."""
    if ctx.cpu:
        return Outcome(SKIP, "CPU dry run (the CPU tests run this code path with device=cpu)")
    from vitrain.data.gpu_decode import check
    from vitrain.data.shards import write_shards

    figures = check("cuda")
    expect(figures["mean_abs_pixel_diff"] < 3.0, f"GPU decode differs from the CPU decode: {figures}")
    expect(figures["resize_max_abs_diff"] < 0.5, f"batched resize differs from F.interpolate: {figures}")
    shards = ctx.out / "gpu_decode_shards"
    write_shards(ctx.data, str(shards), val_size=32, workers=4, cache_dir=ctx.cache)
    # the ViT keys (img_size, patch_size) of the base runs come with experiment=cifar's model=vit
    model = ["model=vit", *(o for o in ctx.base() if o.startswith("model."))]
    run_dir = ctx.run(
        "gpu_decode",
        "train.py",
        [
            *model,
            "model.net.pretrained=false",
            "datamodule=streaming",
            f"datamodule.data_dir={shards}",
            f"datamodule.cache_dir={ctx.cache}",
            "datamodule.decode_device=cuda",
            f"datamodule.batch_size={ctx.args.batch_size}",
            "datamodule.num_workers=4",
            "trainer=gpu",
            "trainer.max_epochs=1",
            "trainer.limit_train_batches=10",
            "trainer.limit_val_batches=2",
            "test=false",
            "logger=csv",
            "extras.print_config=false",
        ],
    )
    expect((run_dir / "checkpoints" / "last.ckpt").is_file(), "no checkpoint after the streaming run")
    return Outcome(
        PASS,
        f"decode+augment {figures['device_images_per_s']:.0f} images/s on the GPU, "
        f"{figures['cpu_images_per_s']:.0f} on one CPU core; 10 steps trained from shards",
        figures,
    )


def check_data_on_device(ctx: Ctx) -> Outcome:
    """In-memory data held on the GPU (`datamodule.data_on_device`, on by default for CIFAR): the training
    loader's batches are those of the host loader, byte for byte, sliced on the GPU without a host sync."""
    if ctx.cpu:
        return Outcome(
            SKIP, "CPU dry run (tests/test_data.py runs the loader with the data on the meta device)"
        )
    from lightning.pytorch import Trainer

    from vitrain.data.datamodules.cifar import CIFAR10DataModule

    def loader(on_device: bool) -> Any:
        dm = CIFAR10DataModule(
            str(ctx.data), str(ctx.cache), batch_size=64, val_size=64, data_on_device=on_device
        )
        dm.trainer = Trainer(accelerator="cuda", devices=1, logger=False, enable_progress_bar=False)
        dm.setup("fit")
        return dm.train_dataloader()

    host, held = loader(False), loader(True)
    expect(held.dataset.x.is_cuda and not host.dataset.x.is_cuda, "the data was not held on the GPU")
    torch.cuda.set_sync_debug_mode("error")  # a synchronising call in the loader raises
    try:
        on_gpu = [(x.x.clone(), y.clone()) for x, y in held]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    pairs = list(zip([(x.x.cuda(), y.cuda()) for x, y in host], on_gpu, strict=True))
    expect(all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in pairs), "batches differ")
    return Outcome(PASS, f"{len(pairs)} batches of 64 equal to the host loader's, sliced on the GPU, no sync")


def check_decode_ahead(ctx: Ctx) -> Outcome:
    """`decode_device=cuda` with the batches decoded by a thread on its own CUDA stream, ahead of the
    training thread (`datamodule.decode_ahead=2`): the same model input as the training thread decoding each
    batch itself (`decode_ahead=0`), batch by batch, over an epoch of the generated folder."""
    if ctx.cpu:
        return Outcome(
            SKIP, "CPU dry run (tests/test_image_folder.py runs the thread with the decoder on the CPU)"
        )
    from lightning.pytorch import Trainer

    from vitrain.data.datamodules.image_folder import ImageFolderDataModule

    def epoch(ahead: int) -> list[Any]:
        dm = ImageFolderDataModule(
            str(ctx.data), str(ctx.cache), batch_size=64, val_size=0.05, num_workers=4, in_memory=False,
            decode_device="cuda", decode_ahead=ahead, img_size=ctx.args.img_size,
        )  # fmt: skip
        dm.trainer = Trainer(accelerator="cuda", devices=1, logger=False, enable_progress_bar=False)
        dm.setup("fit")
        loader = dm.train_dataloader()
        expect((loader.ahead is not None) == (ahead > 0), f"decode_ahead={ahead}: wrong loader")
        return [dm.on_before_batch_transfer(batch, 0)[0].clone() for batch in loader]

    inline, ahead = epoch(0), epoch(2)
    same = len(inline) == len(ahead) and all(torch.equal(a, b) for a, b in zip(inline, ahead, strict=True))
    expect(same, "the batches decoded ahead differ from those decoded on the training thread")
    return Outcome(PASS, f"{len(ahead)} batches of 64 decoded ahead on a side stream equal the inline ones")


def check_augment_ahead(ctx: Ctx) -> Outcome:
    """In-memory batches held on the GPU, sliced and augmented (RandAugment, random erasing) by a thread on its
    own CUDA stream ahead of the training thread (`datamodule.augment_ahead=2`): the
    same model input as the training thread augmenting each batch itself (`augment_ahead=0`), batch by batch,
    over an epoch, with no synchronising call on the training thread."""
    if ctx.cpu:
        return Outcome(
            SKIP,
            "CPU dry run (tests/test_data.py runs the thread in a fit on the CPU, against inline and a resume)",
        )
    from lightning.pytorch import Trainer

    from vitrain.data.datamodules.cifar import CIFAR10DataModule

    def epoch(ahead: int) -> list[Any]:
        dm = CIFAR10DataModule(
            str(ctx.data), str(ctx.cache), batch_size=64, val_size=64, data_on_device=True, augment_ahead=ahead,
            auto_augment="rand-m9-n2-mstd0.5", re_prob=0.25, img_size=ctx.args.img_size,
        )  # fmt: skip
        dm.trainer = Trainer(accelerator="cuda", devices=1, logger=False, enable_progress_bar=False)
        dm.setup("fit")
        loader = dm.train_dataloader()
        expect((loader.ahead is not None) == (ahead > 0), f"augment_ahead={ahead}: wrong loader")
        out = []
        torch.cuda.set_sync_debug_mode("error")  # a synchronising call on this thread raises
        try:
            for batch in loader:
                x, y = dm.on_after_batch_transfer(dm.on_before_batch_transfer(batch, 0), 0)
                out.append((x.clone(), y.clone()))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return out

    inline, ahead = epoch(0), epoch(2)
    same = len(inline) == len(ahead) and all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(inline, ahead, strict=True)
    )
    expect(same, "the batches augmented ahead differ from those the training thread augments")
    return Outcome(PASS, f"{len(ahead)} batches of 64 augmented ahead on a side stream equal the inline ones")


CHECKS: dict[str, Callable[[Ctx], Outcome]] = {
    "environment": check_environment,
    "single_gpu": check_single_gpu,
    "recipes": check_recipes,
    "ddp": check_ddp,
    "cpu_resume": check_cpu_resume,
    "fsdp": check_fsdp,
    "fsdp_compile": check_fsdp_compile,
    "batch_size_search": check_batch_size_search,
    "gpu_decode": check_gpu_decode,
    "data_on_device": check_data_on_device,
    "decode_ahead": check_decode_ahead,
    "augment_ahead": check_augment_ahead,
}


# ------------------------------------------------------------------------------------- in-run sync probe
try:
    import lightning as L
    from lightning.pytorch.callbacks import Callback
except ImportError:  # pragma: no cover
    Callback = object  # type: ignore[misc,assignment]


class SyncProbe(Callback):
    """Counts host<->GPU synchronisations between the starts of two training batches that are not log steps
    (torch.cuda.set_sync_debug_mode("warn")): the template promises none there. Writes sync_probe.json."""

    def __init__(self, first_step: int = 5, last_step: int = 40) -> None:
        self.first_step, self.last_step = first_step, last_step
        self.windows, self.syncs, self.where, self.stacks = 0, 0, [], []
        self._recorder: Any = None
        self._records: list[dict[str, Any]] | None = None

    def _close(self) -> None:
        if self._recorder is not None:
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode(0)
            self._recorder.__exit__(None, None, None)
            found = [w for w in self._records or [] if "synchroniz" in str(w["message"])]
            self.syncs += len(found)
            self.where += [w["where"] for w in found]
            self.stacks += [w["stack"] for w in found if w["stack"] not in self.stacks]
            self.windows += 1
            self._recorder = self._records = None

    def _show(
        self, message: Any, category: Any, filename: str, lineno: int, *args: Any, **kwargs: Any
    ) -> None:
        """Keeps the Python stack of each warning: a file name alone does not say which library synced."""
        parts = Path(filename).parts
        stack = [
            f"{'/'.join(Path(f.filename).parts[-3:])}:{f.lineno} {f.name}" for f in traceback.extract_stack()
        ]
        assert self._records is not None
        self._records.append(
            {"message": str(message), "where": f"{'/'.join(parts[-3:])}:{lineno}", "stack": stack[-12:-1]}
        )

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        from vitrain.compat import should_update_logs

        self._close()
        step = trainer.global_step
        log_step = should_update_logs(trainer)
        # the window ends at the next batch's start: the step before a log step is measured too
        next_logs = (step + 2) % trainer.log_every_n_steps == 0
        if self.first_step <= step <= self.last_step and not log_step and not next_logs:
            # switched on before recording: torch warns about the mode itself once (seen on an H100), which is
            # no synchronisation of the step
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode("warn")
            self._recorder = warnings.catch_warnings()
            self._recorder.__enter__()
            self._records = []
            warnings.simplefilter("always")
            warnings.showwarning = self._show

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close()
        if trainer.is_global_zero:
            out = Path(trainer.default_root_dir) / "sync_probe.json"
            out.write_text(
                json.dumps(
                    {
                        "windows": self.windows,
                        "syncs": self.syncs,
                        "where": sorted(set(self.where)),
                        "stacks": self.stacks,
                    }
                )
            )


# ------------------------------------------------------------------------------------------------- main
def make_data(root: Path, per_class: int) -> Path:
    from data_factory import make_class_folders  # tests/data_factory.py: flat-colour PNGs, labels recoverable

    if not (root / "train").is_dir():
        make_class_folders(root, n_per_class_train=per_class, n_per_class_test=max(per_class // 8, 4))
    return root


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible)")
    parser.add_argument("--only", default="", help="comma-separated checks to run")
    parser.add_argument("--skip", default="", help="comma-separated checks to leave out")
    parser.add_argument("--list", action="store_true", help="list the checks and exit")
    parser.add_argument("--out", type=Path, default=None, help="work dir (default logs/gpu-check/<time>)")
    parser.add_argument("--model", default="vit_base_patch32_224")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--patch-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=128, help="per GPU")
    parser.add_argument("--steps", type=int, default=60, help="training batches per epoch")
    parser.add_argument("--per-class", type=int, default=800, help="generated training images per class")
    parser.add_argument(
        "--precision", default="auto", help="trainer.precision of the single-GPU and DDP runs"
    )
    parser.add_argument("--max-batch", type=int, default=2048, help="batch-size search ceiling")
    parser.add_argument("--mfu-range", type=float, nargs=2, default=(0.02, 0.9))
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    parser.add_argument(
        "--cpu-dry-run", action="store_true", help="tiny model on CPU processes: checks the script"
    )
    args = parser.parse_args()
    if args.list:
        for name, fn in CHECKS.items():
            print(f"{name:18s} {' '.join((fn.__doc__ or '').split())}")
        return 0
    missing = [pip for module, pip in NEEDED.items() if importlib.util.find_spec(module) is None]
    if missing:
        print(
            f"gpu-check: missing packages: pip install {' '.join(missing)} (or -r requirements.txt)",
            file=sys.stderr,
        )
        return 2
    if not torch.cuda.is_available() and not args.cpu_dry_run:
        print(
            "gpu-check: no CUDA GPU visible (torch.cuda.is_available() is False): nothing to check; "
            "--cpu-dry-run runs the same commands on CPU processes to check the script",
            file=sys.stderr,
        )
        return 2
    gpus = args.gpus or (2 if args.cpu_dry_run else torch.cuda.device_count())
    if args.cpu_dry_run:
        args.steps, args.batch_size, args.max_batch = 3, 4, 16
    out = (args.out or ROOT / "logs" / "gpu-check" / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"gpu-check: {gpus} GPU(s), work dir {out}", flush=True)
    data = make_data(out / "data", 16 if args.cpu_dry_run else args.per_class)
    ctx = Ctx(args, out, data, out / "cache", gpus, cpu=args.cpu_dry_run)
    only = {c for c in args.only.split(",") if c}
    skip = {c for c in args.skip.split(",") if c}
    results: dict[str, Outcome] = {}
    for name, fn in CHECKS.items():
        if (only and name not in only) or name in skip:
            continue
        print(f"-- {name}: {' '.join((fn.__doc__ or '').split())[:150]}", flush=True)
        t0 = time.perf_counter()
        try:
            outcome = fn(ctx)
        except CheckFailed as err:
            outcome = Outcome(FAIL, str(err))
        except Exception as err:
            outcome = Outcome(FAIL, f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=3)}")
        outcome.seconds = round(time.perf_counter() - t0, 1)
        results[name] = outcome
        print(
            f"   {outcome.status} ({outcome.seconds:.0f} s) {outcome.detail.splitlines()[0] if outcome.detail else ''}",
            flush=True,
        )
    summary = {
        "when": datetime.now().astimezone().isoformat(timespec="seconds"),
        "gpus": gpus,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "checks": {
            k: {"status": o.status, "detail": o.detail, "seconds": o.seconds, "figures": o.figures}
            for k, o in results.items()
        },
        "runs": {k: str(v) for k, v in ctx.runs.items()},
    }
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    width = max(map(len, results), default=10)
    print(f"\n{'check':{width}s}  result  seconds  detail")
    for name, o in results.items():
        first, *rest = (o.detail or "").splitlines() or [""]
        print(f"{name:{width}s}  {o.status:6s}  {o.seconds:7.0f}  {first}")
        if o.status == FAIL:
            for line in rest[:15]:
                print(f"{'':{width}s}                   {line}")
    failed = [n for n, o in results.items() if o.status == FAIL]
    print(f"\n{'FAIL: ' + ', '.join(failed) if failed else 'ALL PASS'}; figures in {out / 'gpu_check.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
