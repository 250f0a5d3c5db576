"""EMA of the weights: Lightning's `EMAWeightAveraging` on one device and under DDP; sharded under FSDP.

What Lightning's callback does (lightning/pytorch/callbacks/weight_averaging.py, 2.6): after every optimizer
step it updates an `AveragedModel` copy (parameters and buffers, e.g. BatchNorm statistics); validation
runs on the EMA weights (swapped in and out around each validation epoch); every checkpoint's
`state_dict` holds the EMA weights (the raw ones under `current_model_state`, the averaging count under
`averaging_state`), so the best checkpoint, `test` after fit and `eval.py` all use the EMA model; a resumed
run restores both and continues exactly. At the end of fit the EMA weights are copied into the model.

Under FSDP (`trainer=fsdp`) that `AveragedModel` would be a full, unsharded deep copy and its state-dict
swaps would not fit the per-rank checkpoint shards, so `ShardedEMA` keeps the same contract on the shards:
each rank averages its own local shard of every parameter (and its buffers) after each optimizer step, with
no communication. The checkpoint layout is the same as Lightning's: `state_dict` (the EMA weights) and
`current_model_state` (the raw ones) are both sharded entries of the distributed-checkpoint folder
(`FSDP2Strategy.save_checkpoint`), so the consolidated checkpoint that eval.py reads has the EMA weights
under `state_dict`, and a resumed fit gets both back (`FSDP2Strategy.load_checkpoint`).

The update itself is ours on every strategy (`ema_step`, one fused lerp): `AveragedModel.update_parameters`
reads its update count, a tensor on the model's device, twice per step, and on a GPU each read waits for
every queued kernel. Integer buffers (BatchNorm's batch count) are copied, not averaged.
"""

import itertools
import warnings
from collections.abc import Iterable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.checkpoint.state_dict import set_model_state_dict
from torch.distributed.tensor import DTensor

