"""Stochastic depth that compiles to one graph for all blocks.

timm's `DropPath` keeps its drop probability as a Python float, and the rates grow with depth (ViT-B at
`drop_path_rate=0.1`: 0, 0.009, ..., 0.1; the first block holds an `nn.Identity`). `torch.compile` guards a
graph on a module's float attributes and types, so compiling each block (FSDP, progressive resizing) made one
graph per block: 8 of them, then Dynamo's recompile limit, after which the last blocks ran eagerly and every
block call walked 8 guard sets. Here the probability is a tensor (a non-persistent buffer: checkpoints do not
change), so every block traces to the same graph.
"""

from __future__ import annotations

import torch
from timm.layers import DropPath as TimmDropPath
from torch import Tensor, nn


class DropPath(nn.Module):
    """timm's DropPath (per-sample keep mask, scaled by 1/keep), its probabilities held in buffers."""

    keep_prob: Tensor
    scale: Tensor

    def __init__(self, drop_prob: float = 0.0, scale_by_keep: bool = True) -> None:
        super().__init__()
        self.drop_prob = float(drop_prob)  # for repr only: forward reads the buffers
        keep = 1.0 - self.drop_prob
        self.register_buffer("keep_prob", torch.tensor(keep), persistent=False)
        self.register_buffer(
            "scale", torch.tensor(1.0 / keep if keep > 0 and scale_by_keep else 1.0), persistent=False
        )

    def forward(self, x: Tensor) -> Tensor:
        if not self.training:
            return x
        shape = (x.shape[0],) + (1,) * (x.ndim - 1)
        # drawn in fp32 whatever x's dtype: a bf16 uniform would round the probability
        keep = torch.rand(shape, device=x.device) < self.keep_prob
        return x * (keep.to(x.dtype) * self.scale)

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob:.3f}"


def uniform_drop_paths(units: list[nn.Module]) -> int:
    """Replace timm's DropPath in `units` (and an `nn.Identity` where another unit has a DropPath at the same
    place: timm's rate-0 blocks) by `DropPath`; returns how many modules were replaced."""
    places = {name for unit in units for name, m in unit.named_modules() if isinstance(m, TimmDropPath)}
    replaced = 0
    for unit in units:
        modules = dict(unit.named_modules())
        for name in sorted(places):
            old = modules.get(name)
            if isinstance(old, TimmDropPath):
                new = DropPath(old.drop_prob, old.scale_by_keep)
            elif isinstance(old, nn.Identity):
                new = DropPath(0.0)
            else:
                continue
            parent, _, attr = name.rpartition(".")
            setattr(unit.get_submodule(parent) if parent else unit, attr, new)
            replaced += 1
    return replaced
