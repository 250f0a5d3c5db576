"""EMA of the weights: Lightning's `EMAWeightAveraging`, kept on the training device, refused under FSDP.

What Lightning's callback does (lightning/pytorch/callbacks/weight_averaging.py, 2.6): after every optimizer
step it updates an `AveragedModel` copy (parameters and buffers, e.g. BatchNorm statistics); validation
runs on the EMA weights (swapped in and out around each validation epoch); every checkpoint's
`state_dict` holds the EMA weights (the raw ones under `current_model_state`, the averaging count under
`averaging_state`), so the best checkpoint, `test` after fit and `eval.py` all use the EMA model; a resumed
run restores both and continues exactly. At the end of fit the EMA weights are copied into the model.
"""

import warnings
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import EMAWeightAveraging
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn

from vitrain.errors import UserError


class EMA(EMAWeightAveraging):
    """`decay` per optimizer step: the EMA averages over roughly the last 1 / (1 - decay) steps."""

    def __init__(self, decay: float = 0.999, update_every_n_steps: int = 1, **kwargs: Any) -> None:
        if not 0.0 < decay < 1.0:
            raise UserError(f"callbacks.ema.decay={decay} must be between 0 and 1 (e.g. 0.999)")
        super().__init__(decay=decay, update_every_n_steps=update_every_n_steps, **kwargs)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if isinstance(trainer.strategy, ModelParallelStrategy):
            # the AveragedModel is a full, unsharded deep copy, and the checkpoint hooks swap whole
            # state dicts: neither fits FSDP2's sharded DTensor parameters and per-rank checkpoint files
            raise UserError(
                "callbacks.ema does not work with trainer=fsdp (EMA of sharded weights is not supported): "
                "use trainer=ddp, or drop ema from callbacks"
            )
        if stage == "fit" and self._device is None:
            # Lightning's default is the module's device at setup, still the CPU before the strategy
            # moves the model: the EMA copy would then live on the CPU and each update copy the weights
            self._device = trainer.strategy.root_device
        with warnings.catch_warnings():
            # Lightning warns that it calls configure_model and cannot shard: ours shards only under FSDP,
            # refused above
            warnings.filterwarnings(
                "ignore", message=".*WeightAveraging callback with a model that overrides"
            )
            super().setup(trainer, pl_module, stage)

    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Only a resumed fit restores the raw weights and the average. `test(ckpt_path=best)` after fit
        # keeps the EMA weights the checkpoint's state_dict holds (Lightning's hook would load the raw
        # `current_model_state` into the model whenever an average exists, i.e. after any fit).
        if trainer.state.fn == TrainerFn.FITTING:
            super().on_load_checkpoint(trainer, pl_module, checkpoint)
