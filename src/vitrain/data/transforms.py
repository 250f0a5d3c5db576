"""timm's per-sample transform for the datamodules whose loader workers decode each image (image folders,
streaming shards): one place that turns the model's data config and the augmentation options into timm's
`create_transform` arguments."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def timm_transform(
    train: bool,
    img_size: int,
    mean: Sequence[float],
    std: Sequence[float],
    spec: Mapping[str, Any],
    auto_augment: str | None = None,
    re_prob: float = 0.0,
    hflip: float = 0.5,
) -> Any:
    """Training: RandomResizedCrop + flip (+ an auto-augment string such as rand-m9-mstd0.5-inc1, random
    erasing); evaluation: resize + center crop with the model's crop_pct. `spec` is the model's timm data
    config (interpolation, crop_pct; absent keys keep timm's defaults)."""
    from timm.data import create_transform

    kwargs: dict[str, Any] = {"input_size": img_size, "is_training": train, "mean": mean, "std": std}
    if spec.get("interpolation"):
        kwargs["interpolation"] = spec["interpolation"]
    if train:
        # re_mode pixel (per-pixel normal noise in the erased box): timm's train.py and DeiT's default, and what
        # the in-memory path (augment.py) does; create_transform's own default is a constant fill
        kwargs.update(auto_augment=auto_augment, re_prob=re_prob, re_mode="pixel", hflip=hflip)
    elif spec.get("crop_pct"):
        kwargs["crop_pct"] = spec["crop_pct"]
    return create_transform(**kwargs)
