"""The ordered step that turns a plain network into the one a strategy trains (torchtitan's parallelize_*).

Order matters and lives here only: (1) activation checkpointing wraps each unit, (2) `torch.compile`
compiles each unit (FSDP2's hooks sit between units, so a whole-model compile would break its graph at
every block; each unit compiled before `fully_shard` is what torchtitan does; the units are alike, so one
graph serves them all), (3) `fully_shard` shards each
unit, then the root. Without a sharding strategy (one device, DDP) only (1) and (2) apply, and compile
takes the whole network, unless progressive resizing changes the input size: a ViT's patch and position
embeddings specialise the whole-network graph to each size (one compile per size), while a block sees only
the token count, which the second size makes dynamic (two compiles in all).

`parallelize(net, strategy, ...)` reads what to do from the strategy (an FSDP2Strategy carries its mesh
and options), so the model imports no strategy: `ImageClassifier.configure_model` hands its network here
with the trainer's strategy. Which submodules are the units is `fsdp.transformer_blocks` (one function,
replaceable per model family).
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from vitrain.compat import checkpoint_wrapper
from vitrain.distributed.drop_path import uniform_drop_paths
from vitrain.distributed.fsdp import apply_fsdp, is_sharded, transformer_blocks

log = logging.getLogger(__name__)


def parallelize(
    net: nn.Module,
    strategy: Any = None,
    compile: bool = False,
    activation_checkpointing: bool = False,
    resizes: bool = False,
) -> nn.Module:
    """Apply activation checkpointing, compile and (for an FSDP2 strategy) sharding to `net`, in place.

    Idempotent: Lightning calls `configure_model` again when the same trainer tests after fitting.
    """
    if getattr(net, "_vitrain_parallelized", False) or is_sharded(net):
        return net
    fsdp = getattr(strategy, "fsdp_options", None)
    mesh = strategy.fsdp_mesh() if fsdp is not None else None
    options = dict(fsdp or {})
    activation_checkpointing = bool(
        options.pop("activation_checkpointing", False) or activation_checkpointing
    )
    units = transformer_blocks(net)
    if activation_checkpointing:
        units = apply_activation_checkpointing(net, units)
    if compile:
        units = apply_compile(net, units, per_unit=mesh is not None or resizes)
    if mesh is not None:
        apply_fsdp(net, mesh, units, **options)
    net._vitrain_parallelized = True
    return net


def apply_activation_checkpointing(root: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """Recompute each unit's activations in backward instead of storing them; returns the wrapped units.

    State-dict keys stay those of the plain model (the wrapper's `_checkpoint_wrapped_module` prefix is
    removed by torch's state-dict hooks)."""
    if not units:
        log.warning("activation checkpointing: no blocks found in %s, nothing wrapped", type(root).__name__)
    return [_replace(root, unit, checkpoint_wrapper(unit)) for unit in units]


def apply_compile(root: nn.Module, units: list[nn.Module], per_unit: bool) -> list[nn.Module]:
    """`nn.Module.compile` in place (state-dict keys and checkpoints stay those of the plain model): each
    unit when the model will be sharded or resized, otherwise the whole network (one graph, the fastest).
    Units compiled one by one get a stochastic depth whose rate is a tensor (`uniform_drop_paths`): with
    timm's per-block float rates each block would compile a graph of its own."""
    if per_unit and units:
        uniform_drop_paths(units)
        for unit in units:
            unit.compile()
    else:
        root.compile()
    return units


def _replace(root: nn.Module, old: nn.Module, new: nn.Module) -> nn.Module:
    for parent in root.modules():
        for name, child in parent.named_children():
            if child is old:
                setattr(parent, name, new)
                return new
    raise ValueError("unit is not a submodule of the model")
