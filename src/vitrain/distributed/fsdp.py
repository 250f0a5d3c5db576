"""Fully sharded data parallel (FSDP2, `torch.distributed.fsdp.fully_shard`) on GPUs and on CPUs.

Lightning's `FSDPStrategy` (FSDP1) refuses CPUs. `FSDP2Strategy` is Lightning's `ModelParallelStrategy` with
every process in one data-parallel group; the network is sharded by `apply_fsdp`, the last step of
`vitrain.distributed.parallelize` (activation checkpointing, compile, FSDP), which the model's
`configure_model` runs with the strategy: the model itself knows nothing about sharding. The optimizer is
built afterwards from the sharded (DTensor) parameters: each rank keeps only its shard of the weights,
gradients and AdamW moments. GPU specifics (what a CPU test cannot show): docs/gpu.md.
"""

import inspect
import logging
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from vitrain.compat import META_FILENAME, set_data_parallel_size
from vitrain.errors import ModelError

# checkpoint entries other than `state_dict` that hold sharded weights: EMA's raw weights (callbacks/ema.py)
SHARDED_ENTRIES = ("current_model_state",)

log = logging.getLogger(__name__)

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


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


#: `trainer.strategy.unit_params`'s default: FSDP1's size-based wrapping default (`min_num_params`)
UNIT_PARAMS = 100_000_000


def valid_unit_params(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def group_units(units: list[nn.Module], unit_params: int) -> list[list[nn.Module]]:
    """Consecutive units in groups of at least `unit_params` parameters (the last may hold fewer); 0: each
    unit a group of its own.

    Why: FSDP2's host work has a part per sharded group each step (its hooks, the all-gather and reduce-
    scatter calls, stream and event bookkeeping) besides the part per parameter tensor, and a step whose GPU
    work is short waits for it (docs/benchmarks.md 4b: ViT-B's 12 blocks as one group instead of 12 cut the
    host work FSDP adds by a third on a CPU). A group is gathered whole, so it costs its full weights in memory
    while it runs, as FSDP1's size-based wrapping (`min_num_params`, default 1e8) did."""
    if unit_params <= 1:
        return [[unit] for unit in units]
    groups: list[list[nn.Module]] = []
    held = unit_params
    for unit in units:
        if held >= unit_params:
            groups.append([])
            held = 0
        groups[-1].append(unit)
        held += sum(p.numel() for p in unit.parameters())
    return groups


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    units: list[nn.Module] | None = None,
    mixed_precision: str | None = None,
    reshard_after_forward: bool = True,
    prefetch: int = 0,
    unit_params: int = 0,
) -> nn.Module:
    """Shard every unit (by default the transformer blocks), then the root (embeddings, norm, head).

    Every rank must hold the same initial weights: `fully_shard` keeps each rank's slice of its own copy.
    They are the same because every rank is seeded alike before the model is built (`seed` in the config;
    tests/test_gpu_paths.py checks it). No broadcast here: `configure_model` runs before the model is on its
    device, and on GPUs the group is NCCL-only, which refuses CPU tensors. A 2-D mesh (replicate, shard)
    gives hybrid sharding (HSDP). `reshard_after_forward=False` keeps the gathered weights from forward to
    backward (ZeRO-2 like: one all-gather fewer per block, more memory). `prefetch`: `set_prefetching`.
    `unit_params`: consecutive units sharded as one group of at least that many parameters (`group_units`).
    """
    if is_sharded(model):
        return model
    if mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"mixed_precision={mixed_precision!r}: use null or bf16")
    if not valid_prefetch(prefetch):
        raise ValueError(f"prefetch={prefetch!r}: use 0 or a number of units >= 1")
    if not valid_unit_params(unit_params):
        raise ValueError(f"unit_params={unit_params!r}: use 0 or a number of parameters")
    dtypes = MIXED_PRECISION[mixed_precision]
    block_policy = MixedPrecisionPolicy(**dtypes)
    # loss and metrics see fp32 logits
    root_policy = MixedPrecisionPolicy(**dtypes, output_dtype=torch.float32 if dtypes else None)
    if dtypes:
        shard_batch_norms_fp32(model, mesh)
    units = shard_units(model) if units is None else units
    groups = group_units(units, unit_params)
    sharded_as = [group_module(model, group) for group in groups]
    for target in sharded_as:
        fully_shard(target, mesh=mesh, mp_policy=block_policy)
    fully_shard(model, mesh=mesh, mp_policy=root_policy)
    if len(groups) < len(units):
        log.info(
            "FSDP: %d blocks sharded in %d groups of >= %s parameters (trainer.strategy.unit_params; 0: one "
            "group per block)",
            len(units),
            len(groups),
            f"{unit_params:,}",
        )
    set_training_resharding(model, reshard_after_forward)
    # a group's modules share one FSDP state: its first stands for it
    set_prefetching(model, [t if isinstance(t, nn.Module) else t[0] for t in sharded_as], prefetch)
    return model


