"""Progressive resizing: train at a lower resolution early in the run, at the full one by its end.

A convolution's or a ViT block's cost grows with the pixels or tokens: a 24 px batch of a 32 px model costs
about 0.56 of a full one, so a time-budgeted run sees more images while it learns coarse features, then
ends at the resolution it is evaluated at (fast.ai's DAWNBench ImageNet entry; FFCV's ResNet recipes ramp
160 -> 192 px). Neither Lightning nor timm has it for on-device batches: timm's loaders pick a size per
epoch in the workers (not for our in-memory data, which is augmented on the device), and a ViT needs
`dynamic_img_size=True` to resample its position embeddings to the smaller grid.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from vitrain.errors import ModelError


@dataclass(frozen=True)
class ProgressiveResize:
    """Size at training progress p in [0, 1]: `start_size` until `start`, then a linear ramp to the batch's
    own size at `end`, rounded down to a multiple of `multiple` (the model's total stride or patch size, so
    every size gives whole tokens)."""

    start_size: int
    start: float = 0.0
    end: float = 0.5
    multiple: int = 8

    def __post_init__(self) -> None:
        if self.multiple < 1 or self.start_size < self.multiple or self.start_size % self.multiple:
            raise ModelError(
                f"model.progressive_resize.start_size={self.start_size} must be a positive multiple of "
                f"model.progressive_resize.multiple={self.multiple}"
            )
        if not 0 <= self.start < self.end <= 1:
            raise ModelError(
                f"model.progressive_resize: need 0 <= start < end <= 1, got start={self.start} end={self.end}"
            )

    def size(self, progress: float, full_size: int) -> int:
        if self.start_size >= full_size:
            return full_size
        ramp = min(max((progress - self.start) / (self.end - self.start), 0.0), 1.0)
        size = self.start_size + ramp * (full_size - self.start_size)
        return full_size if ramp >= 1 else max(int(size) // self.multiple * self.multiple, self.start_size)

    def __call__(self, x: torch.Tensor, progress: float) -> torch.Tensor:
        """The batch (N, C, H, W) resized to the size for `progress` (its short side; the aspect ratio kept).
        Antialiased bilinear: a plain bilinear downsampling aliases fine textures."""
        height, width = x.shape[-2:]
        size = self.size(progress, min(height, width))
        if size == min(height, width):
            return x
        scale, step = size / min(height, width), self.multiple
        new = [max(round(side * scale / step) * step, step) for side in (height, width)]
        if x.dtype in (torch.bfloat16, torch.float16):
            # a 16-bit batch (bf16-true): the CPU has no antialiased kernel for it
            resized = F.interpolate(x.float(), size=new, mode="bilinear", antialias=True, align_corners=False)
            return resized.to(x.dtype)
        return F.interpolate(x, size=new, mode="bilinear", antialias=True, align_corners=False)


def make_resize(options: Mapping[str, Any] | None) -> ProgressiveResize | None:
    """`model.progressive_resize` as configured; None when its `start_size` is null (off)."""
    options = dict(options or {})
    if options.get("start_size") is None:
        return None
    try:
        return ProgressiveResize(**options)
    except TypeError as err:
        raise ModelError(f"model.progressive_resize: {err}") from err
