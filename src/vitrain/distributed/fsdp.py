"""Fully sharded data parallel (FSDP2, `torch.distributed.fsdp.fully_shard`) on GPUs and on CPUs.

Lightning's `FSDPStrategy` (FSDP1) refuses CPUs. `FSDP2Strategy` is Lightning's `ModelParallelStrategy` with
every process in one data-parallel group; the model is sharded by `apply_fsdp`, which
`ImageClassifier.configure_model` calls with the strategy's options, so the model itself knows nothing about
sharding. The optimizer is built afterwards from the sharded (DTensor) parameters: each rank keeps only its
shard of the weights, gradients and AdamW moments.
"""

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

MIXED_PRECISION = {
    None: {},
    # compute and all-gather in bf16, reduce gradients and keep the sharded master weights in fp32
    "bf16": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
}


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The repeated units to shard one by one, whatever the family calls them.

    A unit is a module with submodules that sits in an `nn.Sequential`/`nn.ModuleList` next to at least
    one sibling of its own class: a ViT's `blocks.i`, a ResNet's `layerN.i` (BasicBlock, Bottleneck), a
    ConvNeXt's `stages.i.blocks.j`, an EfficientNet's `blocks.i.j`. Where units nest, the innermost are
    taken (smaller units, less memory gathered at once); a stage with a single block (EfficientNet) is
    itself the unit. Layers (Linear, Conv, norms) never are. Without repeated units (a ResNet with one
    block per stage), the stages timm lists in the model's `feature_info`. Parameters outside every unit
    (stem, downsampling, head) belong to the root's shard group.
    """
    candidates: list[nn.Module] = []
    for container in model.modules():
        if not isinstance(container, nn.Sequential | nn.ModuleList):
            continue
        children = list(container.children())
        kinds = [type(child) for child in children]
        candidates += [c for c in children if kinds.count(type(c)) >= 2 and _composite(c)]
    if not candidates:
        names = [info.get("module", "") for info in getattr(model, "feature_info", None) or []]
        modules = dict(model.named_modules())
        candidates = [modules[n] for n in names if n in modules and _composite(modules[n])]
    inner = {id(m) for m in candidates}
    # keep the innermost: drop a candidate when another candidate lives inside it
    return [m for m in candidates if not any(id(d) in inner for d in m.modules() if d is not m)]


_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_NORMS = (*_BATCH_NORMS, nn.LayerNorm, nn.GroupNorm)


def _composite(module: nn.Module) -> bool:
    """A module made of other modules and holding parameters: a block or a stage, not a layer."""
    if isinstance(module, _NORMS) or next(module.children(), None) is None:
        return False
    return next(module.parameters(), None) is not None


# the name the apply step has called since the first (ViT-only) version
transformer_blocks = shard_units


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    mixed_precision: str | None = None,
    reshard_after_forward: bool = True,
    activation_checkpointing: bool = False,
) -> nn.Module:
    """Shard every transformer block, then the root (embeddings, final norm, head), over `mesh`.

    Idempotent: Lightning calls `configure_model` again when the same trainer tests after fitting.
    `reshard_after_forward=False` keeps the gathered weights from forward to backward (ZeRO-2 like: one
    all-gather fewer per block, more memory). `activation_checkpointing` recomputes each block's
    activations in backward instead of storing them.
    """
    if isinstance(model, FSDPModule):
        return model
    if mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"mixed_precision={mixed_precision!r}: use null or bf16")
    # fully_shard keeps each rank's slice of its own weights: make them rank 0's first, so the model is
    # the same on every rank even without a common seed
    broadcast_parameters(model, mesh)
    dtypes = MIXED_PRECISION[mixed_precision]
    block_policy = MixedPrecisionPolicy(**dtypes)
    # loss and metrics see fp32 logits
    root_policy = MixedPrecisionPolicy(**dtypes, output_dtype=torch.float32 if dtypes else None)

    blocks = shard_units(model)
    if activation_checkpointing:
        blocks = [_checkpoint_in_place(model, block) for block in blocks]
    if dtypes:
        shard_batch_norms_fp32(model, mesh)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=block_policy)
    fully_shard(model, mesh=mesh, mp_policy=root_policy)
    set_training_resharding(model, reshard_after_forward)
    return model


def shard_batch_norms_fp32(model: nn.Module, mesh: DeviceMesh) -> None:
    """BatchNorm in fp32 under bf16: FSDP2 casts a unit's parameters to bf16, but BatchNorm's running
    statistics stay fp32 buffers and the CPU kernel refuses the mix ("expected scalar type BFloat16 but
    found Float"); statistics over a batch are also better kept in fp32. Each BatchNorm becomes its own
    fp32 unit that takes and returns bf16: one small all-gather more per norm (ResNet-50: 53)."""
    policy = MixedPrecisionPolicy(
        param_dtype=torch.float32,
        reduce_dtype=torch.float32,
        output_dtype=torch.bfloat16,
        cast_forward_inputs=True,
    )
    for module in model.modules():
        if isinstance(module, _BATCH_NORMS):
            fully_shard(module, mesh=mesh, mp_policy=policy)


def set_training_resharding(model: nn.Module, reshard_after_forward: bool) -> None:
    """Backward starts with the root (head, norm) and the last block: they keep their gathered weights
    from forward to backward, as gathering them again at once would be pure cost. The other blocks follow
    `reshard_after_forward`."""
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for i, module in enumerate(sharded):
        keep = i in (0, len(sharded) - 1)
        module.set_reshard_after_forward(reshard_after_forward and not keep, recurse=False)


def gather_for_eval(model: nn.Module) -> None:
    """Gather every shard once and keep the full weights until `reshard_after_eval`.

    Otherwise every eval forward all-gathers, and a rank with one batch more than another (9 validation
    images on 2 ranks: 3 batches and 2) waits forever for its partner. Costs the full weights' memory
    while evaluating, like FSDP1's summon_full_params.
    """
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in sharded:
        module.set_reshard_after_forward(False, recurse=False)
    for module in sharded:
        module.unshard()


def reshard_after_eval(model: nn.Module, reshard_after_forward: bool) -> None:
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    set_training_resharding(model, reshard_after_forward)


def broadcast_parameters(model: nn.Module, mesh: DeviceMesh) -> None:
    group = mesh.get_group()
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, group=group, group_src=0)


def _checkpoint_in_place(root: nn.Module, block: nn.Module) -> nn.Module:
    """Replace `block` inside `root` by a checkpoint wrapper; state-dict keys stay those of the plain model."""
    for parent in root.modules():
        for name, child in parent.named_children():
            if child is block:
                wrapped = checkpoint_wrapper(block)
                setattr(parent, name, wrapped)
                return wrapped
    raise ValueError("block is not a submodule of the model")


class FSDP2Strategy(ModelParallelStrategy):
    """`ModelParallelStrategy` for pure FSDP: data-parallel size = world size, tensor-parallel size 1.

    Its "auto" sizes would make the data-parallel size the number of nodes: on one node both ranks would see
    all the data and nothing would be sharded. Checkpoints are folders with one shard per rank
    (`save_distributed_checkpoint=True`; every rank must be able to write to the checkpoint dir) or, with
    `False`, one file assembled on rank 0.
    """

    def __init__(
        self,
        mixed_precision: str | None = None,
        reshard_after_forward: bool = True,
        activation_checkpointing: bool = False,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        if mixed_precision not in MIXED_PRECISION:
            raise ValueError(
                f"trainer.strategy.mixed_precision={mixed_precision}: use null or bf16 (bf16 weights and "
                "compute, fp32 gradient reduction and master weights)"
            )
        super().__init__(
            data_parallel_size="auto",  # replaced by the world size in setup_environment
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.fsdp_options: dict[str, Any] = {
            "mixed_precision": mixed_precision,
            "reshard_after_forward": reshard_after_forward,
            "activation_checkpointing": activation_checkpointing,
        }

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    # evaluation gathers the weights once: ranks with different numbers of batches never wait on each other
    def on_validation_start(self) -> None:
        self._gather()

    def on_validation_end(self) -> None:
        self._reshard()

    def on_test_start(self) -> None:
        self._gather()

    def on_test_end(self) -> None:
        self._reshard()

    def on_predict_start(self) -> None:
        self._gather()

    def on_predict_end(self) -> None:
        self._reshard()

    def _gather(self) -> None:
        if self.lightning_module is not None:
            gather_for_eval(self.lightning_module)

    def _reshard(self) -> None:
        if self.lightning_module is not None:
            reshard_after_eval(self.lightning_module, self.fsdp_options["reshard_after_forward"])

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # Lightning 2.6 drops `fit/test(weights_only=False)` on the way to strategies that restore after
        # setup (Trainer._run), and torch then refuses the hparams (DictConfig, partials) in meta.pt. Our
        # checkpoints are loaded with weights_only=False everywhere (vitrain/training.py), so here too.
        return super().load_checkpoint(checkpoint_path, weights_only=bool(weights_only))
