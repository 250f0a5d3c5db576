"""The ordered step that turns a plain network into the one a strategy trains (torchtitan's parallelize_*).

Order matters and lives here only: (1) activation checkpointing wraps each unit, (2) `torch.compile`
compiles what FSDP will hook as a unit (FSDP2's hooks sit between its units, so a whole-model compile would
break its graph at every one; each unit compiled before `fully_shard` is what torchtitan does): each block
(alike, so one graph serves them all), or their container where all blocks are one FSDP group sharded as
it (`auto_scope`), (3) `fully_shard` shards each unit or group, then the root. Without a sharding strategy
(one device, DDP) only (1) and (2) apply, and compile takes the whole network, unless progressive resizing
changes the input size: a ViT's patch and position embeddings specialise the whole-network graph to each size
(one compile per size), while the blocks see only the token count, which the second size makes dynamic (two
compiles in all): their container is compiled as one graph then, or each block where there is none
(`auto_scope`).
`compile_scope=blocks` compiles the units on one device too: a third of the whole network's compile time for
ViT-B/32 on a CPU, at the same step time there (docs/benchmarks.md, "Levers"); on an H100 a quarter of it, at
1.04x the GPU time per step (the block boundaries keep fusions apart) and 12 compiled calls a step instead of
one. `compile_scope=stack` compiles the container of the blocks (a ViT's `blocks`, an `nn.Sequential`) as one
graph: the fusions across blocks and one call a step, and still resizable (the stack sees only the token
count: two compiles in all), for a compile time near the whole network's.

`parallelize(net, strategy, ...)` reads what to do from the strategy (an FSDP2Strategy carries its mesh
and options), so the model imports no strategy: `ImageClassifier.configure_model` hands its network here
with the trainer's strategy. Which submodules are the units is `fsdp.transformer_blocks` (one function,
replaceable per model family).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from torch import nn

from vitrain.compat import checkpoint_wrapper
from vitrain.distributed.drop_path import uniform_drop_paths
from vitrain.distributed.fsdp import apply_fsdp, group_units, is_sharded, sequential_of, transformer_blocks

log = logging.getLogger(__name__)


def parallelize(
    net: nn.Module,
    strategy: Any = None,
    compile: bool = False,
    activation_checkpointing: bool = False,
    resizes: bool = False,
    compile_scope: str = "auto",
    compile_mode: str | None = None,
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
        if compile_scope == "auto" or (compile_scope == "stack" and mesh is not None):
            chosen = auto_scope(
                net, units, mesh is not None, resizes, options.get("unit_params", 0), activation_checkpointing
            )
            if compile_scope == "stack" and chosen != "stack":
                log.warning(
                    "compile_scope=stack with trainer=fsdp: the blocks are not one FSDP group sharded as their "
                    "container (trainer.strategy.unit_params, activation checkpointing), so FSDP's hooks would "
                    "sit inside the graph: compiled one by one"
                )
            compile_scope = chosen
        units = apply_compile(net, units, scope=compile_scope, mode=compile_mode)
    if mesh is not None:
        apply_fsdp(net, mesh, units, **options)
    net._vitrain_parallelized = True
    return net


def auto_scope(
    net: nn.Module,
    units: list[nn.Module],
    sharded: bool,
    resizes: bool,
    unit_params: int,
    activation_checkpointing: bool,
) -> str:
    """`compile_scope=auto`: the network on one device or DDP; else the blocks' container as one graph where
    there is one (`stack`), else each block.

    Why: progressive resizing would recompile the whole network at every size (its patch and position
    embeddings specialise), where the blocks see only the token count (two compiles in all); under FSDP its
    hooks must stay outside every graph, so what is compiled is what FSDP hooks as one group, the container
    where all blocks are one group sharded as it (`group_module`: a ViT's `blocks` under the default
    `unit_params`). One graph instead of one per block saves the compiled calls' host work (guards,
    wrappers: 12 calls forward and 12 backward for ViT-B) at about the whole network's compile time: on a CPU,
    on a 12-block ViT whose step is host work, 5.7 ms of a 27.7 ms step under FSDP and 6.4 ms of a 23.2 ms
    step after a resizing ramp, whose two compiles took 3.1x as long (docs/benchmarks.md 4b and "Levers").
    Activation checkpointing keeps the blocks one by one: each checkpointed block is its own compiled call."""
    if not sharded and not resizes:
        return "network"
    if activation_checkpointing:
        return "blocks"
    if sharded:
        groups = group_units(units, unit_params)
        return "stack" if len(groups) == 1 and sequential_of(net, groups[0]) is not None else "blocks"
    return "stack" if unit_stack(net, units) is not None else "blocks"


def apply_activation_checkpointing(root: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """Recompute each unit's activations in backward instead of storing them; returns the wrapped units.

    State-dict keys stay those of the plain model (the wrapper's `_checkpoint_wrapped_module` prefix is
    removed by torch's state-dict hooks)."""
    if not units:
        log.warning("activation checkpointing: no blocks found in %s, nothing wrapped", type(root).__name__)
    return [_replace(root, unit, checkpoint_wrapper(unit)) for unit in units]


def apply_compile(
    root: nn.Module, units: list[nn.Module], scope: str = "network", mode: str | None = None
) -> list[nn.Module]:
    """`nn.Module.compile` in place (state-dict keys and checkpoints stay those of the plain model), by
    `scope`: `network`, the whole network (one graph); `blocks`, each unit (the rest stays eager); `stack`,
    the one container that holds the units (`unit_stack`), one graph for all of them; each unit when there is
    no such container.

    One by one, only units with a twin are compiled (`twin_units`): alike units share one graph, a unit of
    its own shape would compile one more. Those units get a stochastic depth whose rate is a tensor
    (`uniform_drop_paths`): with timm's per-block float rates each block would compile a graph of its own.
    `mode`: torch.compile's (`model.compile_mode`; reduce-overhead replays each graph as a CUDA graph)."""
    options = {"mode": mode} if mode else {}
    if scope == "stack":
        stack = unit_stack(root, units)
        if stack is not None:
            if type(stack) is nn.Sequential:
                stack.__class__ = BlockStack
            stack.compile(**options)
            return units
        log.warning(
            "compile_scope=stack: %s's blocks are not called through one container, compiled one by one",
            type(root).__name__,
        )
        scope = "blocks"
    if scope == "blocks" and units:
        twins = twin_units(units)
        if not twins:
            log.warning("compile per block: %s has no repeated blocks, nothing compiled", type(root).__name__)
        uniform_drop_paths(twins)
        for unit in twins:
            unit.compile(**options)
    else:
        root.compile(**options)
    return units


class BlockStack(nn.Sequential):
    """An `nn.Sequential` whose forward is defined outside torch.nn, what `compile_scope=stack` compiles. Dynamo
    up to torch 2.11 does not trace a frame of torch.nn's own files that it is handed first (it traces them
    only inlined into another): `nn.Sequential.compile()` compiled each block as a frame of its own there, a
    graph per stochastic-depth rate, eager past the recompile limit (torch 2.14 traces the container). Same
    children, same state-dict keys."""

    def forward(self, x: Any) -> Any:
        for module in self:
            x = module(x)
        return x


def unit_stack(root: nn.Module, units: list[nn.Module]) -> nn.Module | None:
    """The `nn.Sequential` whose children are exactly the twin units, in order (a ViT's `blocks`), or None
    (units spread over stages, a `ModuleList` or an `nn.Sequential` looped over in the model's own forward,
    other children beside them, or timm's grad checkpointing on, whose `checkpoint_seq` calls each child,
    never the container):
    what `compile_scope=stack` compiles as one graph."""
    return sequential_of(root, twin_units(units))


def twin_units(units: list[nn.Module]) -> list[nn.Module]:
    """The units that have a twin: another unit of the same class with parameters of the same names and
    shapes. A hybrid ViT's convolutional stem is a list of conv layers of growing width, which `shard_units`
    takes as units too (for sharding, right); compiled one by one each would be a graph of its own on one
    code object, and past Dynamo's recompile limit (8) the rest ran eagerly behind every graph's guards:
    `experiment=cifar_cpu`'s network compiled block by block stepped at 0.56x its eager speed that way."""

    def signature(unit: nn.Module) -> tuple:
        return type(unit), tuple((name, tuple(p.shape), p.dtype) for name, p in unit.named_parameters())

    counts = Counter(signature(unit) for unit in units)
    return [unit for unit in units if counts[signature(unit)] >= 2]


def _replace(root: nn.Module, old: nn.Module, new: nn.Module) -> nn.Module:
    for parent in root.modules():
        for name, child in parent.named_children():
            if child is old:
                setattr(parent, name, new)
                return new
    raise ValueError("unit is not a submodule of the model")
