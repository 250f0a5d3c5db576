"""GPU benchmark (`make bench-gpu`): every GPU path of the template next to a hand-written loop of the same work.

On one GPU, in one run: a hand-written PyTorch loop (the seed's model, batch, fused AdamW, bf16 autocast, data
on the GPU and prepared batch-wise there as the template does: eager, `torch.compile`d, and compiled with
float8 matmuls where torchao is installed and the GPU has fp8; at the seed's batch and at 1024), then the
template as a user runs it (`src/train.py`, one fresh process per path): the seed run (and at batch 1024, and
with the 2026-11-26 settings), FSDP2 on one GPU, the recipes path (an image folder in memory with RandAugment,
random erasing, EMA, progressive resizing and flip TTA), an image folder of photo-sized JPEGs at 224 px read
from disk (CPU and nvJPEG decode), and streaming shards (CPU and nvJPEG decode). Per path: steady-state
images/s (synchronised at the two ends of the timed window, after the warm-up steps), MFU (Lightning's FLOP
count of the model x images/s / the GPU's dense bf16 peak), the host's wait for data as a share of the
window, GPU utilisation sampled during the window (NVML), where the GPU time goes (torch.profiler over a few
steps after the timed window: matmul, attention, communication, copies, fused elementwise; host ops; the GPU's
ms per step), the host's CPU time per step: the training thread's and, on a GPU, the autograd thread's that
runs the backward while the training thread waits for it (medians over the window; their sum at or above the
GPU's ms per step: the host is the limit), and that of the thread that prepares batches ahead where one runs
(in-memory augmentation, GPU decode), where the training thread's wall time goes (its Python stack sampled
at 300 Hz over 10 steps after the window: by part of the step, line and function; the other threads' Python
and CPU time), the first step (compile + warm-up) apart, peak memory. Sections run in priority order within
`--budget` seconds: what does not fit is listed as skipped, with the reason. Without CUDA it runs the same
code with a tiny model on the CPU and marks every figure "not measured".
"""