def group_module(model: nn.Module, group: list[nn.Module]) -> nn.Module | list[nn.Module]:
    """What `fully_shard` takes for one group: its unit; the `nn.Sequential` whose children the group is
    (a ViT's `blocks` under the default `unit_params`); else the list of its units.

    Why the container: FSDP2 hooks every module it is handed. A list of 12 blocks runs 12 pre-forward and
    post-forward hooks and registers 12 pre- and post-backward hooks a step, where the container that calls
    them runs one of each, for the same all-gather, reduce-scatter and ops. On a CPU (ViT-B's 152 tensors,
    the blocks compiled) that is 1.7-3.5 ms a step less in three runs, of the 10.5-11.7 FSDP added
    (docs/benchmarks.md 4b, the `_list` variants). A model that iterates over the container instead of
    calling it (timm's NaFlexViT) would bypass its hooks: `sequential_of` reads the model's code for a call,
    and `bypassed_group` names the case it misses in one line."""
    if len(group) == 1:
        return group[0]
    container = sequential_of(model, group)
    if container is None:
        return group  # one FSDP group all the same: gathered before its first unit, resharded after its last
    container._vitrain_fsdp_group = True
    return container


def sequential_of(root: nn.Module, modules: list[nn.Module]) -> nn.Module | None:
    """The `nn.Sequential` in `root` whose children are exactly `modules`, in order, and whose own call runs
    them; None for fewer than two modules, under timm's grad checkpointing (`checkpoint_seq` calls each
    child, never the container), or where the module holding the container does not call it in its code
    (`calls`): timm's NaFlexViT and SwinV2-CR stages loop over their `nn.Sequential` of blocks."""
    if len(modules) < 2 or getattr(root, "grad_checkpointing", False):
        return None
    for parent in root.modules():
        for name, container in parent.named_children():
            children = list(container.children())
            if (
                isinstance(container, nn.Sequential)
                and len(children) == len(modules)
                and all(a is b for a, b in zip(children, modules, strict=True))
            ):
                return container if calls(parent, name) else None
    return None


def calls(parent: nn.Module, name: str) -> bool:
    """Whether a method of `parent` (as its class resolves them, torch's own left out) calls its child `name`
    as `self.<name>(`. Read from the source because nothing else tells before the first forward whether a
    model calls its container or iterates over it; source that cannot be read counts as no call."""
    pattern = re.compile(rf"\bself\.{re.escape(name)}\(")
    for _, method in inspect.getmembers(type(parent), inspect.isfunction):
        if method.__module__.startswith("torch."):
            continue
        try:
            if pattern.search(inspect.getsource(method)):
                return True
        except (OSError, TypeError):
            continue
    return False


def bypassed_group(model: nn.Module, err: BaseException) -> ModelError | None:
    """The error to raise instead of `err` (DTensor's complaint about a plain tensor met by a sharded
    weight) when a container sharded as a group (`group_module`) still holds its shards: the model ran its
    blocks without calling it. None otherwise."""
    if not isinstance(err, RuntimeError) or "DTensor" not in str(err):
        return None
    for name, module in model.named_modules():
        weight = next(module.parameters(), None)
        if getattr(module, "_vitrain_fsdp_group", False) and isinstance(weight, DTensor):
            return ModelError(
                f"trainer=fsdp: the model runs the blocks in `{name}` without calling `{name}`, which FSDP "
                "shards as one group (trainer.strategy.unit_params): set trainer.strategy.unit_params=0 (each "
                "block its own group)"
            )
    return None


def valid_prefetch(prefetch: Any) -> bool:
    return isinstance(prefetch, int) and not isinstance(prefetch, bool) and prefetch >= 0


