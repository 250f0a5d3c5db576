"""The training step's loss and its epoch figures (mean loss, top-k accuracy), in a few kernels a step.

Why not torchmetrics' classes for training, as evaluation uses: `MulticlassAccuracy(top_k=1)`,
`MulticlassAccuracy(top_k=5)` and a `MeanMetric` for the loss issue 69 top-level ops per training step
(torch.profiler, batch 384: each a kernel launch on a GPU, host time the next step waits behind), where the
figures need a top-k, a compare and a few sums. Here `loss_and_figures` returns the loss, the batch's
counts ([images, top-1 hits, top-5 hits]) and its loss x images: ~10 ops eagerly, a couple of fused kernels
when compiled with the network (`ImageClassifier.configure_model`); `TrainingFigures` adds them to its two
states with two ops. Its base class is torchmetrics' `Metric`, which still does the work a
library should: the exact sum over ranks at `compute()`, `reset()`, and the states a mid-epoch resume
carries (callbacks/epoch_metrics.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import Metric


def accuracy_top_k(num_classes: int) -> tuple[int, ...]:
    """The top-k accuracies reported: top-1, and top-5 when there are at least 5 classes."""
    return (1, 5) if num_classes >= 5 else (1,)


def batch_sums(
    logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor, top_k: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch's counts [images, hits within the top k for each k] (int64: exact) and loss x images."""
    images = target.shape[0]
    hit = logits.topk(max(top_k), dim=-1).indices == target.unsqueeze(-1)  # at most one True a row
    hits = torch.stack([hit[:, :k].any(-1) for k in top_k]).sum(-1)
    counts = torch.cat([torch.full((1,), images, dtype=torch.int64, device=logits.device), hits])
    return counts, loss.to(torch.float32) * images


def loss_and_figures(
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float,
    top_k: tuple[int, ...],
    soft_target: torch.Tensor | None = None,
    soft_loss: nn.Module | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The training loss (cross-entropy with label smoothing, or `soft_loss` against mixed `soft_target`s)
    and the batch's sums for `TrainingFigures.update`; accuracy is against the original labels `target`."""
    if soft_target is not None and soft_loss is not None:
        loss = soft_loss(logits, soft_target)
    else:
        loss = F.cross_entropy(logits, target, label_smoothing=label_smoothing)
    return loss, batch_sums(logits.detach(), target, loss.detach(), top_k)


class TrainingFigures(Metric):
    """Mean training loss (`loss_epoch`) and top-k accuracy (`acc1`, `acc5`) over the batches added."""

    full_state_update = False

    def __init__(self, top_k: tuple[int, ...] = (1, 5)) -> None:
        super().__init__()
        self.top_k = tuple(top_k)
        # summed over the ranks by compute(): every image counts once, the counts exactly (int64; float32 for
        # the loss, as torchmetrics' mean keeps it; no float64, which MPS lacks)
        self.add_state(
            "counts", default=torch.zeros(1 + len(self.top_k), dtype=torch.int64), dist_reduce_fx="sum"
        )
        self.add_state("loss_sum", default=torch.zeros((), dtype=torch.float32), dist_reduce_fx="sum")

    def update(self, sums: tuple[torch.Tensor, torch.Tensor]) -> None:
        counts, loss_sum = sums
        self.counts.add_(counts)
        self.loss_sum.add_(loss_sum)

    def compute(self) -> dict[str, torch.Tensor]:
        images = self.counts[0]
        figures = {"loss_epoch": self.loss_sum / images}
        figures.update({f"acc{k}": self.counts[1 + i] / images for i, k in enumerate(self.top_k)})
        return figures
