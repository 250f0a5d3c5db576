"""GPU figures of the seed run (`experiment=cifar`: ViT-B/32 at 224 px, bf16-mixed): images/s, MFU, peak
memory and the largest batch size that fits one GPU.

With CUDA: a short fit through the template (`vitrain.tasks.training.train`, default callbacks) times the
steady-state steps (bench/probe.py; synchronised at the ends of the window), MFU = measured FLOPs per image
(forward + backward, counted by Lightning's `measure_flops` on a meta-device copy) x images/s / the GPU's
dense peak bf16 FLOPs (vitrain/callbacks/throughput.py, the callback's own table), peak memory = `torch.cuda.max_memory_allocated`, and the largest
batch size comes from the template's own search (`+tune=batch_size`, vitrain/tasks/tuning.py).
Without CUDA the same code runs with a tiny model on the CPU, and every figure is marked "not measured".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from common import (
    TINY_VIT_NET,
    Result,
    compose,
    data_overrides,
    parse_args,
    run_train,
    scratch_dir,
    train_command,
)

from vitrain.callbacks.throughput import peak_flops

SEED = [
    "experiment=cifar",
    "model.net.pretrained=false",
    "datamodule.download=false",
    "trainer.precision=bf16-mixed",
]
TINY = [
    *TINY_VIT_NET,
    "datamodule.batch_size=8",
    "datamodule.val_size=16",
]


def flops_per_image(net_cfg: dict[str, Any], img_size: int) -> float:
    """Forward + backward FLOPs of one image, on the meta device (nothing allocated)."""
    import timm
    from lightning.fabric.utilities.throughput import measure_flops

    with torch.device("meta"):
        net = timm.create_model(**{**net_cfg, "pretrained": False})
        x = torch.empty(1, 3, img_size, img_size)
    return float(measure_flops(net, lambda: net(x), lambda y: y.sum()))


def timed_fit(args: Any, overrides: list[str], workdir: Path) -> dict[str, Any]:
    from omegaconf import OmegaConf, open_dict
    from probe import BenchProbe

    from vitrain.tasks.training import train

    cfg = compose(
        [
            *overrides,
            "trainer.max_epochs=1",
            f"trainer.limit_train_batches={args.warmup + args.steps + 1}",
            "trainer.limit_val_batches=1",
            "test=false",
            "extras.print_config=false",
        ],
        workdir / "fit",
    )
    with open_dict(cfg):
        cfg.callbacks["bench_probe"] = {
            "_target_": "probe.BenchProbe",
            "out": str(workdir / "probe.json"),
            "warmup": args.warmup,
        }
    _, objects = train(cfg)
    probe = next(c for c in objects.trainer.callbacks if isinstance(c, BenchProbe))
    rec = probe.record
    ends = rec["step_ends"][args.warmup :]
    batch = int(cfg.datamodule.batch_size)
    net_cfg = OmegaConf.to_container(cfg.model.net, resolve=True)
    img = int(objects.model.input_spec["img_size"])
    return {
        "images_per_s": batch * (len(ends) - 1) / (ends[-1] - ends[0]),
        "flops_per_image": flops_per_image(net_cfg, img),
        "peak_memory_gb": (rec["peak_cuda_allocated"] / 1024**3) if "peak_cuda_allocated" in rec else None,
        "batch_size": batch,
        "img_size": img,
        "model": net_cfg["model_name"],
        "device": str(objects.trainer.strategy.root_device),
    }


def largest_batch(args: Any, workdir: Path) -> dict[str, Any]:
    """The template's own batch-size search on one GPU, as a user runs it."""
    run_dir = workdir / "tune"
    argv = [*SEED, *data_overrides(args), "trainer=gpu", "+tune=batch_size", f"hydra.run.dir={run_dir}"]
    run_train(argv, log=run_dir / "output.log", timeout=3600)
    found = json.loads((run_dir / "batch_size_search.json").read_text())
    return {
        "per_device": found["per_device"],
        "stopped_by": found.get("stopped_by"),
        "command": train_command(argv),
    }


def main() -> None:
    args = parse_args(__doc__, steps=(int, 30, "timed steps"), warmup=(int, 5, "untimed steps first"))
    cuda = torch.cuda.is_available()
    if args.smoke or not cuda:
        args.steps, args.warmup = 3, 1
    result = Result("gpu", args)
    workdir = scratch_dir("gpu")
    overrides = [*SEED, *data_overrides(args), "trainer=gpu" if cuda else "trainer=cpu"]
    if args.smoke or not cuda:
        overrides += TINY
    fit = timed_fit(args, overrides, workdir)
    if not cuda:
        result.save(
            f"not measured: no CUDA device (the path ran on the CPU with a tiny ViT: "
            f"{fit['images_per_s']:.0f} images/s, {fit['flops_per_image'] / 1e6:.1f} MFLOPs per image)",
            figures={"images_per_s": None, "mfu": None, "peak_memory_gb": None, "largest_batch": None},
            goal=None,
            met=None,
            notes=["Run `make bench` on a CUDA machine for these figures."],
            cpu_smoke=fit,
        )
        return
    device = torch.device("cuda")
    # the table the run's own MFU uses (callbacks/throughput.py): dense bf16 peak
    peak = peak_flops(torch.cuda.get_device_name(device), torch.bfloat16)
    mfu = fit["flops_per_image"] * fit["images_per_s"] / peak if peak else None
    biggest = {"per_device": None} if args.smoke else largest_batch(args, workdir)
    gpu = torch.cuda.get_device_name(device)
    line = (
        f"{gpu}: {fit['images_per_s']:.0f} images/s, MFU {100 * mfu:.1f} %, "
        if mfu is not None
        else f"{gpu}: {fit['images_per_s']:.0f} images/s, MFU not known (no peak FLOPs for this GPU), "
    )
    line += f"peak {fit['peak_memory_gb']:.2f} GB at batch {fit['batch_size']}, largest batch {biggest['per_device']}"
    result.save(
        line,
        figures={
            "images_per_s": round(fit["images_per_s"], 1),
            "mfu": None if mfu is None else round(mfu, 4),
            "peak_memory_gb": round(fit["peak_memory_gb"], 3),
            "largest_batch": biggest["per_device"],
        },
        goal=None,
        met=None,
        fit=fit,
        largest_batch=biggest,
        peak_flops=peak,
    )


if __name__ == "__main__":
    main()
