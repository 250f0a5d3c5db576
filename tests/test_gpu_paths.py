"""What of the GPU paths a CPU can check (docs/gpu.md says what only a GPU shows: `make gpu-check`).

Two real gloo processes (spawned once for the module) run the parallelize step and FSDP2 as a GPU run does:
no collective on CPU tensors before the model is on its device (NCCL refuses them), identical initial
weights on every rank from the common seed, evaluation under `torch.inference_mode` followed by a training
step, hybrid sharding meshes, explicit prefetching (same numbers, all-gathers issued early), and a different
augmentation stream per rank with per-rank RNG restore.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import compose_cfg, tiny_overrides
from vitrain.callbacks import throughput
from vitrain.callbacks.resume import collect_rng_states, gather_from_ranks, offset_by_rank, set_rng_states
from vitrain.checkpoints import AtomicCheckpointIO
from vitrain.distributed import fsdp
from vitrain.distributed.fsdp import FSDP2Strategy, gather_for_eval, hybrid_mesh, reshard_after_eval
from vitrain.distributed.local_step import steps_on_local_shards
from vitrain.distributed.parallelize import parallelize
from vitrain.models.timm_net import create_net
from warm import run_script, warm_forkserver

WORLD = 2
NET = {
    "model_name": "vit_tiny_patch16_224",
    "pretrained": False,
    "num_classes": 10,
    "img_size": 32,
    "patch_size": 8,
    "embed_dim": 32,
    "depth": 2,
    "num_heads": 2,
}


PREFETCH_DEPTH = 4
# the collective FSDP2 gathers its parameters with: torch 2.14's `all_gather_single`, before it
# `all_gather_into_tensor` (the GPU image's torch 2.11)
GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
# prefetch 0 is the reference; activation checkpointing recomputes each block in backward (no prefetch then)
PREFETCH_RUNS = {
    "0": {},
    "1": {"prefetch": 1},
    "2": {"prefetch": 2},
    "2+ac": {"prefetch": 2, "activation_checkpointing": True},
    # the blocks sharded in groups (`unit_params`): all four as one, and two groups of two with prefetching
    "one_group": {"unit_params": 10**9},
    "one_group+ac": {"unit_params": 10**9, "activation_checkpointing": True},
    # compiled with `compile_scope=auto`: the blocks' container as one graph (Dynamo's eager backend: the
    # traced graph runs the same ops, so the numbers stay bit for bit)
    "one_group+compiled": {"unit_params": 10**9, "compile": True},
    "groups_of_2+1": {"unit_params": "2 blocks", "prefetch": 1},
}


def _refuse_all_gather(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("an all-gather while evaluating: ranks with different batch counts would hang")


class MeshOnly:
    """What `parallelize` reads from an FSDP2Strategy: its options and its mesh (a real gloo mesh here;
    the strategy's own `fsdp_mesh` needs a Lightning trainer around it)."""

    def __init__(self, mesh: Any, **options: Any) -> None:
        self.fsdp_options = {"mixed_precision": None, "reshard_after_forward": True, **options}
        self._mesh = mesh

    def fsdp_mesh(self) -> Any:
        return self._mesh


def seeded_net(depth: int = NET["depth"]) -> torch.nn.Module:
    torch.manual_seed(42)  # what L.seed_everything(cfg.seed) does on every rank before the model is built
    return create_net({**NET, "depth": depth}, None)


def group_state(net: torch.nn.Module, block: torch.nn.Module) -> Any:
    """The FSDP state that gathers `block`'s weights: its own, or that of the container sharded as its group."""
    owner = (
        block
        if fsdp.is_sharded(block)
        else next(
            m
            for m in net.modules()
            if fsdp.is_sharded(m) and m is not net and any(c is block for c in m.children())
        )
    )
    return owner._get_fsdp_state()


@contextlib.contextmanager
def eager_backend() -> Iterator[None]:
    """`nn.Module.compile` with Dynamo's eager backend: the graphs are traced, then run as captured."""
    compile_ = torch.nn.Module.compile
    torch.nn.Module.compile = lambda self, **kw: compile_(self, backend="eager")
    try:
        yield
    finally:
        torch.nn.Module.compile = compile_


def hooked(net: torch.nn.Module) -> list[str]:
    """The modules FSDP2 hooks (its sharded modules), by name."""
    return [name for name, m in net.named_modules() if fsdp.is_sharded(m)]


class Looping(torch.nn.Module):
    """Blocks in an `nn.Sequential` that the forward calls (`loop=False`) or iterates over itself, as timm's
    ViT does when given an attention mask (`loop=True`)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Linear(4, 8)
        self.blocks = torch.nn.Sequential(
            *(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()) for _ in range(3))
        )
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, loop: bool = False) -> torch.Tensor:
        x = self.stem(x)
        if loop:
            for block in self.blocks:
                x = block(x)
        else:
            x = self.blocks(x)
        return self.head(x)


class Iterating(Looping):
    """Blocks in an `nn.Sequential` its forward only iterates over (timm's NaFlexViT)."""

    def forward(self, x: torch.Tensor, loop: bool = True) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _check(results: dict[str, Any], name: str, fn: Any) -> None:
    try:
        results[name] = fn()
    except Exception:
        results[name] = {"error": traceback.format_exc()}


def _worker(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh

    results: dict[str, Any] = {}
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("data_parallel",))

    def no_collective_and_same_weights() -> dict[str, Any]:
        reference = {k: v.clone() for k, v in seeded_net().state_dict().items()}
        net = seeded_net()
        called = []
        original = dist.broadcast
        dist.broadcast = lambda *a, **k: called.append("broadcast") or original(*a, **k)
        try:
            parallelize(net, MeshOnly(mesh))
        finally:
            dist.broadcast = original
        full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in net.state_dict().items()}
        same = all(torch.equal(full[k], reference[k]) for k in reference)
        return {"collectives": called, "equal_to_seeded": same, "sharded": fsdp.is_sharded(net)}

    def eval_under_inference_mode_then_train() -> dict[str, Any]:
        net = seeded_net()
        parallelize(net, MeshOnly(mesh))
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        x = torch.randn(4, 3, 32, 32)
        with torch.inference_mode():  # as Lightning evaluates on GPUs
            gather_for_eval(net)
            net(x)
            reshard_after_eval(net, True)
        for _ in range(2):
            loss = net(x).logsumexp(-1).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return {"loss": float(loss)}

    def hybrid(shard: int) -> dict[str, Any]:
        hmesh = hybrid_mesh("cpu", WORLD, shard)
        net = seeded_net()
        parallelize(net, MeshOnly(hmesh))
        torch.manual_seed(100 + rank)  # different data per rank: gradients are averaged across replicas
        net(torch.randn(2, 3, 32, 32)).sum().backward()
        grad = net.head.weight.grad
        grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        grads = gather_from_ranks(grad.sum().item(), WORLD)
        return {"shape": list(hmesh.shape), "names": list(hmesh.mesh_dim_names), "grad_sums": grads}

    def prefetch_changes_no_number() -> dict[str, Any]:
        """3 AdamW steps at each prefetch depth, with an evaluation after the second in which the ranks run
        3 and 2 batches (as `gather_for_eval` allows): any all-gather there would be a mismatch, so it raises."""
        runs: dict[str, dict[str, Any]] = {}
        for name, options in PREFETCH_RUNS.items():
            net = seeded_net(depth=PREFETCH_DEPTH)
            if options.get("unit_params") == "2 blocks":
                options = {**options, "unit_params": 2 * sum(p.numel() for p in net.blocks[0].parameters())}
            compiled = options.get("compile", False)
            options = {k: v for k, v in options.items() if k != "compile"}
            with eager_backend():
                parallelize(net, MeshOnly(mesh, **options), compile=compiled)
            optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
            torch.manual_seed(100 + rank)  # each rank its own data
            losses = []
            for step in range(3):
                x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
                loss = torch.nn.functional.cross_entropy(net(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
                if step == 1:
                    gather_for_eval(net)
                    original = getattr(dist, GATHER)
                    setattr(dist, GATHER, _refuse_all_gather)
                    try:
                        with torch.no_grad():
                            for _ in range(3 - rank):
                                net(x)
                    finally:
                        setattr(dist, GATHER, original)
                    reshard_after_eval(net, True)
            state = {k: v.full_tensor() for k, v in net.state_dict().items()}
            groups = len({id(group_state(net, block)) for block in net.blocks})
            compiled_modules = [n for n, m in net.named_modules() if getattr(m, "_compiled_call_impl", None)]
            runs[name] = {
                "losses": losses, "state": state, "block_groups": groups, "hooked": hooked(net),
                "compiled": compiled_modules,
            }  # fmt: skip
        reference = runs["0"]["state"]
        for run in runs.values():
            state = run.pop("state")
            run["equal"] = state.keys() == reference.keys() and all(
                torch.equal(state[k], reference[k]) for k in reference
            )
        return runs

    def prefetch_lists_and_order(prefetch: int) -> dict[str, Any]:
        """Who prefetches whom (by unit index; -1 the root), and how many all-gathers were issued by the time
        each block's own forward starts."""
        net = seeded_net(depth=PREFETCH_DEPTH)
        parallelize(net, MeshOnly(mesh, prefetch=prefetch))
        states = {id(m._get_fsdp_state()): i for i, m in enumerate(net.blocks)} | {
            id(net._get_fsdp_state()): -1
        }
        lists: dict[str, dict[int, list[int]]] = {"forward": {}, "backward": {}}
        for i, module in [(-1, net), *enumerate(net.blocks)]:
            state = module._get_fsdp_state()
            lists["forward"][i] = [states[id(s)] for s in state._states_to_forward_prefetch]
            lists["backward"][i] = [states[id(s)] for s in state._states_to_backward_prefetch]
        issued: list[int] = []
        seen: list[int] = []
        original = getattr(dist, GATHER)
        setattr(dist, GATHER, lambda *a, **k: issued.append(1) or original(*a, **k))
        for block in net.blocks:  # runs after FSDP2's own pre-forward hook (prepended)
            block.register_forward_pre_hook(lambda *_: seen.append(len(issued)))
        try:
            net(torch.randn(2, 3, 32, 32)).sum().backward()
        finally:
            setattr(dist, GATHER, original)
        return {"lists": lists, "gathers_at_block_start": seen}

    def kept_gathered() -> dict[str, list[str]]:
        """The FSDP modules that keep their gathered weights from forward to backward: for a ResNet under
        bf16 (each BatchNorm an FSDP group of its own), and for a ViT's blocks sharded in groups (the modules
        of a group share its setting)."""

        def kept(net: torch.nn.Module) -> list[str]:
            return [
                name
                for name, m in net.named_modules()
                if fsdp.is_sharded(m) and m._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is None
            ]

        torch.manual_seed(0)
        resnet = create_net({"model_name": "resnet10t", "num_classes": 4}, None)
        parallelize(resnet, MeshOnly(mesh, mixed_precision="bf16"))
        out = {"resnet_bf16": kept(resnet)}
        for name, unit_params in (("vit_one_group", 10**9), ("vit_groups_of_2", None)):
            net = seeded_net(depth=PREFETCH_DEPTH)
            if unit_params is None:  # two blocks' parameters
                unit_params = 2 * sum(p.numel() for p in net.blocks[0].parameters())
            parallelize(net, MeshOnly(mesh, unit_params=unit_params))
            out[name] = kept(net)
        return out

    def rng_streams() -> dict[str, Any]:
        torch.manual_seed(42)
        offset_by_rank(rank)
        draws = gather_from_ranks(torch.rand(4).tolist(), WORLD)
        saved = gather_from_ranks(collect_rng_states(), WORLD)
        expected = torch.rand(4).tolist()
        torch.manual_seed(7)  # anything else
        set_rng_states(saved[rank])  # what ExactResume restores on this rank
        return {"draws": draws, "restored_equal": torch.rand(4).tolist() == expected}

    _check(results, "init", no_collective_and_same_weights)
    _check(results, "inference_then_train", eval_under_inference_mode_then_train)
    _check(results, "hybrid_2x1", lambda: hybrid(1))
    _check(results, "hybrid_1x2", lambda: hybrid(2))
    _check(results, "rng", rng_streams)
    _check(results, "kept_gathered", kept_gathered)

    def local_optimizer_steps() -> dict[str, Any]:
        """3 steps of each optimizer through DTensor's dispatch and on the local shards (`steps_on_local_shards`),
        with a closure as Lightning steps: the weights, and the states a checkpoint saves (their layout too)."""
        optimizers = {
            "adamw_fused": (torch.optim.AdamW, {"fused": True, "weight_decay": 0.05}),
            "adamw_foreach": (torch.optim.AdamW, {"foreach": True, "weight_decay": 0.05}),
            "adam_amsgrad": (torch.optim.Adam, {"amsgrad": True}),
            "sgd_momentum": (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
            # hybrid sharding, 2 replicas of 1 shard: parameters and states (Replicate, Shard(0))
            "adamw_fused_hsdp_2x1": (torch.optim.AdamW, {"fused": True, "weight_decay": 0.05}),
        }
        out: dict[str, Any] = {}
        for name, (cls, kwargs) in optimizers.items():
            finals = {}
            for local in (False, True):
                net = seeded_net(depth=2)
                on = hybrid_mesh("cpu", WORLD, 1) if name.endswith("hsdp_2x1") else mesh
                parallelize(net, MeshOnly(on, unit_params=10**9))
                optimizer = cls(net.parameters(), lr=1e-2, **kwargs)
                took = steps_on_local_shards(optimizer) if local else None
                torch.manual_seed(100 + rank)
                for _ in range(3):
                    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))

                    def closure() -> torch.Tensor:
                        loss = torch.nn.functional.cross_entropy(net(x), y)  # noqa: B023
                        loss.backward()
                        return loss

                    optimizer.step(closure)
                    optimizer.zero_grad()
                states = optimizer.state_dict()["state"]
                finals[local] = {
                    "took": took,
                    "weights": {k: v.full_tensor() for k, v in net.state_dict().items()},
                    "states": {
                        f"{i}.{k}": (type(v).__name__, getattr(v, "placements", None), v)
                        for i, state in states.items()
                        for k, v in state.items()
                    },
                }
            ref, loc = finals[False], finals[True]
            out[name] = {
                "took": loc["took"],
                "weights_equal": all(
                    torch.equal(ref["weights"][k], loc["weights"][k]) for k in ref["weights"]
                ),
                "state_keys_equal": ref["states"].keys() == loc["states"].keys(),
                "state_layouts_equal": all(
                    ref["states"][k][:2] == loc["states"][k][:2] for k in ref["states"]
                ),
                "states_equal": all(
                    torch.equal(
                        *(
                            s[k][2].full_tensor() if s[k][0] == "DTensor" else s[k][2]
                            for s in (ref["states"], loc["states"])
                        )
                    )
                    for k in ref["states"]
                ),
                "dtensor_states": sum(v[0] == "DTensor" for v in loc["states"].values()),
            }
        return out

    def container_or_list() -> dict[str, Any]:
        """One group of all blocks: the container the model calls is what FSDP hooks, a container the model only
        iterates leaves its blocks hooked one by one; both train to the same numbers. A model whose code calls
        the container but that iterates it at run time gets the one-line error."""
        out: dict[str, Any] = {}
        for cls in (Looping, Iterating):
            torch.manual_seed(0)
            net = cls()
            fsdp.apply_fsdp(net, mesh, units=list(net.blocks), unit_params=10**9)
            optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
            torch.manual_seed(100 + rank)
            losses = []
            for _ in range(2):
                loss = net(torch.randn(4, 4)).square().mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
            out[cls.__name__] = {"hooked": hooked(net), "losses": losses}
        try:
            net = Looping()
            fsdp.apply_fsdp(net, mesh, units=list(net.blocks), unit_params=10**9)
            net(torch.randn(4, 4), loop=True)
        except RuntimeError as err:
            problem = fsdp.bypassed_group(net, err)
            out["bypassed"] = str(problem)
        return out

    _check(results, "container_or_list", container_or_list)
    _check(results, "local_steps", local_optimizer_steps)
    _check(results, "prefetch_math", prefetch_changes_no_number)
    for prefetch in (0, 1, 2):
        _check(results, f"prefetch_{prefetch}", functools.partial(prefetch_lists_and_order, prefetch))
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("gpu_paths")
    args = (str(out / "store"), str(out))
    mp.start_processes(_worker, args=args, nprocs=WORLD, join=True, start_method=warm_forkserver())
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _ok(result: dict[str, Any]) -> dict[str, Any]:
    assert "error" not in result, result.get("error")
    return result


def test_fsdp_start_up_issues_no_collective_and_ranks_start_identical(two_ranks: list[dict[str, Any]]):
    for rank in two_ranks:
        init = _ok(rank["init"])
        assert init["collectives"] == [], "a collective on CPU tensors fails on GPUs (NCCL-only group)"
        assert init["sharded"] and init["equal_to_seeded"]


def test_fsdp_trains_after_evaluating_under_inference_mode(two_ranks: list[dict[str, Any]]):
    for rank in two_ranks:
        assert torch.isfinite(torch.tensor(_ok(rank["inference_then_train"])["loss"]))


def test_hybrid_sharding_meshes(two_ranks: list[dict[str, Any]]):
    for rank in two_ranks:
        two_replicas, one_group = _ok(rank["hybrid_2x1"]), _ok(rank["hybrid_1x2"])
        assert two_replicas["shape"] == [2, 1] and one_group["shape"] == [1, 2]
        assert two_replicas["names"] == ["replicate", "shard"]
        # replicas average their gradients: both ranks hold the same gradient
        for result in (two_replicas, one_group):
            assert result["grad_sums"][0] == pytest.approx(result["grad_sums"][1])


def test_ranks_draw_different_augmentations_and_restore_their_own(two_ranks: list[dict[str, Any]]):
    for rank in two_ranks:
        rng = _ok(rank["rng"])
        assert rng["draws"][0] != rng["draws"][1]
        assert rng["restored_equal"]
    torch.manual_seed(42)
    assert two_ranks[0]["rng"]["draws"][0] == torch.rand(4).tolist(), "rank 0 draws as one process does"


def test_fsdp_prefetch_changes_no_number_and_evaluation_gathers_nothing(two_ranks: list[dict[str, Any]]):
    """Prefetching moves when all-gathers are issued, never what is computed: losses and weights are
    bit-for-bit those of FSDP2's implicit prefetching, with activation checkpointing too; so does sharding
    the blocks in groups (`unit_params`), which gathers a group's weights at once."""
    for rank in two_ranks:
        runs = _ok(rank["prefetch_math"])
        for name, run in runs.items():
            assert run["losses"] == runs["0"]["losses"], name
            assert run["equal"], f"prefetch {name}: the weights differ"
        groups = {name: run["block_groups"] for name, run in runs.items()}
        assert groups == {
            "0": 4, "1": 4, "2": 4, "2+ac": 4, "one_group": 1, "one_group+ac": 1, "one_group+compiled": 1,
            "groups_of_2+1": 2,
        }  # fmt: skip
        # compiled as what FSDP hooks as one group: the container, one graph with FSDP's hooks around it
        assert runs["one_group+compiled"]["compiled"] == ["blocks"]
        assert runs["one_group+compiled"]["hooked"] == ["", "blocks"]
        # one group of all blocks is their container, the one module FSDP2 hooks for them; with activation
        # checkpointing too (the container's children are then the checkpoint wrappers)
        assert runs["one_group"]["hooked"] == runs["one_group+ac"]["hooked"] == ["", "blocks"]
        assert runs["groups_of_2+1"]["hooked"] == ["", "blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert two_ranks[0]["prefetch_math"]["0"]["losses"] != two_ranks[1]["prefetch_math"]["0"]["losses"]


def test_fsdp_one_group_is_the_container_the_model_calls(two_ranks: list[dict[str, Any]]):
    """All blocks in one group (the default `unit_params` for ViT-B): FSDP2 hooks the `nn.Sequential` the model
    calls, not each block (fewer hooks a step: docs/benchmarks.md 4b); a model that iterates its container
    keeps the blocks hooked as a list, with the same losses; one that iterates a container its code also
    calls gets a one-line error saying what to set."""
    for rank in two_ranks:
        result = _ok(rank["container_or_list"])
        assert result["Looping"]["hooked"] == ["", "blocks"]
        assert result["Iterating"]["hooked"] == ["", "blocks.0", "blocks.1", "blocks.2"]
        assert result["Looping"]["losses"] == result["Iterating"]["losses"]
        assert result["bypassed"] == (
            "trainer=fsdp: the model runs the blocks in `blocks` without calling `blocks`, which FSDP shards as "
            "one group (trainer.strategy.unit_params): set trainer.strategy.unit_params=0 (each block its own "
            "group)"
        )


BYPASSING_FIT = """
import lightning as L, torch
from torch import nn
from vitrain.distributed.fsdp import FSDP2Strategy
from vitrain.distributed.parallelize import parallelize
from vitrain.errors import ModelError


class Looping(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.GELU()) for _ in range(3)))

    def forward(self, x, loop=False):
        if not loop:
            return self.blocks(x)
        for block in self.blocks:
            x = block(x)
        return x


class Task(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = Looping()

    def configure_model(self):
        parallelize(self.net, self.trainer.strategy)

    def training_step(self, batch, batch_idx):
        return self.net(batch, loop=True).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


trainer = L.Trainer(strategy=FSDP2Strategy(), accelerator="cpu", devices=1, max_steps=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
try:
    trainer.fit(Task(), torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4))
except ModelError as err:
    print(err)
"""


def test_fsdp_strategy_names_a_bypassed_group(tmp_path: Path):
    """Through Lightning: the strategy's training step turns DTensor's complaint into the one-line error (the
    template's entry points print a ModelError as one line and exit 2)."""
    script = tmp_path / "bypassing_fit.py"
    script.write_text(BYPASSING_FIT)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = run_script([script], env, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == (
        "trainer=fsdp: the model runs the blocks in `net.blocks` without calling `net.blocks`, which FSDP "
        "shards as one group (trainer.strategy.unit_params): set trainer.strategy.unit_params=0 (each block "
        "its own group)"
    ), done.stdout[-2000:]


def test_fsdp_prefetch_lists_and_early_all_gathers(two_ranks: list[dict[str, Any]]):
    """Forward: the root, then each block, prefetch the next N blocks; backward: the root, then each block,
    the N blocks before it. So by the time block i starts, 1 + min(i + 1 + N, 4) all-gathers were issued
    (root, block i, N ahead), where the implicit way has issued 1 + (i + 1)."""
    blocks = list(range(PREFETCH_DEPTH))
    for rank in two_ranks:
        for n in (0, 1, 2):
            result = _ok(rank[f"prefetch_{n}"])
            forward = {int(k): v for k, v in result["lists"]["forward"].items()}
            backward = {int(k): v for k, v in result["lists"]["backward"].items()}
            if n == 0:
                assert all(v == [] for v in (*forward.values(), *backward.values()))
            else:
                order = [-1, *blocks]
                assert forward == {m: order[j + 1 : j + 1 + n] for j, m in enumerate(order)}
                order = [-1, *reversed(blocks)]
                assert backward == {m: order[j + 1 : j + 1 + n] for j, m in enumerate(order)}
            expected = [1 + min(i + 1 + n, PREFETCH_DEPTH) for i in blocks]
            assert result["gathers_at_block_start"] == expected, n


def test_backward_starts_with_the_root_and_last_block_gathered(two_ranks: list[dict[str, Any]]):
    """The root and the last block keep their weights from forward to backward (re-gathering them at once
    would be pure cost), also when BatchNorms are FSDP groups of their own (a ResNet under bf16), and when
    blocks are sharded in groups (the last group)."""
    for rank in two_ranks:
        assert rank["kept_gathered"] == {
            "resnet_bf16": ["", "layer4"],
            # one group of all blocks: it is the last, kept whatever reshard_after_forward says
            "vit_one_group": ["", "blocks"],
            "vit_groups_of_2": ["", "blocks.2", "blocks.3"],
        }, rank["kept_gathered"]


def test_fsdp_optimizer_steps_on_local_shards_change_no_number(two_ranks: list[dict[str, Any]]):
    """SGD, Adam and AdamW (fused and foreach) stepped on each rank's local shards: weights and states bit
    for bit those of DTensor's dispatch, the states saved as DTensors laid out as before."""
    for rank in two_ranks:
        for name, run in _ok(rank["local_steps"]).items():
            assert run["took"] is True, name
            assert run["weights_equal"] and run["states_equal"], name
            assert run["state_keys_equal"] and run["state_layouts_equal"], name
            assert run["dtensor_states"] > 0, name


def test_local_steps_only_for_elementwise_optimizers():
    """Not known to be elementwise (a subclass, a norm-based optimizer), or no DTensor parameters: unchanged."""

    class Scaled(torch.optim.AdamW):
        pass

    params = [torch.nn.Parameter(torch.zeros(3))]
    for optimizer in (Scaled(params), torch.optim.Adagrad(params), torch.optim.AdamW(params)):
        step = optimizer.step
        assert steps_on_local_shards(optimizer) is False
        assert optimizer.step == step


def test_blocks_grouped_by_parameters():
    """`unit_params`: consecutive blocks until a group holds that many parameters; 0 or 1: one per block."""
    blocks = [torch.nn.Linear(10, 10) for _ in range(5)]  # 110 parameters each
    sizes = {n: [len(g) for g in fsdp.group_units(blocks, n)] for n in (0, 1, 100, 110, 220, 10**8)}
    assert sizes == {0: [1] * 5, 1: [1] * 5, 100: [1] * 5, 110: [1] * 5, 220: [2, 2, 1], 10**8: [5]}
    assert [b for g in fsdp.group_units(blocks, 220) for b in g] == blocks  # in order, each once
    for bad in (-1, 1.5, True, "big"):
        with pytest.raises(ValueError, match=r"^trainer\.strategy\.unit_params=\S+: use 0 [^\n]*$"):
            FSDP2Strategy(unit_params=bad)
    assert FSDP2Strategy().fsdp_options["unit_params"] == fsdp.UNIT_PARAMS


def test_fsdp_prefetch_refuses_bad_values():
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"^trainer\.strategy\.prefetch=\S+: use 0 [^\n]*$"):
            FSDP2Strategy(prefetch=bad)
    assert FSDP2Strategy(prefetch=2).fsdp_options["prefetch"] == 2
    with pytest.raises(ValueError, match="prefetch=-1"):
        fsdp.apply_fsdp(torch.nn.Linear(2, 2), None, prefetch=-1)


def test_hybrid_shard_size_must_divide_the_world():
    with pytest.raises(ValueError, match="divide the world size"):
        hybrid_mesh("cpu", 4, 3)
    with pytest.raises(ValueError, match="hybrid_shard"):
        FSDP2Strategy(hybrid_shard=-1)


def test_checkpoints_load_to_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Rank 0 saved `cuda:0` tensors: loaded without map_location they land on GPU 0 in every process."""
    path = tmp_path / "x.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}}, path)
    seen = []
    original = torch.load
    monkeypatch.setattr(
        torch, "load", lambda *a, **k: seen.append(k.get("map_location")) or original(*a, **k)
    )
    AtomicCheckpointIO().load_checkpoint(path)
    assert seen == ["cpu"]


def test_step_values_are_logged_as_cpu_tensors_on_log_steps_only(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path, monkeypatch: pytest.MonkeyPatch
):
    """A logged GPU tensor is read with .item() by the progress bar after every batch: a host sync per step.
    On a CPU only the form can be checked: CPU tensors, logged on the logger's steps only."""
    from vitrain.tasks.build import build

    cfg = compose_cfg(
        "train",
        [*tiny_overrides(tiny_cifar, data_cache), "trainer.log_every_n_steps=2", "+trainer.limit_train_batches=5",
         "trainer.limit_val_batches=1", "test=false", "logger=csv", "callbacks=none"],
        tmp_path,
    )  # fmt: skip
    objects = build(cfg)
    model, trainer = objects.model, objects.trainer
    logged: list[tuple[int, str, Any]] = []
    original = model.log

    def spy(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if name in ("train/loss_step", "lr"):
            logged.append((trainer.global_step, name, value))
        original(name, value, *args, **kwargs)

    monkeypatch.setattr(model, "log", spy)
    trainer.fit(model, datamodule=objects.datamodule)
    steps = sorted({step for step, name, _ in logged if name == "train/loss_step"})
    assert steps == [1, 3], steps  # the batches after which Lightning writes logs (every 2nd step)
    for _, _, value in logged:
        assert isinstance(value, torch.Tensor) and value.device.type == "cpu"


def test_peak_flops_table():
    bf16, fp32 = torch.bfloat16, torch.float32
    assert throughput.peak_flops("NVIDIA H100 80GB HBM3", bf16) == 989e12
    assert throughput.peak_flops("NVIDIA H100 PCIe", bf16) == 756e12
    assert throughput.peak_flops("NVIDIA H100 NVL", bf16) == 835e12
    assert throughput.peak_flops("NVIDIA H200", bf16) == 989e12  # dense, not the with-sparsity figure
    assert throughput.peak_flops("NVIDIA GH200 480GB", bf16) == 989e12
    assert throughput.peak_flops("NVIDIA A100-SXM4-80GB", bf16) == 312e12
    assert throughput.peak_flops("NVIDIA L4", bf16) == 121e12
    assert throughput.peak_flops("NVIDIA A100-SXM4-40GB", fp32, tf32=False) == 19.5e12
    assert throughput.peak_flops("NVIDIA A100-SXM4-40GB", fp32, tf32=True) == 156e12
    assert throughput.peak_flops("Some Future GPU", bf16) is None
    assert throughput.peak_flops("NVIDIA H100 80GB HBM3", torch.int8) is None


def test_compute_dtype_follows_the_fsdp_policy():
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision

    fp32 = Precision()  # trainer.precision=32-true: the plugin says fp32, the blocks compute in bf16
    assert throughput.compute_dtype(fp32, FSDP2Strategy(mixed_precision="bf16")) is torch.bfloat16
    assert throughput.compute_dtype(fp32, FSDP2Strategy()) is torch.float32
    assert throughput.compute_dtype(MixedPrecision("bf16-mixed", "cpu"), None) is torch.bfloat16


def test_bench_and_callback_share_one_peak_table():
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    try:
        import gpu as bench_gpu
    finally:
        sys.path.pop(0)
    assert bench_gpu.peak_flops is throughput.peak_flops


def test_tuner_searches_on_the_runs_first_device():
    from vitrain.tasks.tuning import first_device

    assert first_device([2, 3]) == [2]
    assert first_device("2,3") == [2]
    assert first_device(4) == 1 and first_device("auto") == 1


def test_progressive_resize_and_deterministic_cuda_are_refused():
    """A ViT trained below its size resamples its position embeddings (bicubic, antialiased) inside the graph:
    CUDA has no deterministic backward for that, so `trainer.deterministic=true` would stop the first
    backward on a GPU; the model says so before any step, and lets `warn`, evaluation and CPU runs through."""
    from types import SimpleNamespace

    from vitrain.errors import ModelError
    from vitrain.models.classifier import ImageClassifier

    net = {**NET, "dynamic_img_size": True}
    model = ImageClassifier(net, {"_target_": "torch.optim.AdamW"}, progressive_resize={"start_size": 16})
    model.train()
    loss = model(model.resize(torch.randn(2, 3, 32, 32), 0.0)).sum()
    nodes, seen = [loss.grad_fn], set()
    while nodes:
        node = nodes.pop()
        if node is not None and node not in seen:
            seen.add(node)
            nodes.extend(next_fn for next_fn, _ in node.next_functions)
    assert "UpsampleBicubic2DAaBackward0" in {type(n).__name__ for n in seen}  # what CUDA cannot make exact

    gpu, cpu = (SimpleNamespace(root_device=torch.device(d), fsdp_options=None) for d in ("cuda", "cpu"))
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        with pytest.raises(ModelError, match=r"set trainer\.deterministic=warn"):
            model.check_strategy(gpu)
        model.check_strategy(cpu)
        model.check_strategy(gpu, fitting=False)  # evaluation runs no backward
        torch.use_deterministic_algorithms(True, warn_only=True)
        model.check_strategy(gpu)
        torch.use_deterministic_algorithms(False)
        model.check_strategy(gpu)
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
    model.resize = None
    torch.use_deterministic_algorithms(True)
    try:
        model.check_strategy(gpu)  # full size only: nothing resampled
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])


def test_gpu_check_script_without_a_gpu(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    """`make gpu-check` on a machine without CUDA says so and exits 2; its checks are listed and documented.
    (`python bench/gpu_check.py --cpu-dry-run` runs all its commands on CPU processes: minutes, not in CI.)"""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py"])
    assert gpu_check.main() == 2
    assert "no CUDA GPU visible" in capsys.readouterr().err
    assert all(fn.__doc__ for fn in gpu_check.CHECKS.values())
    assert gpu_check.setting(["+trainer.max_epochs=1", "a=1"], trainer__max_epochs=3, ckpt_path="x") == [
        "a=1",
        "trainer.max_epochs=3",
        "ckpt_path=x",
    ]
