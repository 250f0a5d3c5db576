"""timm's per-sample transform for the datamodules whose loader workers decode each image (image folders,
streaming shards): one place that turns the model's data config and the augmentation options into timm's
`create_transform` arguments."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vitrain.errors import DataError


def check_color_jitter(value: Any, decode_device: str = "cpu") -> None:
    """`datamodule.color_jitter`: null, a strength >= 0 (brightness, contrast and saturation alike), or
    [brightness, contrast, saturation(, hue)]; torchvision's ColorJitter on PIL images in the loader workers,
    which the GPU decoder has not."""
    if value is None:
        return
    values = list(value) if isinstance(value, list | tuple) else [value]
    if not (1 <= len(values) <= 4 and len(values) != 2) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in values
    ):
        raise DataError(
            f"datamodule.color_jitter={value!r}: use null, a strength >= 0 (e.g. 0.4), or [brightness, contrast, "
            "saturation] or [brightness, contrast, saturation, hue]"
        )
    if decode_device == "cuda":
        raise DataError(
            "datamodule.color_jitter runs in the loader workers, on PIL images: with datamodule.decode_device=cuda "
            "the GPU decodes and nothing applies it; set color_jitter=null or decode_device=cpu"
        )


def timm_transform(
    train: bool,
    img_size: int,
    mean: Sequence[float],
    std: Sequence[float],
    spec: Mapping[str, Any],
    auto_augment: str | None = None,
    hflip: float = 0.5,
    color_jitter: float | Sequence[float] | None = None,
) -> Any:
    """Training: RandomResizedCrop + flip (+ an auto-augment string such as rand-m9-mstd0.5-inc1,
    `color_jitter`); evaluation: resize + center crop with the model's crop_pct. `spec` is the model's timm
    data config (interpolation, crop_pct; absent keys keep timm's defaults).

    The samples leave the workers as uint8 tensors (timm's `use_prefetcher` form): the device normalises the
    batch and, in training, erases (`re_prob`: augment.py's batched erasing in timm's pixel mode, DeiT's and
    timm's train.py's), as for in-memory data (`ImageDataModule.worker_batches_transform`). A quarter of float32's bytes through the workers' shared
    memory, the pinned copy and the copy to the GPU (58 MB instead of 231 MB for a batch of 384 at 224 px),
    and ~0.2 ms less per image in a worker on a CPU (docs/benchmarks.md 2b).

    No colour jitter unless asked for: `create_transform`'s default (0.4, off with an auto-augment policy)
    would make images decoded here augment otherwise than the same data held in memory or decoded on the GPU
    (neither jitters), and it took ~0.4 of the ~1.4 ms a 224 px training image costs a worker on a CPU."""
    from timm.data import create_transform

    kwargs: dict[str, Any] = {
        "input_size": img_size,
        "is_training": train,
        "mean": mean,
        "std": std,
        "use_prefetcher": True,  # uint8 out: normalised (and erased) on the device
    }
    if spec.get("interpolation"):
        kwargs["interpolation"] = spec["interpolation"]
    if train:
        kwargs.update(
            auto_augment=auto_augment,
            hflip=hflip,
            color_jitter=tuple(color_jitter) if isinstance(color_jitter, list | tuple) else color_jitter,
        )
    elif spec.get("crop_pct"):
        kwargs["crop_pct"] = spec["crop_pct"]
    return create_transform(**kwargs)
