"""Float8 matmuls for training (`model.float8`): torchao's `Float8Linear` in place of the network's linear
layers, dynamic tensorwise scaling, the weights kept in their own dtype (checkpoints and their keys do not
change: a float8-trained checkpoint loads into a plain network).

On Hopper/Ada GPUs (compute capability >= 8.9) the float8 tensor cores run twice the bf16 rate; what it buys
a whole step depends on how much of the step is matmuls (at ViT-B/32's width about half of the GPU time,
docs/benchmarks.md section 7) and on the casts it adds, which only `torch.compile` fuses. Measured on one
H200 (section 8a-8b), the casts win: ViT-B/32 at batch 384 trains at 0.77x the images/s of bf16, in the
template and in a hand-written loop alike, so the option stays off by default. torchao is the library PyTorch
maintains for it; this module is the one place that imports it. A CPU runs the same code (torch's float8
`_scaled_mm` on the CPU) for tests, with no speed gain.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from vitrain.errors import ModelError

log = logging.getLogger(__name__)

#: float8 tensor cores: Ada (8.9) and Hopper (9.0) and later
MIN_CAPABILITY = (8, 9)


def float8_refusal(device: torch.device) -> str | None:
    """Why `model.float8=true` cannot train on `device`, or None."""
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            return (
                f"model.float8=true needs float8 tensor cores (compute capability >= 8.9: H100, L4, RTX 4090), "
                f"{name} has {capability[0]}.{capability[1]}: leave model.float8=false"
            )
    elif device.type != "cpu":
        return f"model.float8=true runs on CUDA GPUs (and on the CPU, for tests), not on {device.type}"
    return None


def convertible(module: nn.Module, head: nn.Module | None) -> bool:
    """A linear layer float8 takes: both dims multiples of 16 (the float8 matmul's tile), not the classifier
    head (a few outputs: nothing to gain, and the logits' precision is what the loss sees)."""
    return (
        isinstance(module, nn.Linear)
        and module is not head
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def convert_to_float8(net: nn.Module) -> int:
    """Swap the network's eligible linear layers for torchao's Float8Linear, in place; returns how many."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        raise ModelError("model.float8=true needs torchao: pip install torchao") from None
    head = net.get_classifier() if hasattr(net, "get_classifier") else None
    eligible = sum(convertible(m, head) for m in net.modules())
    if not eligible:
        raise ModelError(
            f"model.float8=true: {type(net).__name__} has no linear layer with both dims multiples of 16"
        )
    convert_to_float8_training(net, module_filter_fn=lambda module, fqn: convertible(module, head))
    log.info("model.float8: %d linear layers compute their matmuls in float8 (torchao)", eligible)
    return eligible
