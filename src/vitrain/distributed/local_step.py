"""The optimizer's step on each rank's own shards under FSDP: the same arithmetic without DTensor's dispatch.

Under FSDP2 every parameter, gradient and optimizer state is a DTensor, and torch's AdamW sends each of its
fused (or foreach) ops through DTensor's dispatch: 1.96 ms a step for ViT-B's 152 parameter tensors on a
2-core EPYC, where the same fused kernel on the local shards takes 0.11 ms (docs/benchmarks.md 4b). An
elementwise optimizer (SGD, Adam, AdamW: each element of a parameter updated from the same element of its
gradient and states) computes on a shard exactly what DTensor computes there, so the step here is the
optimizer's own `step` (its arithmetic, hooks and state initialisation), run with its parameters,
gradients and states swapped for their local shards while it runs; the states it creates are wrapped back as
DTensors laid out as their parameter, which is what checkpoints save. Optimizers whose step reads across
elements (LAMB, LARS, Adafactor: norms, factored moments) and subclasses keep DTensor's step.
"""

from __future__ import annotations

import contextlib
import types
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import SGD, Adam, AdamW, Optimizer

from vitrain.compat import local_shard

#: optimizers whose update of an element reads only that element of the parameter, gradient and states
ELEMENTWISE = (SGD, Adam, AdamW)


def steps_on_local_shards(optimizer: Optimizer) -> bool:
    """Make `optimizer.step` run on the local shards of its DTensor parameters (the module's docstring); False,
    and nothing changed, for an optimizer not known to be elementwise or parameters that are not plain
    DTensors."""
    if type(optimizer) not in ELEMENTWISE or getattr(optimizer, "_vitrain_local_step", False):
        return False
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not params or not all(isinstance(p, DTensor) and type(local_shard(p)) is Tensor for p in params):
        return False  # plain tensors need nothing; a tensor subclass inside (float8 weights) keeps DTensor's
    step = optimizer.step  # bound: the class's (or an LR scheduler's wrapper of it)

    def local_step(self: Optimizer, closure: Any = None, *args: Any, **kwargs: Any) -> Any:
        loss = None
        if closure is not None:  # Lightning's closure (forward, backward, clipping) runs on the DTensors
            with torch.enable_grad():
                loss = closure()
        if not shards_alike(self):  # a gradient laid out otherwise than its parameter: DTensor's step
            step(*args, **kwargs)
            return loss
        with on_local_shards(self):
            step(*args, **kwargs)
        return loss

    optimizer.step = types.MethodType(local_step, optimizer)
    optimizer._vitrain_local_step = True
    return True


def shards_alike(optimizer: Optimizer) -> bool:
    """Every gradient is laid out as its parameter (FSDP2's reduce-scatter leaves them so): element i of a
    local shard is then element i of its gradient's local shard."""
    return all(
        p.grad is None or (isinstance(p.grad, DTensor) and p.grad.placements == p.placements)
        for group in optimizer.param_groups
        for p in group["params"]
    )


@contextlib.contextmanager
def on_local_shards(optimizer: Optimizer) -> Iterator[None]:
    """While inside: the optimizer's parameters are their local shards, with their gradients' local shards
    as `.grad`, and its states the states' local shards. On the way out the states it made (a first step)
    become DTensors of their parameter's layout, and everything is as before."""
    swapped: list[tuple[dict[str, Any], list[Tensor], list[Tensor]]] = []
    states = optimizer.state
    local_states: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
    for group in optimizer.param_groups:
        params = group["params"]
        locals_ = []
        for p in params:
            local = local_shard(p)
            local.grad = None if p.grad is None else local_shard(p.grad)
            if p in states:
                local_states[local] = {
                    k: local_shard(v) if isinstance(v, DTensor) else v for k, v in states[p].items()
                }
            locals_.append(local)
        group["params"] = locals_
        swapped.append((group, params, locals_))
    optimizer.state = local_states
    try:
        yield
    finally:
        optimizer.state = states
        for group, params, locals_ in swapped:
            group["params"] = params
            for p, local in zip(params, locals_, strict=True):
                local.grad = None
                if local not in local_states:
                    continue
                state = states[p]
                for key, value in local_states[local].items():
                    if isinstance(state.get(key), DTensor):
                        continue  # updated in place through its local shard
                    if isinstance(value, Tensor) and value.shape == local.shape and value.dim() > 0:
                        value = DTensor.from_local(
                            value,
                            p.device_mesh,
                            p.placements,
                            run_check=False,
                            shape=p.shape,
                            stride=p.stride(),
                        )
                    state[key] = value
