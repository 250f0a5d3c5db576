"""The training step's loss and epoch figures (vitrain/models/train_figures.py): the same numbers as
torchmetrics' accuracy and mean, in fewer ops a step, summed exactly over ranks, and traceable whole."""

import collections
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from timm.loss import SoftTargetCrossEntropy
from torch.profiler import profile
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from vitrain.models.train_figures import TrainingFigures, accuracy_top_k, loss_and_figures
from warm import warm_forkserver


def _batches(sizes: list[int], classes: int = 10, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(n, classes, generator=gen), torch.randint(0, classes, (n,), generator=gen))
        for n in sizes
    ]


def _torchmetrics_figures(
    batches: list[tuple[torch.Tensor, torch.Tensor]], smoothing: float
) -> dict[str, float]:
    """What torchmetrics computes for the same batches: micro top-1/top-5 accuracy, the per-image mean loss."""
    acc1 = MulticlassAccuracy(num_classes=10, top_k=1, average="micro")
    acc5 = MulticlassAccuracy(num_classes=10, top_k=5, average="micro")
    mean = MeanMetric()
    for logits, y in batches:
        acc1.update(logits, y)
        acc5.update(logits, y)
        mean.update(F.cross_entropy(logits, y, label_smoothing=smoothing), weight=len(y))
    return {"acc1": acc1.compute().item(), "acc5": acc5.compute().item(), "loss_epoch": mean.compute().item()}


def test_figures_equal_torchmetrics_accuracy_and_mean_loss():
    """Top-1/top-5 hits are counts (exactly torchmetrics' accuracy); the epoch loss is the mean over images,
    a short last batch weighing its images only."""
    batches = _batches([33, 33, 33, 7])
    figures = TrainingFigures(accuracy_top_k(10))
    for logits, y in batches:
        loss, sums = loss_and_figures(logits, y, 0.1, figures.top_k)
        torch.testing.assert_close(loss, F.cross_entropy(logits, y, label_smoothing=0.1))
        figures.update(sums)
    got = {k: v.item() for k, v in figures.compute().items()}
    expected = _torchmetrics_figures(batches, 0.1)
    assert got["acc1"] == expected["acc1"] and got["acc5"] == expected["acc5"]
    assert got["loss_epoch"] == pytest.approx(expected["loss_epoch"], rel=1e-6)
    figures.reset()
    assert figures.counts.tolist() == [0, 0, 0] and figures.loss_sum.item() == 0.0
    assert accuracy_top_k(4) == (1,)  # top-5 of 4 classes would always hit


def test_mixed_targets_take_the_soft_loss_and_accuracy_against_the_labels():
    logits, y = _batches([16])[0]
    soft = torch.softmax(torch.randn(16, 10), -1)
    loss, sums = loss_and_figures(logits, y, 0.1, (1, 5), soft, SoftTargetCrossEntropy())
    torch.testing.assert_close(loss, SoftTargetCrossEntropy()(logits, soft))
    assert sums[0][1].item() == (logits.argmax(-1) == y).sum().item()


def _top_level_ops(fn, steps: int = 4) -> float:
    """aten ops called from Python per call of `fn` (on a GPU each launches at least one kernel)."""
    fn()
    with profile() as prof:
        for _ in range(steps):
            fn()
    counts = collections.Counter(
        e.name
        for e in prof.events()
        if e.name.startswith("aten::")
        and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    )
    return sum(counts.values()) / steps


def test_a_training_step_issues_under_half_the_ops_of_torchmetrics_updates():
    """Loss, its backward and the epoch figures: well under half the ops of the same work with
    torchmetrics' two accuracies and mean (what each training step ran before: 83 ops at batch 384 here)."""
    logits = torch.randn(384, 10, requires_grad=True)
    y = torch.randint(0, 10, (384,))
    figures = TrainingFigures((1, 5))
    acc1 = MulticlassAccuracy(num_classes=10, top_k=1, average="micro", validate_args=False)
    acc5 = MulticlassAccuracy(num_classes=10, top_k=5, average="micro", validate_args=False)
    mean = MeanMetric(nan_strategy="disable")

    def ours() -> None:
        loss, sums = loss_and_figures(logits, y, 0.1, figures.top_k)
        figures.update(sums)
        loss.backward()

    def before() -> None:
        loss = F.cross_entropy(logits, y, label_smoothing=0.1)
        acc1.update(logits.detach(), y)
        acc5.update(logits.detach(), y)
        mean.update(loss.detach())
        loss.backward()

    ours_ops, before_ops = _top_level_ops(ours), _top_level_ops(before)
    assert ours_ops < before_ops / 2, (ours_ops, before_ops)


def test_the_loss_and_figures_compile_as_one_graph():
    """What configure_model compiles with the network: traced whole (no graph break), the same numbers."""
    import torch._dynamo

    torch._dynamo.reset()
    compiled = torch.compile(loss_and_figures, backend="aot_eager", fullgraph=True)
    logits, y = _batches([24])[0]
    logits.requires_grad_(True)
    loss, sums = compiled(logits, y, 0.1, (1, 5))
    loss.backward()
    eager_logits = logits.detach().clone().requires_grad_(True)
    eager_loss, eager_sums = loss_and_figures(eager_logits, y, 0.1, (1, 5))
    eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss)
    torch.testing.assert_close(logits.grad, eager_logits.grad)
    assert torch.equal(sums[0], eager_sums[0]) and torch.equal(sums[1], eager_sums[1])
    torch._dynamo.reset()


def _rank(rank: int, port: int, sizes: list[list[int]], out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        figures = TrainingFigures((1, 5))
        for logits, y in _batches(sizes[rank], seed=rank):
            figures.update(loss_and_figures(logits, y, 0.0, figures.top_k)[1])
        out[rank] = {k: v.item() for k, v in figures.compute().items()}
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_figures_are_summed_exactly_over_ranks_with_uneven_batches():
    """Two gloo ranks with different numbers and sizes of batches: each computes the figures of all images
    together, as one process seeing both ranks' batches would."""
    sizes = [[8, 8, 8], [8, 3]]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.start_processes(_rank, args=(port, sizes, out), nprocs=2, start_method=warm_forkserver())
    together = _torchmetrics_figures(_batches(sizes[0], seed=0) + _batches(sizes[1], seed=1), 0.0)
    for rank in (0, 1):
        assert out[rank]["acc1"] == together["acc1"] and out[rank]["acc5"] == together["acc5"]
        assert out[rank]["loss_epoch"] == pytest.approx(together["loss_epoch"], rel=1e-6)