def set_prefetching(model: nn.Module, units: list[nn.Module], prefetch: int) -> None:
    """Explicit prefetching: each sharded module issues the all-gathers of the `prefetch` units that run
    after it as soon as its own weights are gathered, instead of FSDP2 issuing each unit's all-gather when
    the CPU reaches that unit (forward) or one unit ahead (backward). A host-bound step then still overlaps
    the all-gathers with compute; the cost is up to `prefetch` more units' gathered weights held at once.

    `units` run in forward order (timm registers blocks in the order they run); the root runs first in both
    passes, so it prefetches the first units in forward and the last ones in backward. Only the units are
    prefetched: the per-BatchNorm fp32 groups (`shard_batch_norms_fp32`) keep FSDP2's implicit prefetching.
    0 sets nothing: FSDP2's own behaviour.
    """
    if prefetch == 0 or not units:
        return
    forward = [model, *units]
    for i, module in enumerate(forward[:-1]):
        module.set_modules_to_forward_prefetch(forward[i + 1 : i + 1 + prefetch])
    backward = [model, *reversed(units)]
    for i, module in enumerate(backward[:-1]):
        module.set_modules_to_backward_prefetch(backward[i + 1 : i + 1 + prefetch])


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


def compute_dtype(mixed_precision: str | None) -> torch.dtype | None:
    """The dtype blocks compute in under `mixed_precision` (None: the precision plugin's): what MFU must be
    measured against (callbacks/throughput.py)."""
    return MIXED_PRECISION[mixed_precision].get("param_dtype")


def set_training_resharding(model: nn.Module, reshard_after_forward: bool) -> None:
    """Backward starts with the root (head, norm) and the last unit: they keep their gathered weights
    from forward to backward, as gathering them again at once would be pure cost. The other units follow
    `reshard_after_forward`. The per-BatchNorm fp32 groups (`shard_batch_norms_fp32`) are no units: the last
    FSDP module of a ResNet under bf16 is such a norm, not the block that backward starts with."""
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    units = [m for m in sharded if not isinstance(m, _BATCH_NORMS)]
    keep = {id(units[0]), id(units[-1])} if units else set()
    for module in sharded:
        module.set_reshard_after_forward(reshard_after_forward and id(module) not in keep, recurse=False)


def gather_for_eval(model: nn.Module) -> None:
    """Gather every shard once and keep the full weights until `reshard_after_eval`.

    Otherwise every eval forward all-gathers, and a rank with one batch more than another (9 validation
    images on 2 ranks: 3 batches and 2) waits forever for its partner. Costs the full weights' memory
    while evaluating, like FSDP1's summon_full_params.
    """
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in sharded:
        module.set_reshard_after_forward(False, recurse=False)
    # Lightning evaluates under torch.inference_mode on GPUs (NCCL): buffers FSDP2 allocates there would be
    # inference tensors, which the next training step cannot update in place ("Inplace update to inference
    # tensor outside InferenceMode"). Gathered outside it, they stay ordinary tensors.
    with torch.inference_mode(False):
        for module in sharded:
            module.unshard()


def reshard_after_eval(model: nn.Module, reshard_after_forward: bool) -> None:
    with torch.inference_mode(False):
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
    set_training_resharding(model, reshard_after_forward)