# python bench/gpu.py                     # every section, ~15 minutes on one H100 (--budget 900)
# python bench/gpu.py --quick             # one path of each kind, ~8 minutes (--plan quick)
# python bench/gpu.py --plan table        # a prepared run that fits one device call (PLANS; bench/lease.sh)
# python bench/gpu.py --only hand,seed    # a subset
# python bench/gpu.py --smoke             # a tiny model on the CPU: checks the script, measures nothing

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for extra in (ROOT / "src", ROOT / "bench"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

import torch  # noqa: E402
from common import (  # noqa: E402
    CACHE_DIR,
    DATA_DIR,
    PYTHON,
    RESULTS,
    TINY_VIT_NET,
    Result,
    probe_overrides,
    train_command,
    train_env,
)
from probe import REST, STACK_HZ, STAGES, backward_threads, gpu_time_shares, threads_cpu_seconds  # noqa: E402

from vitrain.callbacks.throughput import peak_flops  # noqa: E402

MODEL = "vit_base_patch32_224"
# the seed's network at CPU-smoke size
TINY = {"model_name": "vit_tiny_patch16_224", "img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2,
        "num_heads": 2}  # fmt: skip
# priority order, and the most seconds each may take on one H100 (data preparation included)
SECTIONS: dict[str, int] = {
    "hand": 180,
    "seed": 110,
    "fsdp": 110,
    "fsdp_compiled": 110,
    "fsdp_per_block": 110,
    "fsdp_blocks": 110,
    "fsdp_autocast": 110,
    "recipes": 200,
    "recipes_ahead": 200,
    "folder_gpu_decode": 100,
    "folder": 100,
    "streaming_gpu_decode": 100,
    "streaming": 100,
    "seed_1024": 90,
    "seed_blocks": 80,
    "seed_fp8": 120,
    "hand_fp8": 110,
    "seed_before": 100,
    "seed_eager": 60,
    "seed_host_data": 80,
    "seed_ahead": 80,
    "seed_cudagraphs": 110,
    "folder_gpu_decode_inline": 100,
    "recipes_blocks": 200,
    "recipes_fixed_size": 150,
    "recipes_cudagraphs": 200,
    "seed_levers": 200,
}
WHAT = {
    "hand": "hand-written loop",
    "hand_fp8": "hand-written loop, compiled, float8 matmuls (torchao)",
    "seed_before": "`experiment=cifar`, 2026-11-26 settings (eager, pageable batches, foreach AdamW)",
    "seed": "`experiment=cifar` (today's defaults)",
    "seed_1024": "`experiment=cifar datamodule.batch_size=1024`",
    "seed_blocks": "`experiment=cifar model.compile_scope=blocks` (each block compiled, one graph for all)",
    "seed_fp8": "`experiment=cifar model.float8=true model.compile_scope=blocks` (torchao float8 matmuls; compare "
    "with seed_blocks)",
    "seed_eager": "`experiment=cifar model.compile=false` (pinned batches, fused AdamW, eager)",
    "seed_levers": "`experiment=cifar datamodule.batch_size=1024 model.float8=true model.compile_scope=blocks "
    "model.compile_mode=reduce-overhead` (the levers towards 40 % MFU together)",
    "seed_cudagraphs": "`experiment=cifar model.compile_mode=reduce-overhead` (the compiled network replayed as CUDA "
    "graphs)",
    "seed_host_data": "`experiment=cifar datamodule.data_on_device=false` (batches sliced in host memory, pinned, "
    "copied each step, as before 2026-11-27 15:30 UTC)",
    "seed_ahead": "`experiment=cifar datamodule.augment_ahead=2` (a thread slices and augments the batches two ahead "
    "of the training thread)",
    "folder": "`datamodule=image_folder` from disk, photo-sized JPEGs, timm transforms in workers",
    "folder_gpu_decode": "`datamodule=image_folder` from disk, `decode_device=cuda` (nvJPEG)",
    "folder_gpu_decode_inline": "`datamodule=image_folder` from disk, `decode_device=cuda decode_ahead=0` (the training "
    "thread decodes, as before 2026-11-27 16:00 UTC)",
    "recipes": "recipes: the photo folder in memory, RandAugment + erasing, EMA, progressive resizing, flip TTA",
    "recipes_blocks": "recipes with `model.compile_scope=blocks` (each block compiled, as before 2026-11-30's "
    "twenty-eighth session, instead of the 12 blocks' container as one graph)",
    "recipes_fixed_size": "recipes without progressive resizing (every step at 224 px: the whole network compiled "
    "with static shapes, where resizing compiles the blocks with a dynamic token count)",
    "recipes_cudagraphs": "recipes with `model.compile_mode=reduce-overhead` (each compiled block replayed as CUDA "
    "graphs: the network's launches off the host)",
    "recipes_ahead": "recipes with `datamodule.augment_ahead=2` (a thread slices and augments the batches two ahead "
    "of the training thread)",
    "fsdp": "`trainer=fsdp` on 1 GPU, bf16 FSDP policy",
    "fsdp_compiled": "`trainer=fsdp` on 1 GPU, bf16 FSDP policy, `model.compile=true` (the blocks' container, "
    "FSDP's one group, as one graph)",
    "fsdp_autocast": "`trainer=fsdp` on 1 GPU as configured (fp32 weights gathered, bf16 autocast: "
    "`trainer.precision=auto`, no FSDP policy), `model.compile=true` (the blocks' container as one graph)",
    "fsdp_blocks": "fsdp_compiled with `model.compile_scope=blocks` (the one group's blocks compiled one by "
    "one, as before 2026-11-30's twenty-eighth session)",
    "fsdp_per_block": "fsdp_compiled with `trainer.strategy.unit_params=0` (each block its own FSDP group and "
    "graph, the default before 2026-11-27's tenth session; the default groups ViT-B's 12 blocks as one)",
    "streaming": "`datamodule=streaming` (litdata shards of the photos), CPU decode in workers",
    "streaming_gpu_decode": "`datamodule=streaming`, `decode_device=cuda` (nvJPEG)",
}
# Prepared runs (`--plan NAME`; `bench/lease.sh NAME` runs one on a lent GPU machine): each fits one call of the
# device's 10-minute limit with its set-up (sections took 50-95 s each on one H100, compile included; a plan's
# budget cuts the rest, listed as skipped). Flags given with --plan override its values.
PLANS: dict[str, dict[str, Any]] = {
    # one path of each kind (`--quick`)
    "quick": {"only": "hand,seed,fsdp,fsdp_compiled,folder_gpu_decode,recipes", "steps": 20, "warmup": 6,
              "photos": 9600, "budget": 480},
    # the issue's table: every path once, each next to the compiled hand-written loop and the seed
    "table": {"only": "hand,seed,recipes,fsdp_compiled,fsdp_autocast,folder,folder_gpu_decode,streaming_gpu_decode",
              "steps": 30, "warmup": 6, "photos": 19_200, "budget": 480},
    # towards 40 % MFU: all levers at once, then each alone, each next to the hand-written loop at its batch
    "levers": {"only": "hand,seed_levers,seed_1024,seed_cudagraphs,seed_fp8,hand_fp8",
               "hand_variants": "compiled_patchmm,compiled_patchmm@1024", "steps": 30, "warmup": 6,
               "budget": 480},
    # the alternatives to today's defaults, each beside the default measured in `table`
    "alternatives": {"only": "hand,recipes_ahead,seed_ahead,seed_host_data,recipes_blocks,fsdp_blocks,"
                     "fsdp_per_block,folder_gpu_decode_inline,recipes_fixed_size,recipes_cudagraphs,"
                     "streaming,seed_blocks", "steps": 30, "warmup": 6, "photos": 19_200, "budget": 480},
}  # fmt: skip
# hand-written variants `compiled...+NAME`: torch.compile modes, levers measured before the template offers
# them (autotune: Inductor benchmarks Triton/cuBLAS choices per matmul; cudagraphs: each graph replayed as one
# CUDA graph, no per-kernel launches; shapes are static in this loop)
COMPILE_MODES = {"autotune": "max-autotune-no-cudagraphs", "cudagraphs": "reduce-overhead"}
# template runs: kernels and host ops of this many steps after the timed window (bench/probe.py)
PROFILE_STEPS = 3
# the share of the photos the shards keep for validation
SHARDS_VAL = 0.03
# template runs: the training thread's Python stack sampled this often over this many steps after the timed window
# (probe.StackSampler): where its wall time goes, by line and by function
STACK_STEPS = 10


# ------------------------------------------------------------------------------------------ hand-written
def hand_loop(variant: str, batch: int, steps: int, warmup: int, cpu: bool) -> dict[str, Any]:
    """The seed run's work written by hand: ViT-B/32 (10 classes, drop path 0.1), CIFAR-sized uint8 images
    held on the device, each batch flipped, resized to 224 px and normalised there, bf16 autocast, label
    smoothing 0.1, fused AdamW. `variant`: eager | compiled, then `_patchmm` (the template's patch-embedding
    matmul) and `_mathattn` (timm's matmul-softmax attention instead of SDPA's kernels, as
    `model.fused_attn=false`: ViT-B/32's sequences are 50 tokens, short for flash attention's tiles); or fp8
    (compiled, patch matmul, torchao float8 linears). `+autotune` / `+cudagraphs` compile with one of
    torch.compile's modes (COMPILE_MODES); `@N` runs it at batch N."""
    import timm
    import torch.nn.functional as F

    variant, mode_name, at = split_variant(variant)
    batch = at or batch
    mode = COMPILE_MODES.get(mode_name)
    device = torch.device("cpu" if cpu else "cuda")
    torch.manual_seed(0)
    net_kwargs = dict(TINY) if cpu else {"model_name": MODEL, "img_size": 224, "patch_size": 32}
    size = net_kwargs["img_size"]
    model = timm.create_model(**net_kwargs, num_classes=10, drop_path_rate=0.1).to(device)
    variant, math_attention = variant.removesuffix("_mathattn"), variant.endswith("_mathattn")
    if math_attention:
        for module in model.modules():
            if hasattr(module, "fused_attn"):
                module.fused_attn = False
    if variant.endswith("_patchmm") or variant == "fp8":
        # the template's own rewrite of the patch convolution as one matmul (vitrain/models/timm_net.py)
        from vitrain.models.timm_net import patch_convs_as_matmuls

        patch_convs_as_matmuls(model)
    if variant == "fp8":
        from torchao.float8 import convert_to_float8_training

        # the head (768 -> 10) is no fp8 shape (dims must divide by 16)
        convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn != "head")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05, fused=device.type == "cuda")
    if variant.startswith(("compiled", "fp8")):
        model = torch.compile(model, mode=mode)
    n = 50_000 if not cpu else 512
    images = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, device=device)
    labels = torch.randint(0, 10, (n,), device=device)
    mean = torch.tensor([0.5, 0.5, 0.5], device=device).view(1, 3, 1, 1)
    std = torch.tensor([0.5, 0.5, 0.5], device=device).view(1, 3, 1, 1)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def step(i: int) -> None:
        if mode == "reduce-overhead":  # a new training step: the graphs' previous outputs may be reused
            torch.compiler.cudagraph_mark_step_begin()
        start = (i * batch) % (n - batch)
        x = images[start : start + batch].float().div_(255)
        flip = torch.rand(batch, 1, 1, 1, device=device) < 0.5
        x = torch.where(flip, x.flip(-1), x)
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
        x = (x - mean) / std
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            loss = F.cross_entropy(model(x), labels[start : start + batch], label_smoothing=0.1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    t0 = clock()
    step(0)
    first = clock() - t0
    for i in range(1, warmup):
        step(i)
    tids = backward_threads()  # the autograd thread that runs the backward on a GPU (none on a CPU)
    t1, cpu1, bwd1 = clock(), time.thread_time(), threads_cpu_seconds(tids)
    for i in range(warmup, warmup + steps):
        step(i)
    seconds = clock() - t1
    training_ms = 1000 * (time.thread_time() - cpu1) / steps
    backward_ms = 1000 * (threads_cpu_seconds(tids) - bwd1) / steps if tids else None
    compiled = not variant.startswith("eager")
    kernels = kernel_profile(step, warmup + steps) if compiled and device.type == "cuda" else None
    # MFU against the same table of dense peaks the template's throughput callback uses
    peak = peak_flops(torch.cuda.get_device_name(device), dtype) if device.type == "cuda" else None
    flops = flops_per_image(net_kwargs)
    return {
        "mfu": flops * batch * steps / seconds / peak if peak else None,
        "kernels": kernels,
        "variant": variant + ("_mathattn" if math_attention else "") + (f"+{mode_name}" if mode_name else ""),
        "images_per_s": batch * steps / seconds,
        # the host's CPU per step, as template_figures has it (means over the window here)
        "host_ms_per_step": training_ms,
        "backward_thread_ms_per_step": backward_ms,
        "backward_threads": len(tids),
        "first_step_s": first,
        "batch_size": batch,
        "steps_timed": steps,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 1024**3 if device.type == "cuda" else None,
        "flops_per_image": flops,
    }


def split_variant(variant: str) -> tuple[str, str, int | None]:
    """A hand-written variant's name, torch.compile mode (COMPILE_MODES' key or "") and batch (None: --batch);
    a name `hand_loop` would not know fails here, before anything is built."""
    rest, _, at = variant.partition("@")
    name, _, mode_name = rest.partition("+")
    base = name.removesuffix("_mathattn").removesuffix("_patchmm")
    known = name == "fp8" or base in ("eager", "compiled")
    bad_mode = mode_name and (base != "compiled" or mode_name not in COMPILE_MODES)
    if not known or bad_mode or (at and not at.isdigit()):
        raise ValueError(
            f"hand-written variant {variant!r}: eager|compiled[_patchmm][_mathattn][+{'|'.join(COMPILE_MODES)}]"
            "[@batch], or fp8 (+MODE on a compiled variant only)"
        )
    return name, mode_name, int(at) if at else None


def kernel_profile(step: Any, first: int, steps: int = 3) -> dict[str, Any]:
    """Where a step's GPU time goes (bench/probe.py's gpu_time_shares over `steps` steps)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(first, first + steps):
                step(i)
            torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6
        return gpu_time_shares(prof, steps, wall_us)
    except Exception as err:  # the timing above stands without the profile
        return {"error": f"{type(err).__name__}: {err}"[:300]}


def flops_per_image(net_kwargs: dict[str, Any]) -> float:
    """Forward + backward FLOPs of one image (Lightning's counter, on the meta device)."""
    import timm
    from lightning.fabric.utilities.throughput import measure_flops

    with torch.device("meta"):
        net = timm.create_model(**net_kwargs, num_classes=10)
        x = torch.empty(1, 3, net_kwargs["img_size"], net_kwargs["img_size"])
    return float(measure_flops(net, lambda: net(x), lambda y: y.sum()))


# ------------------------------------------------------------------------------------------------- data
def _photo(job: tuple[str, str]) -> None:
    """One CIFAR image upsampled to a photo's size (400 x 350 px, JPEG quality 90)."""
    from PIL import Image

    src, dst = job
    with Image.open(src) as img:
        img.convert("RGB").resize((400, 350), Image.BICUBIC).save(dst, quality=90)


def make_photos(cifar: Path, dst: Path, train: int, val: int, workers: int) -> Path:
    """train/<class>/ and val/<class>/ of photo-sized JPEGs made from CIFAR-10's training images; those of an
    earlier call on the same machine reused when they were as many."""
    done = dst / "done"
    if done.is_file() and done.read_text() == f"{train} {val}":
        return dst
    shutil.rmtree(dst, ignore_errors=True)
    classes = sorted(p.name for p in (cifar / "train").iterdir() if p.is_dir())
    jobs = []
    for split, count in (("train", train), ("val", val)):
        per_class = count // len(classes)
        for c in classes:
            (dst / split / c).mkdir(parents=True, exist_ok=True)
            files = sorted((cifar / "train" / c).iterdir())
            offset = 0 if split == "train" else len(files) - per_class
            jobs += [(str(f), str(dst / split / c / f.name)) for f in files[offset : offset + per_class]]
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(_photo, jobs, chunksize=64))
    done.write_text(f"{train} {val}")
    return dst


def unpack_cifar(archive: Path, work: Path) -> Path:
    """The CIFAR-10 JPEG archive unpacked with the system tar (seconds for 60,000 files)."""
    if archive.is_dir():
        return archive
    dst = work / "cifar10"
    if not (dst / "train").is_dir():
        dst.mkdir(parents=True, exist_ok=True)
        subprocess.run(["tar", "xzf", str(archive), "-C", str(dst)], check=True)
    return dst


# ------------------------------------------------------------------------------------ template sections
class Ctx:
    def __init__(self, args: argparse.Namespace, work: Path, cpu: bool) -> None:
        self.args, self.work, self.cpu = args, work, cpu
        self.logs = args.out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self._cifar: Path | None = None
        self._photos: Path | None = None
        self._shards: Path | None = None

    @property
    def cifar(self) -> Path:
        if self._cifar is None:
            self._cifar = unpack_cifar(self.args.data_dir, self.work)
        return self._cifar

    @property
    def photos(self) -> Path:
        if self._photos is None:
            train, val = (self.args.photos, 640) if not self.cpu else (160, 40)
            self._photos = make_photos(self.cifar, self.work / "photos", train, val, os.cpu_count() or 2)
        return self._photos

    @property
    def shards(self) -> Path:
        if self._shards is None:
            from vitrain.data.shards import write_shards

            out = self.work / f"shards-{self.photo_count()}"  # made anew when the photos are
            if not out.is_dir():
                write_shards(
                    self.photos, str(out), val_size=SHARDS_VAL, workers=os.cpu_count(), cache_dir=self.work
                )
            self._shards = out
        return self._shards

    def photo_batches(self, val_share: float = 0.0) -> int:
        """Training batches in one epoch of the photos (of the shards made from them, which keep `val_share`
        of the photos for validation)."""
        return int(self.photo_count() * (1 - val_share)) // self.args.batch

    def photo_count(self) -> int:
        return len(list((self.photos / "train").rglob("*.jpg")))

    def common(self, name: str, batch: int | None = None, epoch_batches: int | None = None) -> list[str]:
        """The overrides every template section shares; `epoch_batches`: the data's batches per epoch, when
        fewer than warm-up + timed + sampled + profiled steps (the timed and sampled windows then shrink to
        fit one epoch, the sampled one to at most a third of what is left)."""
        a = self.args
        profile = PROFILE_STEPS if not self.cpu else 1
        stack = STACK_STEPS if not self.cpu else 2
        steps = a.warmup + a.steps + 1 + stack + profile
        if epoch_batches is not None and epoch_batches < steps:
            left = epoch_batches - a.warmup - 1 - profile
            stack = min(stack, left // 3)
            if left - stack < 2:
                raise RuntimeError(f"{epoch_batches} batches per epoch: too few for the warm-up and a window")
            steps = epoch_batches
        return [
            "experiment=cifar",
            "model.net.pretrained=false",
            *(TINY_VIT_NET if self.cpu else []),
            f"datamodule.batch_size={batch or a.batch}",
            f"datamodule.cache_dir={self.work / 'cache'}",
            f"paths.cache_dir={self.work / 'cache'}",
            "trainer.max_epochs=1",
            f"trainer.limit_train_batches={steps}",
            "trainer.limit_val_batches=2",
            "trainer.num_sanity_val_steps=0",
            "test=false",
            "extras.print_config=false",
            "callbacks.run_stats.gpu_sample_interval=1.0",
            *(["trainer=cpu"] if self.cpu else []),
            f"hydra.run.dir={self.work / 'runs' / name}",
            *probe_overrides(
                self.work / "runs" / f"{name}.probe.json",
                warmup=a.warmup,
                sample_gpu=True,
                profile_steps=profile,
                stack_steps=stack,
                stack_hz=STACK_HZ,
            ),
        ]

    def cifar_data(self) -> list[str]:
        # the CPU smoke may run on a few hundred images (the tests' set): a validation split that fits them
        return [f"datamodule.data_dir={self.cifar}", "datamodule.download=false",
                *(["datamodule.val_size=40"] if self.cpu else [])]  # fmt: skip

    def folder_data(self, in_memory: bool) -> list[str]:
        """From disk: the template's own worker count (`num_workers: null`, 15 on a 16-core host with one
        GPU); in memory: none (batches are slices of the held tensor)."""
        return [
            "datamodule=image_folder",
            "~datamodule.download",
            f"datamodule.data_dir={self.photos}",
            f"datamodule.in_memory={str(in_memory).lower()}",
            *(["datamodule.num_workers=0"] if in_memory else []),
        ]

    def train(self, name: str, overrides: list[str], timeout: float) -> dict[str, Any]:
        """One `src/train.py` run; its figures from the probe and the run's report."""
        cmd = [PYTHON, str(ROOT / "src" / "train.py"), *overrides]
        with open(self.logs / f"{name}.log", "w") as log:
            done = subprocess.run(
                cmd, cwd=ROOT, env=train_env(), stdout=log, stderr=subprocess.STDOUT, timeout=timeout
            )
        if done.returncode != 0:
            tail = (self.logs / f"{name}.log").read_text(errors="replace")[-1500:]
            raise RuntimeError(f"src/train.py exited {done.returncode}: ...{tail}")
        run_dir = self.work / "runs" / name
        probe = json.loads((self.work / "runs" / f"{name}.probe.json").read_text())
        report = json.loads((run_dir / "report.json").read_text())
        return {**template_figures(probe, report, self.args.warmup), "command": train_command(overrides)}


def template_figures(probe: dict[str, Any], report: dict[str, Any], warmup: int) -> dict[str, Any]:
    """Steady-state figures of the timed window (batches warmup..end, synchronised at both ends)."""
    end = probe.get("window_end")  # the timed window's last batch (profiled batches follow it)
    starts, ends = probe["step_starts"], probe["step_ends"][: None if end is None else end + 1]
    batch = int((report.get("batch_size") or {}).get("per_device_observed") or 0) or None
    timed = len(ends) - 1 - warmup
    seconds = ends[-1] - ends[warmup]
    ips = batch * timed / seconds if batch and timed > 0 and seconds > 0 else None
    waits = [starts[i] - ends[i - 1] for i in range(warmup + 1, min(len(starts), len(ends)))]

    # the host's CPU time per timed step: the training thread's, and the autograd thread's that runs the
    # backward on a GPU while the training thread waits (bench/probe.py); their sum at or above the GPU's time
    # per step, the host is the limit
    def per_step(key: str) -> list[float]:  # a clock read at each batch's end -> each timed step's share
        clock = probe.get(key) or []
        return [clock[i] - clock[i - 1] for i in range(warmup + 1, min(len(clock), len(ends)))]

    host, backward = per_step("step_cpu"), per_step("step_backward_cpu")
    threads = probe.get("backward_threads")  # None: a probe from before it was recorded
    # the threads that prepare batches ahead of the training thread (in-memory augmentation, GPU decode)
    ahead, ahead_threads = per_step("step_ahead_cpu"), probe.get("ahead_threads")
    flops = report.get("flops") or {}
    per_image, peak = flops.get("train_flops_per_image"), flops.get("peak_flops_per_device")
    util = probe.get("gpu_util_samples") or []
    return {
        "images_per_s": ips,
        "mfu": per_image * ips / peak if per_image and peak and ips else None,
        "data_wait_share": sum(waits) / seconds if seconds > 0 else None,
        "host_ms_per_step": 1000 * statistics.median(host) if host else None,
        "backward_thread_ms_per_step": 1000 * statistics.median(backward) if threads and backward else None,
        "backward_threads": threads,
        "ahead_thread_ms_per_step": 1000 * statistics.median(ahead) if ahead_threads and ahead else None,
        "ahead_threads": ahead_threads,
        # each timed step, for patterns a median hides (a cost every other step)
        "timed_steps_ms": {
            "wall": [round(1000 * (ends[i] - ends[i - 1]), 1) for i in range(warmup + 1, len(ends))],
            "training_thread_cpu": [round(1000 * t, 1) for t in host],
            "backward_thread_cpu": [round(1000 * t, 1) for t in backward] if threads else None,
            "ahead_thread_cpu": [round(1000 * t, 1) for t in ahead] if ahead_threads else None,
            "data_wait": [round(1000 * w, 1) for w in waits],
        },
        "gpu_util_pct": sum(util) / len(util) if util else None,
        "first_step_s": report.get("first_step_s"),
        "peak_memory_gb": (probe.get("peak_cuda_allocated") or 0) / 1024**3 or None,
        "batch_size": batch,
        "steps_timed": timed,
        "precision": report.get("precision"),
        "flops_per_image": per_image,
        "peak_flops": peak,
        "kernels": probe.get("kernels"),
        "stacks": probe.get("stacks"),
    }


def run_hand(ctx: Ctx, variants: list[str], timeout: float) -> dict[str, Any]:
    out = ctx.work / "hand.json"
    a = ctx.args
    cmd = [PYTHON, str(Path(__file__)), "--hand", ",".join(variants), "--hand-out", str(out),
           "--batch", str(a.batch), "--steps", str(a.steps), "--warmup", str(a.warmup),
           *(["--smoke"] if ctx.cpu else [])]  # fmt: skip
    name = "hand" if variants != ["fp8"] else "hand_fp8"
    with open(ctx.logs / f"{name}.log", "w") as log:
        try:
            done = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
            returncode = done.returncode
        except subprocess.TimeoutExpired:  # the variants that finished stand; the others say why not
            returncode = None
    results = json.loads(out.read_text()) if out.is_file() else {}
    if returncode is None:
        for variant in variants:
            results.setdefault(
                variant, {"error": f"TimeoutExpired: not finished within the section's {timeout:.0f} s"}
            )
    if returncode and not results:
        tail = (ctx.logs / f"{name}.log").read_text(errors="replace")[-1500:]
        raise RuntimeError(f"hand loop exited {done.returncode}: ...{tail}")
    return results


def section(ctx: Ctx, name: str, timeout: float) -> dict[str, Any]:
    if name == "hand":
        # on the CPU (--smoke) without compile: Inductor's C++ build of even a tiny ViT takes ~50 s there
        return run_hand(ctx, ["eager"] if ctx.cpu else ctx.args.hand_variants.split(","), timeout)
    if name == "hand_fp8":
        if ctx.cpu:
            raise RuntimeError("float8 needs a GPU")
        import importlib.util

        if importlib.util.find_spec("torchao") is None:
            raise RuntimeError("torchao is not installed")
        if torch.cuda.get_device_capability() < (8, 9):
            raise RuntimeError("no fp8 tensor cores on this GPU (compute capability < 8.9)")
        return run_hand(ctx, ["fp8"], timeout)
    started = time.perf_counter()
    base = ctx.common(name)
    if name == "seed_before":
        extra = [*ctx.cifar_data(), "model.compile=false", "datamodule.pin_memory=false",
                 "+model.optimizer.fused=false"]  # fmt: skip
    elif name == "seed":
        extra = ctx.cifar_data()
    elif name == "seed_1024":
        base = ctx.common(name, batch=1024 if not ctx.cpu else 16)
        extra = ctx.cifar_data()
    elif name == "seed_blocks":
        extra = [*ctx.cifar_data(), "model.compile_scope=blocks"]
        if ctx.cpu:  # the CPU smoke runs eagerly (compile=auto is off there): compile to check the path
            extra.append("model.compile=true")
    elif name == "seed_fp8":
        if ctx.cpu:
            raise RuntimeError("float8 needs a GPU with float8 tensor cores")
        # compiled block by block: the whole float8 network did not finish converting and compiling in ~75 s
        extra = [*ctx.cifar_data(), "model.float8=true", "model.compile_scope=blocks"]
    elif name == "seed_levers":
        if ctx.cpu:
            raise RuntimeError("float8 needs a GPU with float8 tensor cores")
        base = ctx.common(name, batch=1024)
        extra = [*ctx.cifar_data(), "model.float8=true", "model.compile_scope=blocks",
                 "model.compile_mode=reduce-overhead"]  # fmt: skip
    elif name == "seed_cudagraphs":
        extra = [*ctx.cifar_data(), "model.compile_mode=reduce-overhead"]
        if ctx.cpu:  # the CPU smoke compiles to check the path (Inductor replays no CUDA graph on a CPU)
            extra.append("model.compile=true")
    elif name == "seed_host_data":
        extra = [*ctx.cifar_data(), "datamodule.data_on_device=false"]
    elif name == "seed_ahead":
        extra = [*ctx.cifar_data(), "datamodule.augment_ahead=2"]
    elif name == "seed_eager":
        extra = [*ctx.cifar_data(), "model.compile=false"]
    elif name in ("folder", "folder_gpu_decode", "folder_gpu_decode_inline"):
        base = ctx.common(name, epoch_batches=ctx.photo_batches())
        decode = "cuda" if name.startswith("folder_gpu_decode") and not ctx.cpu else "cpu"
        extra = [*ctx.folder_data(in_memory=False), f"datamodule.decode_device={decode}"]
        if name == "folder_gpu_decode_inline":
            extra.append("datamodule.decode_ahead=0")
    elif name in ("recipes", "recipes_blocks", "recipes_ahead", "recipes_fixed_size", "recipes_cudagraphs"):
        size, patch = (32, 8) if ctx.cpu else (224, 32)
        # the photos held in memory make fewer batches than the other sections' window: the window fits
        base = ctx.common(name, epoch_batches=ctx.photo_batches())
        extra = [
            *ctx.folder_data(in_memory=True),
            "datamodule.auto_augment=rand-m9-n2-mstd0.5",
            "datamodule.re_prob=0.25",
            "callbacks=[default,ema]",
            "+model.net.dynamic_img_size=true",
            f"model.progressive_resize.start_size={size // 2 // patch * patch}",
            f"model.progressive_resize.multiple={patch}",
            # full size reached within the warm-up: the timed window compares like with like
            "model.progressive_resize.end=0.2",
            "model.tta_flip=true",
        ]
        if name == "recipes_ahead":
            extra.append("datamodule.augment_ahead=2")
        if name == "recipes_fixed_size":
            extra = [o for o in extra if not o.startswith("model.progressive_resize.")]
        if name == "recipes_cudagraphs":
            extra.append("model.compile_mode=reduce-overhead")
            if ctx.cpu:  # the CPU smoke runs eagerly (compile=auto is off there): compile to check the path
                extra.append("model.compile=true")
        if name == "recipes_blocks":
            extra.append("model.compile_scope=blocks")
            if ctx.cpu:  # the CPU smoke runs eagerly (compile=auto is off there): compile to check the path
                extra.append("model.compile=true")
    elif name in ("fsdp", "fsdp_compiled", "fsdp_per_block", "fsdp_autocast", "fsdp_blocks"):
        # the issue's FSDP row: the bf16 FSDP policy (bf16 weights gathered) in 32-true; `fsdp_autocast` is
        # trainer=fsdp as configured (fp32 weights gathered, the blocks' matmuls in bf16 under autocast)
        policy = ["trainer.strategy.mixed_precision=bf16", "trainer.precision=32-true"]
        extra = [
            *(["model.compile=true"] if name != "fsdp" else []),
            *(["trainer.strategy.unit_params=0"] if name == "fsdp_per_block" else []),
            *(["model.compile_scope=blocks"] if name == "fsdp_blocks" else []),
            *ctx.cifar_data(),
            "trainer=fsdp",
            "trainer.devices=1",
            *(policy if name != "fsdp_autocast" else []),
            *(["trainer.accelerator=cpu"] if ctx.cpu else []),
        ]
        base = [o for o in base if o != "trainer=cpu"]
    elif name in ("streaming", "streaming_gpu_decode"):
        base = ctx.common(name, epoch_batches=ctx.photo_batches(SHARDS_VAL))
        decode = "cuda" if name == "streaming_gpu_decode" and not ctx.cpu else "cpu"
        extra = [
            "datamodule=streaming",
            "~datamodule.download",
            f"datamodule.data_dir={ctx.shards}",
            f"datamodule.decode_device={decode}",
        ]
    else:
        raise ValueError(name)
    prepared = time.perf_counter() - started  # data made by the properties above, the first time
    result = ctx.train(name, [*base, *extra], max(30.0, timeout - prepared))
    return {**result, "data_preparation_s": round(prepared, 1)}


# ----------------------------------------------------------------------------------------------- render
def fmt(value: Any, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def table(results: dict[str, Any]) -> list[str]:
    """The markdown table of docs/benchmarks.md: each path against the compiled hand loop and the seed."""
    hand = (results.get("hand") or {}).get("figures") or {}
    seed = ((results.get("seed") or {}).get("figures") or {}).get("images_per_s")
    peaks = [(r.get("figures") or {}).get("peak_flops") for r in results.values() if isinstance(r, dict)]
    peak = next((p for p in peaks if p), None)
    rows = [
        "| path | images/s | MFU | x hand compiled | x seed | data wait | GPU util | GPU ms/step | host CPU ms/step: "
        "training + backward thread (+ batches ahead) | first step (compile) | peak GB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in SECTIONS:
        res = results.get(name)
        if res is None:
            continue
        if res.get("error"):
            rows.append(f"| {WHAT[name]} | {error_text(res)} | | | | | | | | | |")
            continue
        figs = res["figures"]
        entries = figs.items() if name.startswith("hand") else [("", figs)]
        for variant, f in entries:
            if f.get("error"):
                rows.append(f"| {WHAT[name]}: {variant} | {error_text(f)} | | | | | | | | | |")
                continue
            ips = f.get("images_per_s")
            ref = best_compiled(hand, f.get("batch_size")).get("images_per_s")
            label = f"{WHAT[name]}{': ' + variant if variant else ''}"
            mfu = f.get("mfu")
            if (
                mfu is None and ips and f.get("flops_per_image") and peak
            ):  # rows measured before "mfu" was kept
                mfu = f["flops_per_image"] * ips / peak
            rows.append(
                f"| {label} | {fmt(ips, ',.0f')} | {fmt(mfu, '.1%')} "
                f"| {fmt(ips / ref if ips and ref else None, '.2f')} "
                f"| {fmt(ips / seed if ips and seed else None, '.2f')} "
                f"| {fmt(f.get('data_wait_share'), '.1%')} | {fmt(f.get('gpu_util_pct'), '.0f')} "
                f"| {fmt((f.get('kernels') or {}).get('gpu_ms_per_step'), '.1f')} "
                f"| {host_cpu(f)} "
                f"| {fmt(f.get('first_step_s'), '.1f')} s | {fmt(f.get('peak_memory_gb'), '.1f')} |"
            )
    return rows


def stages_table(results: dict[str, Any]) -> list[str]:
    """Where each template row's training thread spent its timed window, by part of the step: the shares of
    its sampled Python stacks (`probe.StackSampler`, `probe.STAGES`); nothing when no row has them."""
    rows = {
        name: ((results[name].get("figures") or {}).get("stacks") or {})
        for name in SECTIONS
        if not name.startswith("hand") and isinstance(results.get(name), dict)
    }
    rows = {name: stacks for name, stacks in rows.items() if stacks.get("samples")}
    if not rows:
        return []
    stages = list(dict.fromkeys([*(stage for stage, _, _ in STAGES), REST]))
    used = [s for s in stages if any(stacks["stages"].get(s) for stacks in rows.values())]
    first = next(iter(rows.values()))
    return [
        "",
        f"Where the training thread's wall time goes: its Python stack sampled at {first['hz']:.0f} Hz over "
        f"{first.get('steps', 'a few')} steps after the timed window (the sampler slows a host-bound step by "
        "~10 %, so not in that window), the share of samples in each part of the step (the innermost frame "
        "that names one; `stacks` in the details has the lines and functions).",
        "",
        f"| path | samples | {' | '.join(used)} |",
        f"| --- | --- |{' --- |' * len(used)}",
        *(
            f"| {WHAT[name]} | {stacks['samples']} | "
            + " | ".join(fmt(stacks["stages"].get(s, 0.0), ".0%") for s in used)
            + " |"
            for name, stacks in rows.items()
        ),
    ]


def host_cpu(f: dict[str, Any]) -> str:
    """The host's CPU per step of a row: "training + backward thread" on a GPU; on a CPU the backward runs on
    the training thread (no autograd thread: one figure); a row measured before the backward thread was
    recorded says so. A thread that prepared the batches ahead adds its own figure."""
    training, backward = f.get("host_ms_per_step"), f.get("backward_thread_ms_per_step")
    ahead = f.get("ahead_thread_ms_per_step")
    more = f" + {ahead:.1f} ahead" if ahead is not None else ""
    if training is None:
        return "—"
    if backward is not None:
        return f"{training:.1f} + {backward:.1f}{more}"
    if f.get("backward_threads") == 0:
        return f"{training:.1f} (backward included){more}"
    return f"{training:.1f} + not measured{more}"


def best_compiled(hand: dict[str, Any], batch: int | None) -> dict[str, Any]:
    """The reference of a row: the fastest compiled hand-written variant at the same batch size."""
    same = [f for v, f in hand.items() if v.startswith("compiled") and f.get("batch_size") == batch]
    return max(same, key=lambda f: f.get("images_per_s") or 0, default={})


def summary_line(gpu: str | None, results: dict[str, Any], ratio: float | None) -> str:
    """The one line of docs/benchmarks.md's overview: the seed against the compiled hand-written loop, or, in a
    call without the seed section (the levers plan), each measured row, so that the line says what ran."""
    seed = (results.get("seed") or {}).get("figures") or {}
    if seed.get("images_per_s"):
        return (
            f"{gpu}: seed run {fmt(seed['images_per_s'], ',.0f')} images/s, MFU {fmt(seed.get('mfu'), '.1%')}, "
            f"{fmt(ratio, '.2f')}x the compiled hand-written loop"
        )
    rows = []
    for name, res in results.items():
        figures = (res or {}).get("figures") or {}
        # a hand-written section holds one figure set per variant, a template section one
        hand = name.startswith("hand")
        for label, f in [(f"hand-written {v}", f) for v, f in figures.items()] if hand else [(name, figures)]:
            if isinstance(f, dict) and f.get("images_per_s"):
                rows.append(f"{label} {f['images_per_s']:,.0f} images/s (MFU {fmt(f.get('mfu'), '.1%')})")
    return f"{gpu}: no seed section in this call; " + ("; ".join(rows) or "nothing measured")


def error_text(res: dict[str, Any]) -> str:
    """A failed section in one table cell: a time-out as such, else the error's last words."""
    error = " ".join(res["error"].replace("|", "/").split())
    if error.startswith("TimeoutExpired") and res.get("seconds"):
        return f"did not finish within its {res['seconds']:.0f} s (not measured)"
    if error.startswith("TimeoutExpired"):
        return error.split(": ", 1)[-1] + " (not measured)"
    return error[-200:]


def gpu_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name(0)
        facts["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        try:
            import pynvml

            pynvml.nvmlInit()
            facts["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception as err:  # NVML missing: the driver is not known, nothing else changes
            facts["driver"] = f"unknown ({err})"
    return facts


# ------------------------------------------------------------------------------------------------- main
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script")
    p.add_argument("--plan", choices=sorted(PLANS), default=None, help="a prepared run (PLANS): its sections, "
                   "steps and budget; flags given beside it win")  # fmt: skip
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"--plan quick: one path of each kind ({PLANS['quick']['only']}), the compiled hand-written loop "
        "only, fewer steps: ~8 minutes on one H100",
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--data-dir", type=Path, default=DATA_DIR, help="CIFAR-10 JPEG archive or folder")
    p.add_argument("--cache-dir", type=Path, default=CACHE_DIR, help="unused; kept for bench/run.py")
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--only", default="", help="comma-separated subset of " + ",".join(SECTIONS))
    p.add_argument(
        "--compile-cache",
        type=Path,
        default=None,
        help="a .tar.gz of an earlier call's compile cache to start from; this call's cache is written to "
        "--out under the same name (GPU only)",
    )
    p.add_argument("--budget", type=float, default=900.0, help="seconds for all sections together")
    p.add_argument("--batch", type=int, default=384)
    p.add_argument("--steps", type=int, default=40, help="timed steps")
    p.add_argument("--warmup", type=int, default=15, help="untimed steps first (compile included)")
    p.add_argument("--photos", type=int, default=19_200, help="photo-sized JPEGs to generate (training)")
    p.add_argument(
        "--hand-variants",
        default="eager_patchmm,compiled_patchmm,compiled_patchmm@1024",
        help="hand-written variants: eager|compiled[_patchmm][_mathattn][+autotune|+cudagraphs][@batch] "
        "(_patchmm: patch convolution as a matmul, as the template does on a GPU; _mathattn: timm's "
        "matmul-softmax attention; +MODE: a torch.compile mode; @N: at batch N)",
    )
    p.add_argument("--hand", default="", help=argparse.SUPPRESS)
    p.add_argument("--hand-out", type=Path, default=None, help=argparse.SUPPRESS)
    first = p.parse_args(argv)
    plan = "quick" if first.quick and first.plan is None else first.plan
    if plan is None:
        return first
    # the plan's values as defaults, so that flags on the command line still win
    p.set_defaults(**{"hand_variants": "compiled_patchmm", **PLANS[plan]})
    args = p.parse_args(argv)
    args.plan = plan
    return args


def hand_main(args: argparse.Namespace) -> int:
    """The child process of a hand-written section: each variant's figures into --hand-out as it goes."""
    cpu = args.smoke or not torch.cuda.is_available()
    if not cpu:
        torch.backends.cuda.matmul.allow_tf32 = True
    results: dict[str, Any] = {}
    for variant in args.hand.split(","):
        try:
            results[variant] = hand_loop(variant, args.batch, args.steps, args.warmup, cpu)
        except Exception as err:
            results[variant] = {"error": f"{type(err).__name__}: {err}"[:300]}
        args.hand_out.write_text(json.dumps(results, indent=1))
        print(variant, results[variant], flush=True)
    return 0


def section_deadline(budget: float) -> float:
    """When the sections must end (time.perf_counter): `budget` seconds from now, or the caller's wall-clock
    end in VITRAIN_BENCH_DEADLINE (seconds since the epoch; bench/lease.sh sets the device call's limit less
    the time to pack the results) if that comes first."""
    deadline = time.perf_counter() + budget
    end = os.environ.get("VITRAIN_BENCH_DEADLINE")
    return min(deadline, time.perf_counter() + float(end) - time.time()) if end else deadline


def main() -> int:
    args = parse()
    if args.hand:
        return hand_main(args)
    cpu = args.smoke or not torch.cuda.is_available()
    if cpu:
        args.batch, args.steps, args.warmup, args.photos = 8, 3, 2, 160
    result = Result("gpu", args)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(args, work, cpu)
    # one compile cache for every section: the template's (`paths.cache_dir`, below) and the hand-written
    # loops' child processes. A call may bring it warm from an earlier one (--compile-cache); the first steps'
    # seconds then measure a warm cache, which the JSON says
    cache = work / "cache" / "torch_compile"
    # where a warm cache came from: the archive, or an earlier run's scratch (--work reused, as bench/lease.sh's
    # second call on a warm machine does)
    cache_from = f"{work / 'cache'} (an earlier run)"
    if args.compile_cache is not None and args.compile_cache.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        shutil.unpack_archive(args.compile_cache, cache)
        cache_from = args.compile_cache.name
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    cache_at_start = sum(1 for f in cache.rglob("*") if f.is_file()) if cache.is_dir() else 0
    # --smoke (the tests' run) exercises the kinds of section: a hand-written loop, a template run, and one
    # with a thread that prepares its batches ahead
    names = [n for n in args.only.split(",") if n] or (
        ["hand", "seed", "seed_ahead"] if args.smoke else list(SECTIONS)
    )
    unknown = set(names) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown section(s) {', '.join(sorted(unknown))}; known: {', '.join(SECTIONS)}")
    for variant in args.hand_variants.split(","):  # a misspelt one stops here, not minutes into a GPU call
        try:
            split_variant(variant)
        except ValueError as err:
            raise SystemExit(str(err)) from None
    deadline = section_deadline(args.budget)
    results: dict[str, Any] = {}
    for name in names:
        left = deadline - time.perf_counter()
        if left < 30 and not cpu:
            results[name] = {"error": f"skipped: {args.budget:.0f} s budget spent"}
            continue
        t0 = time.perf_counter()
        try:
            timeout = SECTIONS[name] * (10 if cpu else 1)
            figures = section(ctx, name, min(timeout, left) if not cpu else timeout)
            results[name] = {"figures": figures}
        except Exception as err:
            results[name] = {"error": f"{type(err).__name__}: {err}"[:1500]}
        results[name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"{name} ({results[name]['seconds']:.0f} s):", json.dumps(results[name])[:600], flush=True)
        (args.out / "gpu_sections.json").write_text(json.dumps(results, indent=1, default=str))
    rows = table(results) + stages_table(results)
    if cache_at_start:
        rows += [
            "",
            f"First steps (compile) with the compile cache of an earlier call ({cache_at_start} files).",
        ]
    print("\n".join(rows), flush=True)
    facts = gpu_facts()
    seed = (results.get("seed") or {}).get("figures") or {}
    hand = best_compiled((results.get("hand") or {}).get("figures") or {}, seed.get("batch_size"))
    if cpu:
        line = "not measured: no CUDA device (the sections ran on the CPU with a tiny ViT)"
        met = None
    else:
        ratio = seed["images_per_s"] / hand["images_per_s"] if seed.get("images_per_s") and hand.get(
            "images_per_s") else None  # fmt: skip
        line = summary_line(facts.get("gpu"), results, ratio)
        met = bool(seed.get("mfu") and seed["mfu"] >= 0.40 and ratio and ratio >= 1.0)
    result.save(
        line,
        figures={
            "seed_images_per_s": seed.get("images_per_s"),
            "seed_mfu": seed.get("mfu"),
            "hand_compiled_images_per_s": hand.get("images_per_s"),
        },
        goal="seed run >= 40 % MFU and >= the compiled hand-written loop; other paths >= 0.85x the seed",
        met=met,
        table_md=rows,
        sections=results,
        gpu_facts=facts,
        compile_cache_at_start=(
            f"warm: {cache_at_start} files from {cache_from}" if cache_at_start else "cold"
        ),
    )
    if args.compile_cache is not None and not cpu:
        # the cache as this call leaves it, for the next call to bring (as a .tar.gz)
        keep = args.out / args.compile_cache.name.removesuffix(".tar.gz")
        shutil.make_archive(str(keep), "gztar", root_dir=cache)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
