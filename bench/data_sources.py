"""Image folders and streaming shards at 224 px: images/s delivered by the template's loaders against
torchvision's `ImageFolder` + `DataLoader`, and the share of a `vit_small_patch16_224` step spent waiting
for data.

The images are real JPEGs: the shared CIFAR-10 (the first N training images of each class) upscaled to
224 x 224 px with bicubic resampling and re-encoded at JPEG quality 90, written as `train/<class>/` +
`val/<class>/`, then as litdata shards with `make shards`'s writer. Every side decodes each image and
applies the same training transform (timm's `create_transform` for the model's data config:
RandomResizedCrop 224, flip; no colour jitter, the template's default) in W DataLoader workers, and hands
out uint8 tensors, as timm's own fast path does (`use_prefetcher`: normalised on the device, which this
loader-only figure leaves out on both sides):
- `image_folder`: `datamodule=image_folder`'s training loader;
- `torchvision`: `torchvision.datasets.ImageFolder` with that transform in a plain `DataLoader` (PIL images,
  what timm's and torchvision's examples do);
- `torchvision_tensors`: the best hand-written loader for the same work: `ImageFolder` whose loader is
  torchvision's `decode_image` (uint8 tensors) and whose transform is v2's RandomResizedCrop (bicubic,
  antialiased) + flip on those tensors, as the template's workers run timm's transform where no op needs PIL;
- `streaming`: `datamodule=streaming`'s loader (litdata `StreamingDataLoader`) from the local shards.
Interleaved A/B rounds, medians; each segment on a new loader (4 untimed batches first), whose
workers are stopped before the next segment, so no loader's prefetching runs inside another's clock.
The data wait is the time in the loader's `next()` during a short `datamodule=image_folder` fit of
`vit_small_patch16_224` (from scratch) at 224 px, as a share of the steady-state step time. The CIFAR-10 in-memory path is bench/data_pipeline.py.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import (
    ROOT,
    Result,
    compose,
    interleave,
    median,
    parse_args,
    ratio,
    scratch_dir,
    short_run,
    time_next_calls,
)
from PIL import Image
from torch.utils.data import DataLoader

IMG = 224


def build_folder(args: Any, root: Path) -> Path:
    """`root/train|val/<class>/*.jpg`: CIFAR-10 images upscaled to 224 px and re-encoded."""
    from vitrain.data.readers.cache import unpack_archive
    from vitrain.data.readers.cifar import find_layout

    src = Path(args.data_dir)
    if src.is_file():
        src = unpack_archive(src, Path(args.cache_dir) / "cifar10" / "unpacked")
    layout = find_layout(src)
    if layout is None or layout.kind != "folders":
        raise SystemExit(f"need CIFAR-10 as JPEG class folders (the shared archive), got {args.data_dir}")
    for cls_dir in sorted(p for p in (layout.root / "train").iterdir() if p.is_dir()):
        files = sorted(cls_dir.iterdir())
        for split, chosen in (("train", files[: args.per_class]), ("val", files[args.per_class : args.per_class + args.val_per_class])):  # fmt: skip
            out = root / split / cls_dir.name
            out.mkdir(parents=True, exist_ok=True)
            for f in chosen:
                with Image.open(f) as img:
                    img.convert("RGB").resize((IMG, IMG), Image.BICUBIC).save(
                        out / f"{f.stem}.jpg", quality=90
                    )
    return root


def images_per_s(make_loader: Callable[[], DataLoader], warmup: int, count: int) -> float:
    """One segment on a loader of its own, whose workers are stopped before the next segment starts: the
    loaders keep their workers between epochs (persistent_workers), and a loader left running would decode
    the batches it had prefetched inside the next loader's clock, on the same cores."""
    loader = make_loader()
    it = iter(loader)
    for _ in range(warmup):  # worker start-up and the first prefetched batches, outside the clock
        next(it)
    n, t0 = 0, time.perf_counter()
    for _ in range(count):
        x, _ = next(it)
        n += x.shape[0]
    elapsed = time.perf_counter() - t0
    del it, loader  # the last references: the workers are shut down (joined) here
    gc.collect()
    return n / elapsed