def hybrid_mesh(device_type: str, world_size: int, shard_size: int) -> DeviceMesh:
    """A 2-D mesh for hybrid sharding (HSDP): shard within groups of `shard_size` processes (a node),
    replicate across the groups (gradients are all-reduced between replicas, as DDP does)."""
    if shard_size < 1 or world_size % shard_size:
        raise ValueError(
            f"trainer.strategy.hybrid_shard={shard_size}: the shard group size must divide the world size "
            f"({world_size})"
        )
    return init_device_mesh(
        device_type, (world_size // shard_size, shard_size), mesh_dim_names=("replicate", "shard")
    )


#: FSDP over one process: every parameter is a DTensor of one shard, and FSDP2's per-parameter hooks,
#: copies and DTensor dispatch still run each step, for no memory saved
ONE_PROCESS = (
    "trainer=fsdp with one process shards nothing and saves no memory, but FSDP2's per-parameter work still "
    "runs every step (ViT-B/32 on one H200: 0.62x the images/s of trainer=gpu, docs/benchmarks.md section 8): "
    "on one device train with trainer=gpu (or trainer=cpu); keep trainer=fsdp to try the sharded path first"
)


class FSDP2Strategy(ModelParallelStrategy):
    """`ModelParallelStrategy` for pure FSDP: data-parallel size = world size, tensor-parallel size 1.

    Its "auto" sizes would make the data-parallel size the number of nodes: on one node both ranks would see
    all the data and nothing would be sharded. Checkpoints are folders with one shard per rank
    (`save_distributed_checkpoint=True`; every rank must be able to write to the checkpoint dir) or, with
    `False`, one file assembled on rank 0.
    """

    _said_one_process = False

    def __init__(
        self,
        mixed_precision: str | None = None,
        reshard_after_forward: bool = True,
        activation_checkpointing: bool = False,
        save_distributed_checkpoint: bool = True,
        hybrid_shard: bool | int = False,
        prefetch: int = 0,
        unit_params: int = UNIT_PARAMS,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        if mixed_precision not in MIXED_PRECISION:
            raise ValueError(
                f"trainer.strategy.mixed_precision={mixed_precision}: use null or bf16 (bf16 weights and "
                "compute, fp32 gradient reduction and master weights)"
            )
        if not isinstance(hybrid_shard, bool | int) or hybrid_shard < 0:
            raise ValueError(f"trainer.strategy.hybrid_shard={hybrid_shard}: use false, true or a group size")
        if not valid_prefetch(prefetch):
            raise ValueError(
                f"trainer.strategy.prefetch={prefetch!r}: use 0 (FSDP2's implicit prefetching) or N >= 1 (gather "
                "the next N units' weights early)"
            )
        if not valid_unit_params(unit_params):
            raise ValueError(
                f"trainer.strategy.unit_params={unit_params!r}: use 0 (each block its own FSDP group) or N "
                "(consecutive blocks sharded as one group of at least N parameters)"
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
            "prefetch": prefetch,
            "unit_params": unit_params,
        }
        # false: one shard group of all processes; true: shard within each node, replicate across nodes
        # (HSDP: all-gathers stay on the fast intra-node links); an int: shard groups of that many processes
        self.hybrid_shard = hybrid_shard
        self.save_distributed = save_distributed_checkpoint
        self._fsdp_mesh: DeviceMesh | None = None

    def setup_environment(self) -> None:
        set_data_parallel_size(self, self.num_nodes * self.num_processes)
        super().setup_environment()
        if self.world_size == 1 and not FSDP2Strategy._said_one_process:
            FSDP2Strategy._said_one_process = True  # once a process: fit, then test, set up again
            log.warning(ONE_PROCESS)

    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh `fully_shard` shards over: the data-parallel group, or a (replicate, shard) mesh."""
        if self._fsdp_mesh is None:
            if self.hybrid_shard is False or self.hybrid_shard == 0:
                self._fsdp_mesh = self.device_mesh["data_parallel"]
            else:
                size = self.num_processes if self.hybrid_shard is True else int(self.hybrid_shard)
                self._fsdp_mesh = hybrid_mesh(self.root_device.type, self.world_size, size)
        return self._fsdp_mesh

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Everything but the weights and optimizer state (callback scores, RNG states: meta.pt of a folder)
        goes to the CPU first: Lightning reads meta.pt without `map_location`, so a GPU tensor there would
        land on GPU 0 of every rank, or fail on a machine without a GPU.

        Sharded entries besides `state_dict` (the raw weights EMA keeps beside its average under
        `current_model_state`, callbacks/ema.py) join the folder's shards: only rank 0 writes meta.pt, so a
        DTensor there would lose every other rank's shard. Lightning's save takes only `state_dict` and the
        optimizers into the shards, so with such an entry the folder is written here, as Lightning writes it.
        """
        sharded = {k: checkpoint.pop(k) for k in SHARDED_ENTRIES if k in checkpoint}
        for key in list(checkpoint):
            if key not in ("state_dict", "optimizer_states"):
                checkpoint[key] = move_data_to_device(checkpoint[key], "cpu")
        if not sharded:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if not self.save_distributed:
            raise ValueError(f"{sorted(sharded)} can only be saved with save_distributed_checkpoint=true")
        path = Path(self.broadcast(filepath))
        if path.is_file():
            path.unlink()
        path.mkdir(parents=True, exist_ok=True)
        state = {"state_dict": checkpoint.pop("state_dict"), **sharded}
        state |= {f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))}
        dcp.save(state, checkpoint_id=path)
        if self.global_rank == 0:
            torch.save(checkpoint, path / META_FILENAME)
        return None

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().training_step(*args, **kwargs)
        except RuntimeError as err:
            problem = (
                bypassed_group(self.lightning_module, err) if self.lightning_module is not None else None
            )
            if problem is None:
                raise
            raise problem from err

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
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        path = Path(self.broadcast(checkpoint_path))
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if path.is_dir() and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            # a resumed fit gets the sharded entries back (Lightning's load reads `state_dict` and the
            # optimizers only), each shaped and sharded like the model's state dict
            stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
            for key in SHARDED_ENTRIES:
                if any(name.startswith(f"{key}.") for name in stored):
                    like = get_model_state_dict(self.model)
                    state = {key: {name: value.detach().clone() for name, value in like.items()}}
                    dcp.load(state, checkpoint_id=path)
                    checkpoint[key] = state[key]
        return checkpoint
