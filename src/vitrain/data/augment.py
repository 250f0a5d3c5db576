"""Batch-wise augmentation and normalisation on the training device: one kernel per op for the whole
batch instead of per-image Python in loader workers."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


def random_crop_flip(x: Tensor, padding: int, flip_p: float = 0.5) -> Tensor:
    """Per sample: a random HxW window of the image zero-padded by `padding`, mirrored left-right with
    probability `flip_p` (torchvision's RandomCrop(padding=p) then RandomHorizontalFlip(p), per image).

    One gather for the whole batch: the source pixel of every output pixel is computed from the sample's
    shift (and flip) without building the padded batch; pixels that fall in the padding are zeroed. About
    twice as fast on the CPU as pad + unfold-crop + where-flip (docs/benchmarks.md, data pipeline).
    """
    b, c, h, w = x.shape
    if padding <= 0 and flip_p <= 0:
        return x
    dy = torch.randint(-padding, padding + 1, (b, 1), device=x.device)
    dx = torch.randint(-padding, padding + 1, (b, 1), device=x.device)
    flip = torch.rand(b, 1, device=x.device) < flip_p
    rows = dy + torch.arange(h, device=x.device)  # [B,H] source row of each output row
    cols = dx + torch.arange(w, device=x.device)  # [B,W] source column of each output column
    cols = torch.where(flip, cols.flip(-1), cols)
    inside = ((rows >= 0) & (rows < h))[:, :, None] & ((cols >= 0) & (cols < w))[:, None, :]  # [B,H,W]
    source = rows.clamp(0, h - 1)[:, :, None] * w + cols.clamp(0, w - 1)[:, None, :]
    out = x.reshape(b, c, h * w).gather(2, source.view(b, 1, h * w).expand(b, c, h * w)).view(b, c, h, w)
    return out.masked_fill_(~inside[:, None], 0) if padding > 0 else out


def to_model_input(x: Tensor, img_size: int, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """uint8 [B,3,H,W] -> normalised float32 [B,3,img_size,img_size].

    Normalised before resizing: both are linear per channel (bilinear weights sum to 1), so the result is
    the same, and upsampling 32 px to 224 px makes the normalisation 49x cheaper at the small size.
    """
    scale, shift = _affine(tuple(mean), tuple(std), x.device)
    out = x.float().mul_(scale).add_(shift)
    if out.shape[-1] != img_size or out.shape[-2] != img_size:
        shrink = img_size < max(out.shape[-2:])  # antialias only matters (and only costs) when downsampling
        out = F.interpolate(
            out, size=(img_size, img_size), mode="bilinear", align_corners=False, antialias=shrink
        )
    return out


@functools.lru_cache(maxsize=16)
def _affine(mean: tuple[float, ...], std: tuple[float, ...], device: torch.device) -> tuple[Tensor, Tensor]:
    """(x / 255 - mean) / std as x * scale + shift; made once per device (a copy to a GPU every batch
    would wait for the GPU)."""
    std_t = torch.tensor(std, dtype=torch.float32)
    scale = 1.0 / (255.0 * std_t)
    shift = -torch.tensor(mean, dtype=torch.float32) / std_t
    return scale.view(1, -1, 1, 1).to(device), shift.view(1, -1, 1, 1).to(device)


@dataclass
class BatchTransform:
    """What the datamodule applies after a batch reaches the device; random ops draw from torch's global RNG."""

    img_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    crop_padding: int = 4
    hflip: bool = True

    def __call__(self, x: Tensor, train: bool) -> Tensor:
        if train:
            x = random_crop_flip(x, self.crop_padding, 0.5 if self.hflip else 0.0)
        return to_model_input(x, self.img_size, self.mean, self.std)