def datamodule(name: str, data_dir: Path, args: Any, workdir: Path) -> Any:
    """`datamodule=<name>` from the configs, with the input spec of vit_small_patch16_224 (timm's config)."""
    import hydra

    cfg = compose(
        [
            f"datamodule={name}",
            f"datamodule.data_dir={data_dir}",
            f"datamodule.cache_dir={workdir / 'cache'}",
            f"datamodule.batch_size={args.batch_size}",
            f"datamodule.num_workers={args.workers}",
            # the worker-decoding path is what is measured (a small folder would otherwise be held in memory)
            *(["datamodule.in_memory=false"] if name == "image_folder" else []),
        ],
        workdir / name,
    )
    dm = hydra.utils.instantiate(cfg.datamodule)
    dm.set_input_spec(
        img_size=IMG,
        mean=(0.485, 0.456, 0.406),
        std=(0.229, 0.224, 0.225),
        interpolation="bicubic",
        crop_pct=0.9,
    )
    dm.setup("fit")
    return dm


def torchvision_loader(folder: Path, args: Any) -> DataLoader:
    from timm.data import create_transform
    from torchvision.datasets import ImageFolder

    transform = create_transform(
        IMG, is_training=True, interpolation="bicubic", mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
        color_jitter=None,  # the template's transform has none unless datamodule.color_jitter asks
        use_prefetcher=True,  # uint8 out, as the template's workers: normalised on the device
    )  # fmt: skip
    dataset = ImageFolder(str(folder / "train"), transform=transform)
    return DataLoader(
        dataset, batch_size=args.batch_size, shuffle=True, drop_last=True, num_workers=args.workers,
        persistent_workers=args.workers > 0,
    )  # fmt: skip


def decode_file(path: str) -> Any:
    """A file -> uint8 RGB tensor (torchvision's decoder; a module-level function the workers can unpickle)."""
    from torchvision.io import ImageReadMode, decode_image

    return decode_image(path, mode=ImageReadMode.RGB)


def torchvision_tensors_loader(folder: Path, args: Any) -> DataLoader:
    """The best hand-written loader for the same work: torchvision decodes each file to a uint8 tensor and its
    v2 transforms crop, resize (bicubic, antialiased) and flip it as a tensor."""
    from torchvision.datasets import ImageFolder
    from torchvision.transforms import InterpolationMode, v2

    transform = v2.Compose([
        v2.RandomResizedCrop(IMG, interpolation=InterpolationMode.BICUBIC, antialias=True),
        v2.RandomHorizontalFlip(),
    ])  # fmt: skip
    dataset = ImageFolder(str(folder / "train"), transform=transform, loader=decode_file)
    return DataLoader(
        dataset, batch_size=args.batch_size, shuffle=True, drop_last=True, num_workers=args.workers,
        persistent_workers=args.workers > 0,
    )  # fmt: skip


def data_wait(source: str, data_dir: Path, args: Any, workdir: Path) -> dict[str, Any]:
    """Share of step time in the training loader's next() during a short fit at 224 px."""
    from vitrain.tasks.build import build

    warmup, steps = (1, 2) if args.smoke else (3, args.wait_steps)
    overrides = [
        f"datamodule={source}",
        f"datamodule.data_dir={data_dir}",
        f"datamodule.cache_dir={workdir / 'cache'}",
        f"datamodule.batch_size={args.batch_size}",
        f"datamodule.num_workers={args.workers}",
        "model.net.model_name=vit_small_patch16_224",
        "model.net.pretrained=false",
        "trainer.accelerator=cpu",
        *short_run(warmup + steps + 1),
        "callbacks=none",
        "logger=none",
    ]
    if args.smoke:
        overrides += ["+model.net.depth=1", "+model.net.embed_dim=64", "+model.net.num_heads=2"]
    cfg = compose(overrides, workdir / "wait")
    objects = build(cfg)
    dm, trainer = objects.datamodule, objects.trainer
    fetch: list[float] = []
    ends: list[float] = []
    from lightning.pytorch.callbacks import LambdaCallback

    trainer.callbacks.append(LambdaCallback(on_train_batch_end=lambda *a: ends.append(time.perf_counter())))
    time_next_calls(dm, lambda t, seconds: fetch.append(seconds))
    trainer.fit(objects.model, datamodule=dm)
    # fetch[i] precedes step i; steady state: steps after the warm-up
    waited = sum(fetch[warmup + 1 : len(ends)])
    window = ends[-1] - ends[warmup]
    n = len(ends) - 1 - warmup
    return {
        "fraction": round(waited / window, 5),
        "fetch_ms_per_step": round(1000 * waited / n, 2),
        "step_ms": round(1000 * window / n, 1),
        "steps": n,
    }


