"""A fit whose epochs hold no training batch stops in one line instead of "completing".

With `drop_last` (the default: equal batches on every rank), a global batch larger than the training images
a process gets leaves every epoch empty. Lightning then runs no step, saves no checkpoint and ends fit as if
done: the run tests its initial weights and its report says "completed" (seen with `experiment=cifar`'s
batch of 384 on a folder of 180 photos). `vitrain.tasks.build.build_trainer` adds this check to every trainer
it builds; the batch-size search's own trainer, whose trials pass the data's size on purpose, has none.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import Callback

from vitrain.errors import DataError


class EmptyEpochCheck(Callback):
    """Raise a DataError when fit ends having found no training batch in an epoch. Lightning's fit loop
    returns at once then, before any training hook (`on_train_start` never runs): this is its first hook
    after the loaders are counted, and nothing has run or been saved."""

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.num_training_batches != 0 or trainer.limit_train_batches == 0:  # 0: asked for
            return
        raise DataError(empty_epoch_message(trainer.datamodule, trainer.world_size))


def empty_epoch_message(datamodule: object, world_size: int) -> str:
    """What leaves the epoch empty and how to fix it, with the datamodule's figures where it has them."""
    hparams = getattr(datamodule, "hparams", {})
    train_set = getattr(datamodule, "train_set", None)
    if train_set is None or "batch_size" not in hparams:
        return "an epoch has no training batch: lower datamodule.batch_size or give more training images"
    images, batch = len(train_set), int(hparams["batch_size"])
    share = images // world_size
    where = f" ({share} per process of {world_size})" if world_size > 1 else ""
    dropped = (
        ", and datamodule.drop_last=true drops the incomplete batch" if hparams.get("drop_last", True) else ""
    )
    return (
        f"datamodule.batch_size={batch} is more than the {images} training images{where}: an epoch holds no "
        f"whole batch{dropped}, so nothing would train; lower datamodule.batch_size (to {share * world_size} "
        "or less) or give more training images"
    )