from vitrain.compat import (
    averaged_model,
    averaging_device,
    averaging_uses_buffers,
    foreach_lerp_,
    latest_averaging_update,
    set_averaging_device,
    set_latest_averaging_update,
)
from vitrain.errors import UserError


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part: the local shard of a DTensor parameter, a (replicated) buffer itself. Read each
    time, never cached: FSDP2 may re-point a parameter's shard at new storage when it initialises.
    Detached: the same storage, which may be written in place (autograd forbids that on `to_local`'s view)."""
    tensor = tensor.detach()
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def averaged_dtype(tensor: torch.Tensor) -> torch.dtype:
    """float32 for 16-bit floats (a `bf16-true` or `16-true` model): an update moves the average by
    (1 - decay) of its distance to the weights, 1e-3 of it at the default decay, far below the 2^-8 steps
    between bf16 numbers near it (2^-11 in fp16): the average kept in bf16 would not move at all."""
    return torch.float32 if tensor.dtype in (torch.bfloat16, torch.float16) else tensor.dtype


@torch.no_grad()
def ema_step(average: list[torch.Tensor], current: list[torch.Tensor], decay: float, first: bool) -> None:
    """`average = decay * average + (1 - decay) * current` for floating tensors (one fused kernel), a copy
    for integer ones (BatchNorm's batch count); the first update copies all, as AveragedModel does."""
    floats = [a.is_floating_point() and not first for a in average]
    lerped = [(a, c) for a, c, f in zip(average, current, floats, strict=True) if f]
    if lerped:  # a 16-bit model's weights are averaged in float32 (`averaged_dtype`)
        foreach_lerp_([a for a, _ in lerped], [c.to(a.dtype) for a, c in lerped], 1.0 - decay)
    for a, c, f in zip(average, current, floats, strict=True):
        if not f:
            a.copy_(c)


class Swap:
    """Exchanges an average's values with the model's in place; called twice, restores both.

    Exchanged back, a 16-bit model's float32 average (`averaged_dtype`) would come back rounded to the
    model's dtype: at every validation the EMA would lose what bf16 cannot hold and, validated every few
    steps, stay put as an average kept in bf16 does. Lightning's swap does that; this one keeps the exact
    values of such an average aside while the model holds them."""

    def __init__(self) -> None:
        self.kept: list[torch.Tensor | None] | None = None  # set while the model holds the average

    def __call__(self, average: Iterable[torch.Tensor], current: Iterable[torch.Tensor]) -> None:
        # outside inference mode (validation's): the copies must stay ordinary tensors training updates;
        # then no_grad, as leaving inference mode turns grad mode on
        with torch.inference_mode(False), torch.no_grad():
            pairs = list(zip(average, current, strict=True))
            restoring = self.kept is not None
            kept = self.kept or [a.clone() if a.dtype != c.dtype else None for a, c in pairs]
            for (a, c), exact in zip(pairs, kept, strict=True):
                held = c.clone()
                c.copy_(a)
                a.copy_(exact if restoring and exact is not None else held)
            self.kept = None if restoring else kept


class ShardedEMA:
    """The EMA of one rank's shards: a copy of each local parameter shard (and buffer), lerped in place.

    The tracked tensors are the sharded parameters the optimizer steps (taken before the first forward,
    while FSDP2 has them registered on the modules; during evaluation the modules hold gathered copies).
    """

    def __init__(self, module: torch.nn.Module, use_buffers: bool) -> None:
        self.params = list(module.parameters())
        self.buffers = list(module.buffers()) if use_buffers else []
        with torch.no_grad():
            self.average = [
                _local(t).detach().to(averaged_dtype(t), copy=True) for t in self.params + self.buffers
            ]
        self.n_averaged = 0
        self._swap = Swap()

    @torch.no_grad()
    def update(self, decay: float) -> None:
        ema_step(self.average, [_local(t) for t in self.params + self.buffers], decay, self.n_averaged == 0)
        self.n_averaged += 1

    def swap(self) -> None:
        """Exchange the averaged and the current values in place (twice restores both)."""
        self._swap(self.average, [_local(t) for t in self.params + self.buffers])

    @torch.no_grad()
    def copy_to_model(self) -> None:
        for average, tensor in zip(self.average, self.params + self.buffers, strict=True):
            _local(tensor).copy_(average)

    @torch.no_grad()
    def copy_from_model(self) -> None:
        for average, tensor in zip(self.average, self.params + self.buffers, strict=True):
            average.copy_(_local(tensor))


class AveragePairs:
    """An `AveragedModel`'s tensors and the model's they follow, listed once for all its updates: listing,
    detaching and sorting ViT-B's 152 of them at every step was 1.5 ms of the training thread's time a step
    on a 2-core Xeon, 0.13 ms now (docs/benchmarks.md section 1): host time a GPU step waits for where the
    host is the limit.
    The lists stay right through a fit: Lightning swaps and loads the values of both models in place, and
    updates run under no_grad, where parameters take in-place ops without being detached."""

    def __init__(self, average: Any, module: torch.nn.Module, use_buffers: bool) -> None:
        self.average, self.module = average, module
        tracked = list(average.module.parameters()) + (list(average.module.buffers()) if use_buffers else [])
        current = list(module.parameters()) + (list(module.buffers()) if use_buffers else [])
        self.tracked, self.current = tracked, current
        # the average on another device (`callbacks.ema.device=cpu`), or in float32 for a 16-bit model (made
        # before the precision plugin converted the model: `averaged_dtype`): the weights are copied to it
        self.moved = any(
            t.device != c.device or t.dtype != c.dtype for t, c in zip(tracked, current, strict=True)
        )
        floats = [t.is_floating_point() for t in tracked]
        self.lerp = (
            [t for t, f in zip(tracked, floats, strict=True) if f],
            [c for c, f in zip(current, floats, strict=True) if f],
        )
        self.copied = [(t, c) for t, c, f in zip(tracked, current, floats, strict=True) if not f]
        # as AveragedModel without use_buffers: the average's buffers follow the model's
        self.followed = (
            [] if use_buffers else list(zip(average.module.buffers(), module.buffers(), strict=True))
        )

    @torch.no_grad()
    def step(self, decay: float, first: bool) -> None:
        if self.moved or first:
            current = [c.to(t.device, t.dtype) for t, c in zip(self.tracked, self.current, strict=True)]
            ema_step(self.tracked, current, decay, first)
        else:  # what ema_step does, its lists made once
            if self.lerp[0]:
                foreach_lerp_(*self.lerp, 1.0 - decay)
            for t, c in self.copied:
                t.copy_(c)
        for kept, buffer in self.followed:
            kept.copy_(buffer)


class EMA(EMAWeightAveraging):
    """`decay` per optimizer step: the EMA averages over roughly the last 1 / (1 - decay) steps.

    One callback for every strategy: Lightning's `AveragedModel` path, or `ShardedEMA` under FSDP
    (chosen in `setup` from the trainer's strategy). Under FSDP the average lives next to the shards
    (`device` is ignored).
    """

    def __init__(self, decay: float = 0.999, update_every_n_steps: int = 1, **kwargs: Any) -> None:
        if not 0.0 < decay < 1.0:
            raise UserError(f"callbacks.ema.decay={decay} must be between 0 and 1 (e.g. 0.999)")
        super().__init__(decay=decay, update_every_n_steps=update_every_n_steps, **kwargs)
        self.decay = decay
        self._fsdp = False
        self._sharded: ShardedEMA | None = None
        self._count = 0  # updates of the AveragedModel so far, kept on the host (see `_update_average`)
        self._pairs: AveragePairs | None = None
        self._swap = Swap()

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if isinstance(trainer.strategy, ModelParallelStrategy):
            if not getattr(trainer.strategy, "save_distributed", False):
                # a gathered one-file checkpoint would need the EMA gathered too, and its resume would load
                # the raw weights from full tensors: not implemented
                raise UserError(
                    "callbacks.ema with trainer=fsdp needs trainer.strategy.save_distributed_checkpoint=true "
                    "(the EMA is kept and saved as per-rank shards)"
                )
            self._fsdp = True  # the average is made from the shards in on_fit_start
            return
        if stage == "fit" and averaging_device(self) is None:
            # Lightning's default is the module's device at setup, still the CPU before the strategy
            # moves the model: the EMA copy would then live on the CPU and each update copy the weights
            set_averaging_device(self, trainer.strategy.root_device)
        with warnings.catch_warnings():
            # Lightning warns that it calls configure_model and cannot shard: ours shards only under FSDP,
            # which takes the branch above
            warnings.filterwarnings(
                "ignore", message=".*WeightAveraging callback with a model that overrides"
            )
            super().setup(trainer, pl_module, stage)
        if stage == "fit":
            self._count = 0  # a new AveragedModel

    # --- FSDP: the hooks of Lightning's WeightAveraging, on the shards ----------------------------------

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # after the strategy has sharded the model and before a checkpoint is restored
        if self._fsdp:
            self._sharded = ShardedEMA(pl_module, averaging_uses_buffers(self))

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # the same rule as Lightning's: once per optimizer step (gradient accumulation), if should_update
        if trainer.global_step > latest_averaging_update(self)[0] and self.should_update(
            step_idx=trainer.global_step - 1
        ):
            self._update(pl_module)
            set_latest_averaging_update(self, step=trainer.global_step)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        epoch = trainer.current_epoch
        if epoch > latest_averaging_update(self)[1] and self.should_update(epoch_idx=epoch):
            self._update(pl_module)
            set_latest_averaging_update(self, epoch=epoch)

    def _update(self, pl_module: L.LightningModule) -> None:
        if self._sharded is not None:
            self._sharded.update(self.decay)
        else:
            self._update_average(pl_module)

    @torch.no_grad()
    def _update_average(self, pl_module: L.LightningModule) -> None:
        """`AveragedModel.update_parameters` for an EMA, without its reads of `n_averaged`: that count is a
        tensor on the model's device, and `bool(n_averaged == 0)`, `if n_averaged > 0` and its copy for the
        average function each wait for the GPU, at every step. The count is kept here on the host; the
        AveragedModel's own (what checkpoints save) is advanced on the device, never read."""
        average = averaged_model(self)
        assert average is not None
        pairs = self._pairs
        if pairs is None or pairs.average is not average or pairs.module is not pl_module:
            self._pairs = pairs = AveragePairs(average, pl_module, averaging_uses_buffers(self))
        pairs.step(self.decay, first=self._count == 0)
        average.n_averaged.add_(1)
        self._count += 1

    # Lightning's swap points, with a swap that keeps a float32 average of a 16-bit model exact (`Swap`)
    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._swap_averaged_model(pl_module)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._swap_averaged_model(pl_module)

    def _swap_averaged_model(self, pl_module: L.LightningModule) -> None:
        average = averaged_model(self)
        if average is not None:  # None under FSDP (`ShardedEMA` swaps in on_validation_start)
            self._swap(
                itertools.chain(average.module.parameters(), average.module.buffers()),
                itertools.chain(pl_module.parameters(), pl_module.buffers()),
            )

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._sharded is None:
            return super().on_train_end(trainer, pl_module)
        self._sharded.copy_to_model()
        return None

    # FSDP2Strategy gathers the weights once in its on_validation_start, which runs after the callbacks'
    # on_validation_start and before on_validation_epoch_start (Lightning's swap point): the EMA shards
    # must be in place before that gather.
    # (during fit only: after it, the model holds the EMA weights or a checkpoint's)
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._sharded is not None and trainer.state.fn == TrainerFn.FITTING:
            self._sharded.swap()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._sharded is not None and trainer.state.fn == TrainerFn.FITTING:
            self._sharded.swap()

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if not self._fsdp:
            return super().on_save_checkpoint(trainer, pl_module, checkpoint)
        if self._sharded is None:
            return None  # outside fit: the model's weights (the EMA after fit) are what is saved
        # the strategy's state dict of the EMA weights: the same keys and shards as the raw one; cloned,
        # as the state dict may share storage with the parameters swapped back below
        self._sharded.swap()
        try:
            average = {
                k: v.detach().clone() for k, v in trainer.strategy.lightning_module_state_dict().items()
            }
        finally:
            self._sharded.swap()
        checkpoint["current_model_state"] = checkpoint["state_dict"]
        checkpoint["state_dict"] = average
        checkpoint["averaging_state"] = {"n_averaged": torch.tensor(self._sharded.n_averaged)}
        return None

    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Only a resumed fit restores the raw weights and the average. `test(ckpt_path=best)` after fit
        # keeps the EMA weights the checkpoint's state_dict holds (Lightning's hook would load the raw
        # `current_model_state` into the model whenever an average exists, i.e. after any fit).
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if self._sharded is None:
            super().on_load_checkpoint(trainer, pl_module, checkpoint)
            state = checkpoint.get("averaging_state") if "current_model_state" in checkpoint else None
            # the restored count, read from the checkpoint as loaded (on the CPU), not from the device
            self._count = int(state["n_averaged"]) if state else 0
            return
        # FSDP2Strategy.load_checkpoint has loaded `state_dict` (the EMA weights) into the model and
        # returned the raw weights as sharded tensors under `current_model_state`
        self._sharded.copy_from_model()
        if "current_model_state" in checkpoint:
            set_model_state_dict(pl_module, checkpoint["current_model_state"])
            self._sharded.n_averaged = int(checkpoint["averaging_state"]["n_averaged"])
        # else: not an EMA checkpoint; both start from its weights, as in Lightning's callback