def main() -> None:
    args = parse_args(
        __doc__,
        rounds=(int, 5, "A/B rounds"),
        batch_size=(int, 64, "images per batch"),
        batches=(int, 18, "timed batches per segment (warm-up + timed <= one epoch)"),
        workers=(int, 2, "DataLoader workers, every side"),
        per_class=(int, 160, "training images per class (10 classes)"),
        val_per_class=(int, 10, "validation images per class"),
        wait_steps=(int, 8, "timed training steps for the data-wait share"),
    )
    if args.smoke:
        args.rounds, args.batch_size, args.batches, args.per_class, args.val_per_class = 1, 8, 2, 4, 1
    result = Result("data_sources", args)
    workdir = scratch_dir("sources")
    folder = build_folder(args, workdir / "folder")
    from vitrain.data.shards import write_shards

    write_shards(
        folder, str(workdir / "shards"), chunk_bytes="16MB", workers=args.workers, cache_dir=workdir / "cache"
    )

    # datamodule=image_folder comes with issue 13's part A; until it is there, streaming stands in for it
    have_folder = (ROOT / "configs" / "datamodule" / "image_folder.yaml").is_file()
    ours = "image_folder" if have_folder else "streaming"
    loaders: dict[str, Callable[[], DataLoader]] = {
        "torchvision": lambda: torchvision_loader(folder, args),
        "torchvision_tensors": lambda: torchvision_tensors_loader(folder, args),
    }
    if have_folder:
        loaders["image_folder"] = datamodule("image_folder", folder, args, workdir).train_dataloader
    loaders["streaming"] = datamodule("streaming", workdir / "shards", args, workdir).train_dataloader
    warmup = 1 if args.smoke else 4
    runs = interleave(
        {k: (lambda make=make: images_per_s(make, warmup, args.batches)) for k, make in loaders.items()},
        args.rounds,
    )
    wait = data_wait(ours, folder if have_folder else workdir / "shards", args, workdir)
    rates = {k: round(median(v)) for k, v in runs.items()}
    folder_ratio = round(ratio(runs[ours], runs["torchvision"]), 2)
    tensors_ratio = round(ratio(runs[ours], runs["torchvision_tensors"]), 2)
    stream_ratio = round(ratio(runs["streaming"], runs["image_folder"]), 2) if have_folder else None
    met = folder_ratio >= 1.0 and wait["fraction"] < 0.05
    line = (
        f"{ours}/torchvision ImageFolder images/s = {folder_ratio:.2f}x ({tensors_ratio:.2f}x torchvision's "
        "tensor decode and v2 transforms)"
        + (
            f", streaming/image_folder = {stream_ratio:.2f}x"
            if have_folder
            else " (no datamodule=image_folder yet)"
        )
        + f" at {IMG} px with {args.workers} workers; data wait {100 * wait['fraction']:.1f} % "
        f"of a vit_small_patch16_224 step (goals >= 1.0x, < 5 %: {'met' if met else 'NOT met'})"
    )
    result.save(
        line,
        figures={
            f"{ours}_vs_torchvision": folder_ratio,
            f"{ours}_vs_torchvision_tensors": tensors_ratio,
            "streaming_vs_image_folder": stream_ratio,
            **{f"{k}_images_per_s": v for k, v in rates.items()},
            "data_wait_percent": round(100 * wait["fraction"], 2),
            "step_ms_vit_small_224": wait["step_ms"],
        },
        goal="image_folder >= 1.0x torchvision ImageFolder + DataLoader; data wait < 5 % of a vit_small_patch16_224 step",
        met=met,
        rounds={k: [round(v) for v in vs] for k, vs in runs.items()},
        data_wait={**wait, "datamodule": ours},
        images={
            "train": 10 * args.per_class,
            "val": 10 * args.val_per_class,
            "size": IMG,
            "jpeg_quality": 90,
        },
        batch_size=args.batch_size,
        workers=args.workers,
    )


if __name__ == "__main__":
    main()
