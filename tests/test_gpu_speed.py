"""The GPU speed levers (issue 30), checked where a CPU can show them: which levers `auto` turns on for which
device and strategy, the patch convolution rewritten as a matmul computing the same function, and the
throughput figures of a short run (a window that fits, the first step apart, the real reason for a missing
MFU). The speed itself is measured by `bench/gpu.py` on a GPU (docs/benchmarks.md), never asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import timm
import torch
from torch import nn

from helpers import compose_cfg, tiny_overrides
from vitrain.data.datamodules.base import ImageDataModule
from vitrain.distributed.parallelize import parallelize, transformer_blocks, twin_units
from vitrain.errors import DataError, ModelError
from vitrain.models.classifier import compile_choice, fused_default, params_device_type
from vitrain.models.timm_net import PatchConv2d, patch_convs_as_matmuls
from vitrain.reporting.markdown import _throughput
from vitrain.reporting.report import mfu_note
from vitrain.tasks.training import keep_compiled_kernels, train
from warm import run_script


def _strategy(device: str, sharded: bool = False) -> SimpleNamespace:
    return SimpleNamespace(root_device=torch.device(device), fsdp_options={} if sharded else None)


def test_compile_auto_is_on_for_gpu_training_without_fsdp():
    assert compile_choice("auto", _strategy("cuda")) is True
    assert compile_choice("auto", _strategy("cuda", sharded=True)) is False  # host-bound; true: per block
    assert compile_choice("auto", _strategy("cpu")) is False
    assert compile_choice("auto", None) is False
    assert (
        compile_choice(True, _strategy("cpu")) is True and compile_choice(False, _strategy("cuda")) is False
    )
    with pytest.raises(ModelError, match=r"model\.compile='yes' must be true, false or auto"):
        compile_choice("yes", _strategy("cuda"))


def test_fused_optimizer_by_default_where_torch_has_the_kernel():
    net = nn.Linear(4, 2)
    adamw = {"_target_": "torch.optim.AdamW", "lr": 1e-3}
    assert fused_default(adamw, net) == {"fused": True}  # CPU parameters: torch's fused CPU kernel
    assert fused_default({**adamw, "fused": False}, net) == {}  # the config's word stands
    assert fused_default({"_target_": "timm.optim.Lamb", "lr": 1e-3}, net) == {}  # no fused kernel
    with torch.device("meta"):
        meta = nn.Linear(4, 2)
    assert fused_default(adamw, meta) == {}  # no kernel there
    assert params_device_type(net) == "cpu" and params_device_type(meta) == "meta"


SHARDED_FUSED = """
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch import nn
from vitrain.models.classifier import params_device_type
dist.init_process_group("gloo", init_method="file://{store}", rank=0, world_size=1)
nets = []
for fused in (False, True):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    fully_shard(net[0]); fully_shard(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=fused, foreach=None if fused else True)
    for _ in range(3):
        net(torch.ones(4, 8)).square().mean().backward(); opt.step(); opt.zero_grad()
    nets.append(net)
assert params_device_type(nets[1]) == "cpu", params_device_type(nets[1])
for a, b in zip(nets[0].parameters(), nets[1].parameters()):
    torch.testing.assert_close(a.full_tensor(), b.full_tensor())
print("ok")
"""


def test_fused_adamw_steps_fsdp2_shards_like_foreach(tmp_path: Path):
    """FSDP2's DTensor parameters count as fusable (`params_device_type`), and torch's fused AdamW updates
    them as its foreach implementation does (one gloo rank on the CPU; the GPU kernel is the same op)."""
    script = tmp_path / "sharded_fused.py"
    script.write_text(SHARDED_FUSED.format(store=tmp_path / "store"))
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    # a process of its own (torch.distributed's process group lasts as long as the process), forked warm:
    # no ~10 s of imports
    done = run_script([script], env, cwd=tmp_path, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def _graphs_for_sizes(
    per_block: bool, monkeypatch: pytest.MonkeyPatch, drop_path_rate: float = 0.0, scope: str = "auto"
) -> int:
    from torch._dynamo.utils import counters

    compile_ = nn.Module.compile
    # Dynamo's graphs and recompiles do not depend on the backend; "eager" skips Inductor's C++ build
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kw: compile_(self, backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    net = timm.create_model(
        "vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=2,
        num_classes=4, dynamic_img_size=True, drop_path_rate=drop_path_rate,
    )  # fmt: skip
    parallelize(net, None, compile=True, resizes=per_block, compile_scope=scope)
    # the blocks' container compiled (auto takes it under resizing), nothing inside or around it
    if scope == "stack" or (scope == "auto" and per_block):
        assert getattr(net.blocks, "_compiled_call_impl", None) is not None
        assert not any(getattr(m, "_compiled_call_impl", None) for m in [net, *net.blocks, net.patch_embed])
        # the first frame Dynamo traces is the stack's forward, so not one of torch.nn's files: torch 2.11's
        # Dynamo skips those as first frames and compiled each block as a frame of its own (six graphs here)
        assert not type(net.blocks).forward.__module__.startswith("torch.")
    for size in (16, 24, 32, 32, 16):  # a progressive-resizing ramp, then evaluation-like reuse
        net(torch.randn(2, 3, size, size)).sum().backward()
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    return graphs


def test_progressive_resizing_compiles_each_block_twice_not_the_network_per_size(
    monkeypatch: pytest.MonkeyPatch,
):
    """With progressive resizing, compile takes the blocks (by default their container, `auto_scope`): one graph
    for the first size, one with a dynamic token count for every later size; the whole network would be
    compiled again at each new size."""
    assert _graphs_for_sizes(per_block=True, monkeypatch=monkeypatch) == 2
    assert _graphs_for_sizes(per_block=True, monkeypatch=monkeypatch, scope="blocks") == 2
    assert _graphs_for_sizes(per_block=False, monkeypatch=monkeypatch) == 3


def test_blocks_with_growing_drop_path_rates_share_one_graph(monkeypatch: pytest.MonkeyPatch):
    """Stochastic depth's rate grows with depth (0, 0.05, 0.1 here; ViT-B at 0.1: twelve rates): compiled
    block by block, timm's float rates made a graph per block (ViT-B: 8, then Dynamo's recompile limit and
    eager blocks); as tensors, the blocks share the graphs of rate-free blocks."""
    assert _graphs_for_sizes(per_block=True, monkeypatch=monkeypatch, drop_path_rate=0.1, scope="blocks") == 2


def test_progressive_resizing_compiles_the_stack_of_blocks_twice(monkeypatch: pytest.MonkeyPatch):
    """`compile_scope=stack`: the blocks' `nn.Sequential` as one graph (fusions across blocks, one call a step),
    as resizable as each block alone: a graph for the first size, one with a dynamic token count for the rest,
    whatever the blocks' stochastic-depth rates (constants inside one graph)."""
    assert _graphs_for_sizes(per_block=True, monkeypatch=monkeypatch, scope="stack") == 2
    assert _graphs_for_sizes(per_block=True, monkeypatch=monkeypatch, scope="stack", drop_path_rate=0.1) == 2


def test_stack_scope_with_timms_grad_checkpointing_compiles_the_blocks(monkeypatch: pytest.MonkeyPatch):
    """`model.grad_checkpointing=true` (timm's `checkpoint_seq`) calls the container's blocks one by one and never
    the container: `compile_scope=stack` compiles the blocks instead, which that loop does call."""
    seen: list[nn.Module] = []
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kw: seen.append(self))
    net = timm.create_model(
        "vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=2, num_classes=4
    )
    net.set_grad_checkpointing(True)
    parallelize(net, None, compile=True, compile_scope="stack")
    assert seen == list(net.blocks)


def test_stack_scope_finds_the_blocks_container_or_falls_back_to_blocks(monkeypatch: pytest.MonkeyPatch):
    """The stack is the `nn.Sequential` holding exactly the alike blocks (with activation checkpointing, their
    wrappers); a hybrid ViT's stem stays out; a model whose blocks sit in a `ModuleList` its forward loops over
    gets each block compiled, with a warning."""
    from vitrain.distributed.parallelize import unit_stack

    seen: list[nn.Module] = []
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kw: seen.append(self))
    net = _hybrid_vit()
    assert unit_stack(net, transformer_blocks(net)) is net.blocks
    parallelize(net, None, compile=True, compile_scope="stack", activation_checkpointing=True)
    assert seen == [net.blocks] and all(type(b).__name__ == "CheckpointWrapper" for b in net.blocks)

    class Looped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.GELU()) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    seen.clear()
    looped = Looped()
    assert unit_stack(looped, transformer_blocks(looped)) is None
    parallelize(looped, None, compile=True, compile_scope="stack")
    assert seen == list(looped.layers)


def _hybrid_vit() -> nn.Module:
    """experiment=cifar_cpu's kind of network, small: timm's convolutional stem (conv layers of growing width,
    which `shard_units` also lists as units), then three alike blocks."""
    from timm.layers import HybridEmbed
    from timm.models.vision_transformer_hybrid import ConvStem

    stem = ConvStem(in_chans=3, depth=3, channels=[8, 16, 32], kernel_size=3, stride=[1, 2, 2])
    return timm.create_model(
        "vit_tiny_patch16_224", img_size=16, patch_size=1, embed_dim=32, depth=3, num_heads=2, num_classes=4,
        embed_layer=partial(HybridEmbed, backbone=stem, proj=False), class_token=False, global_pool="avg",
    )  # fmt: skip


def test_compile_per_block_takes_the_alike_blocks_not_a_hybrid_stem(monkeypatch: pytest.MonkeyPatch):
    """`compile_scope=blocks` on a hybrid ViT: the three blocks share one graph; the stem's layers, each of its
    own width, stay eager (compiled, each was a graph of its own: cifar_cpu's network stepped at 0.56x its
    eager speed)."""
    from torch._dynamo.utils import counters

    compile_ = nn.Module.compile
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kw: compile_(self, backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    net = _hybrid_vit()
    units = transformer_blocks(net)
    assert len(units) > 3  # the stem's layers are units (for sharding)
    assert twin_units(units) == list(net.blocks)
    parallelize(net, None, compile=True, compile_scope="blocks")
    for _ in range(2):
        net(torch.randn(2, 3, 16, 16)).sum().backward()
    assert counters["stats"]["unique_graphs"] == 1
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in net.blocks)
    assert getattr(net.patch_embed, "_compiled_call_impl", None) is None
    torch._dynamo.reset()


def test_compile_scope_is_checked_in_one_line():
    """A value that is no scope, and `network` under FSDP (whose hooks sit between the blocks), refused."""
    from vitrain.models.classifier import ImageClassifier

    net, opt = {"model_name": "vit_tiny_patch16_224"}, {"_target_": "torch.optim.AdamW"}
    with pytest.raises(
        ModelError, match=r"model\.compile_scope='all' must be one of auto, network, blocks, stack"
    ):
        ImageClassifier(net=net, optimizer=opt, compile_scope="all")
    model = ImageClassifier(net=net, optimizer=opt, compile=True, compile_scope="network")
    with pytest.raises(ModelError, match=r"model\.compile_scope=network with trainer=fsdp"):
        model.check_strategy(_strategy("cuda", sharded=True))
    model.check_strategy(_strategy("cuda"))  # one GPU: as asked
    # the stack, under FSDP where the blocks are one group sharded as their container (`auto_scope`)
    ImageClassifier(net=net, optimizer=opt, compile=True, compile_scope="stack").check_strategy(
        _strategy("cuda", sharded=True)
    )


def test_auto_scope_under_fsdp_compiles_what_fsdp_hooks_as_one_group():
    """`compile_scope=auto`: on one device the network (blocks with progressive resizing); under FSDP the blocks'
    container where all blocks are one group sharded as it (one graph with FSDP's hooks around it), else each
    block: groups of several, activation checkpointing, or a model that loops over its container itself."""
    from vitrain.distributed.parallelize import auto_scope

    net = timm.create_model(
        "vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=4, num_heads=2, num_classes=4
    )
    units = transformer_blocks(net)
    block = sum(p.numel() for p in net.blocks[0].parameters())
    assert auto_scope(net, units, False, False, 0, False) == "network"
    assert auto_scope(net, units, False, True, 0, False) == "stack"  # progressive resizing: the container
    assert auto_scope(net, units, True, False, 10**9, False) == "stack"
    assert auto_scope(net, units, True, True, 10**9, False) == "stack"  # resizable as blocks are
    assert auto_scope(net, units, True, False, 0, False) == "blocks"  # a group per block
    assert auto_scope(net, units, True, False, 2 * block, False) == "blocks"  # two groups of two
    assert auto_scope(net, units, True, False, 10**9, True) == "blocks"  # activation checkpointing

    class Looping(nn.Module):  # timm's NaFlexViT's way: the container iterated, never called
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.GELU()) for _ in range(3)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    looping = Looping()
    assert auto_scope(looping, transformer_blocks(looping), True, False, 10**9, False) == "blocks"


def test_compile_mode_reaches_torch_compile_and_is_checked(monkeypatch: pytest.MonkeyPatch):
    """`model.compile_mode` is torch.compile's mode for the network or each block; an unknown mode, and CUDA
    graphs under FSDP (which gathers the weights anew every step), refused in one line."""
    from vitrain.models.classifier import ImageClassifier

    seen: list[dict] = []
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kw: seen.append(kw))
    parallelize(_hybrid_vit(), None, compile=True, compile_mode="reduce-overhead")
    assert seen == [{"mode": "reduce-overhead"}]  # the whole network, once
    seen.clear()
    parallelize(_hybrid_vit(), None, compile=True, compile_scope="blocks", compile_mode="max-autotune")
    assert seen == [{"mode": "max-autotune"}] * 3  # each of the three blocks
    seen.clear()
    parallelize(_hybrid_vit(), None, compile=True)
    assert seen == [{}]  # torch.compile's own default

    net, opt = {"model_name": "vit_tiny_patch16_224"}, {"_target_": "torch.optim.AdamW"}
    with pytest.raises(
        ModelError, match=r"model\.compile_mode='fast' must be null or one of default, reduce-"
    ):
        ImageClassifier(net=net, optimizer=opt, compile_mode="fast")
    model = ImageClassifier(net=net, optimizer=opt, compile=True, compile_mode="reduce-overhead")
    with pytest.raises(
        ModelError, match=r"model\.compile_mode=reduce-overhead with trainer=fsdp: CUDA graphs"
    ):
        model.check_strategy(_strategy("cuda", sharded=True))
    model.check_strategy(_strategy("cuda"))  # one GPU: CUDA graphs as asked
    ImageClassifier(
        net=net, optimizer=opt, compile=True, compile_mode="max-autotune-no-cudagraphs"
    ).check_strategy(_strategy("cuda", sharded=True))
    marks: list[int] = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    monkeypatch.setattr("vitrain.models.classifier.should_update_logs", lambda trainer: False)  # no loop here
    tiny = {**net, "img_size": 32, "patch_size": 8, "num_classes": 4}
    for mode, expected in (("reduce-overhead", 1), (None, 0)):
        marks.clear()
        model = ImageClassifier(net=tiny, optimizer=opt, compile_mode=mode)
        model.trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
        model.training_step((torch.randn(2, 3, 32, 32), torch.tensor([0, 1])), 0)
        assert len(marks) == expected  # each training step starts a new step of the CUDA graph trees


def test_drop_path_keeps_timms_semantics():
    """Per sample: the whole residual branch kept and scaled by 1/keep, or zeroed; identity in evaluation; the
    rates as timm spread them, each block's in its own module; checkpoints keep their keys."""
    from timm.layers import DropPath as TimmDropPath

    from vitrain.distributed.drop_path import DropPath, uniform_drop_paths

    net = timm.create_model("vit_tiny_patch16_224", depth=4, drop_path_rate=0.3, num_classes=4)
    rates = [b.drop_path1.drop_prob if isinstance(b.drop_path1, TimmDropPath) else 0.0 for b in net.blocks]
    keys = list(net.state_dict())
    assert uniform_drop_paths(list(net.blocks)) == 8  # drop_path1/2 of 4 blocks, the first two Identity
    assert [b.drop_path1.keep_prob.item() for b in net.blocks] == pytest.approx([1 - r for r in rates])
    assert list(net.state_dict()) == keys
    drop = DropPath(0.25).train()
    torch.manual_seed(0)
    x = torch.randn(20_000, 3, 2) + 5
    out = drop(x)
    kept = (out != 0).all(dim=(1, 2))
    assert ((out == 0).all(dim=(1, 2)) | kept).all()  # whole samples, never part of one
    torch.testing.assert_close(out[kept], x[kept] / 0.75)
    assert abs(kept.float().mean().item() - 0.75) < 0.015  # 6 sigma of a binomial over 20,000
    assert drop.eval()(x) is x
    assert (DropPath(0.0).train()(x) == x).all()


def test_pin_memory_auto_follows_the_trainer_device():
    dm = ImageDataModule(data_dir="x", cache_dir="y")
    assert dm.pin_memory() is False  # no trainer yet
    dm.trainer = SimpleNamespace(strategy=_strategy("cuda"))
    assert dm.pin_memory() is True
    dm.trainer = SimpleNamespace(strategy=_strategy("cpu"))
    assert dm.pin_memory() is False
    dm.hparams.pin_memory = "sometimes"
    with pytest.raises(DataError, match=r"datamodule\.pin_memory='sometimes' must be true, false or auto"):
        dm.pin_memory()


@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "vit_base_patch32_224", "deit_tiny_patch16_224"])
def test_patch_conv_as_matmul_computes_the_same_function(name: str):
    torch.manual_seed(0)
    net = timm.create_model(name, num_classes=10)
    plain = timm.create_model(name, num_classes=10)
    plain.load_state_dict(net.state_dict())
    keys = list(net.state_dict())
    assert patch_convs_as_matmuls(net) == 1 and isinstance(net.patch_embed.proj, PatchConv2d)
    assert list(net.state_dict()) == keys  # checkpoints are unchanged
    x = torch.randn(2, 3, 224, 224)
    out, ref = net(x), plain(x)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    out.square().sum().backward()
    ref.square().sum().backward()
    torch.testing.assert_close(
        net.patch_embed.proj.weight.grad, plain.patch_embed.proj.weight.grad, rtol=1e-3, atol=1e-4
    )
    # overlapping or small-kernel convolutions (a ConvNeXt stem of 4x4/4, a ResNet) stay convolutions
    assert patch_convs_as_matmuls(timm.create_model("convnext_atto")) == 0
    assert patch_convs_as_matmuls(timm.create_model("resnet18")) == 0


def test_patch_conv_falls_back_on_sizes_that_do_not_divide():
    conv = nn.Conv2d(3, 8, kernel_size=8, stride=8)
    ref = nn.Conv2d(3, 8, kernel_size=8, stride=8)
    ref.load_state_dict(conv.state_dict())
    patch_convs_as_matmuls(conv)
    for size in (32, 36):  # 36 is no multiple of 8: the convolution drops the remainder
        x = torch.randn(1, 3, size, size)
        torch.testing.assert_close(conv(x), ref(x), rtol=1e-4, atol=1e-5)


def test_compiled_kernels_are_kept_in_the_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    keep_compiled_kernels(compose_cfg("train", [f"paths.cache_dir={tmp_path}"], tmp_path / "run"))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "torch_compile")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")  # the environment's word wins
    keep_compiled_kernels(compose_cfg("train", [f"paths.cache_dir={tmp_path}"], tmp_path / "run"))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/elsewhere"


def test_mfu_note_names_the_real_reason():
    assert "no run_stats.json" in mfu_note({}, {})
    assert "no ImageThroughputMonitor" in mfu_note({}, {"fit": {}})
    flops = {
        "device": "NVIDIA H100 80GB HBM3",
        "train_flops_per_image": 2.6e10,
        "peak_flops_per_device": 989e12,
    }
    assert "could not be counted" in mfu_note({**flops, "train_flops_per_image": None}, {"fit": {}})
    assert "no peak FLOPs known for NVIDIA H100" in mfu_note({**flops, "peak_flops_per_device": None}, {})
    # the case the H100 report got wrong (issue 30): the peak was known, the window had not filled
    short = mfu_note({**flops, "window_batches": 50}, {"fit": {"global_step": 43}})
    assert short == "the run trained 43 steps, fewer than the throughput window (50 batches)"


def test_a_short_run_reports_images_per_s_and_mfu_with_its_first_step_apart(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path
):
    """7 steps with the default 50-batch window: the window shrinks to half the epoch, the figures are computed
    at the epoch's last batch, and the first step (compile, warm-up) is reported apart."""
    overrides = [
        *tiny_overrides(tiny_cifar, data_cache),
        "trainer.limit_train_batches=7",
        "trainer.limit_val_batches=1",
        "trainer.log_every_n_steps=50",
        "test=false",
        "callbacks.throughput.peak_flops=1e12",  # a CPU has no known peak: give one, as a user may
        "logger=none",
    ]
    train(compose_cfg("train", overrides, tmp_path))
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["flops"]["window_batches"] == 3
    assert report["throughput_monitor_images_per_s"] > 0
    assert 0 < report["mfu"] < 1 and report["mfu_note"] is None
    assert report["first_step_s"] > 0 and report["images_per_s_after_first_step"] > 0
    text = (tmp_path / "report.md").read_text()
    assert "steady state" in text and "first step" in text
    assert report["config"]["model.progressive_resize.start_size"] is None and "progressive" not in text


def test_throughput_line_says_when_progressive_resizing_trained_smaller_images():
    """A run that grows its input size reports a last-window figure below its average: the line says why."""
    figures = {"throughput_monitor_images_per_s": 1018.0, "throughput_images_per_s": 1164.0, "first_step_s": 0.15,
               "images_per_s_after_first_step": 1237.0}  # fmt: skip
    plain = _throughput({**figures, "config": {"model.progressive_resize.start_size": None}})
    resized = _throughput({**figures, "config": {"model.progressive_resize.start_size": 16}})
    assert "progressive" not in plain
    assert (
        "1164 images/s over all training batches (progressive resizing: the early steps trained smaller"
        in (resized)
    )


def test_float8_trains_and_its_checkpoint_loads_into_a_plain_network(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path
):
    """`model.float8=true`: torchao's Float8Linear takes the blocks' linear layers (not the head) and trains
    under bf16 autocast (on the CPU with torch's float8 matmul); testing and eval.py evaluate it (under
    no_grad: float8 tensors have no inference-mode path with autocast); the checkpoint holds the plain
    network's keys and loads into a network built without float8."""
    from torchao.float8.float8_linear import Float8Linear

    from vitrain.tasks.evaluation import evaluate

    overrides = [
        *tiny_overrides(tiny_cifar, data_cache),
        "trainer.precision=bf16-mixed",
        "model.float8=true",
        "trainer.limit_train_batches=3",
        "trainer.limit_val_batches=1",
        "+trainer.limit_test_batches=1",
        "logger=none",
    ]
    metrics, objects = train(compose_cfg("train", overrides, tmp_path))
    assert "test/acc1" in metrics
    evaluated, _ = evaluate(
        compose_cfg("eval", [f"ckpt_path={objects.best_model_path}", "split=val"], tmp_path / "eval")
    )
    assert 0 <= evaluated["val/acc1"] <= 1
    net = objects.model.net
    converted = [name for name, m in net.named_modules() if isinstance(m, Float8Linear)]
    assert converted and all(".mlp." in n or ".attn." in n for n in converted)
    assert not isinstance(net.get_classifier(), Float8Linear)
    assert 0 < metrics["val/loss"] < 100  # trained and evaluated to a finite loss
    state = torch.load(objects.best_model_path, map_location="cpu", weights_only=False)["state_dict"]
    plain_net = timm.create_model(
        "vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2,
        num_classes=net.num_classes,
    )  # fmt: skip
    plain_net.load_state_dict({k.removeprefix("net."): v for k, v in state.items() if k.startswith("net.")})


def test_float8_is_refused_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch):
    from vitrain.models.classifier import ImageClassifier
    from vitrain.models.float8 import convert_to_float8, float8_refusal

    assert float8_refusal(torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert "A100-SXM4-80GB has 8.0: leave model.float8=false" in float8_refusal(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert float8_refusal(torch.device("cuda", 0)) is None
    with pytest.raises(ModelError, match="no linear layer with both dims multiples of 16"):
        convert_to_float8(nn.Sequential(nn.Linear(10, 6)))
    with pytest.raises(ModelError, match=r"model\.float8='yes' must be true or false"):
        ImageClassifier(net={"model_name": "vit_tiny_patch16_224"}, optimizer={"_target_": "torch.optim.AdamW"},
                        float8="yes")  # fmt: skip


NVML_PROBE = """
import ctypes, json, os, sys
import lightning, torch  # Lightning turns torch's NVML-based CUDA check on
from vitrain.utils.cuda_check import NVML_CHECK, skip_failing_nvml_check

try:
    ctypes.CDLL("libnvidia-ml.so.1")
    nvml = True
except OSError:
    nvml = False
loads = []
real_cdll = ctypes.CDLL
ctypes.CDLL = lambda name, *a, **k: (loads.append(name), real_cdll(name, *a, **k))[1]
net = torch.nn.Linear(4, 2)
opt = torch.optim.AdamW(net.parameters(), fused=True)

def step():
    net(torch.randn(3, 4)).sum().backward()
    opt.step()

before = os.environ[NVML_CHECK]
step()
per_step_before = len(loads)
skipped = skip_failing_nvml_check()
loads.clear()
step()
print(json.dumps({"nvml": nvml, "before": before, "loads_before": per_step_before, "skipped": skipped,
                  "after": os.environ[NVML_CHECK], "loads_after": len(loads),
                  "cuda": torch.cuda.is_available()}))
"""


def test_no_failing_nvml_load_per_optimizer_step_without_a_driver():
    """Lightning's NVML-based CUDA check loads `libnvidia-ml` at every AdamW step; where it cannot load
    (no NVIDIA driver) the harness turns the check off: the same answer, no load per step."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)  # as a user's shell has it: Lightning's import sets it
    out = subprocess.run(
        [sys.executable, "-c", NVML_PROBE], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["before"] == "1"
    if seen["nvml"]:  # a host with NVML (a driver): the check is cheap there and stays on
        assert not seen["skipped"] and seen["after"] == "1"
        return
    assert seen["loads_before"] >= 1, "torch no longer loads NVML per step: the skip may be dropped"
    assert seen["after"] == "0" and seen["loads_after"] == 0
    assert seen["cuda"] is False


# host reads of a tensor's value: on a GPU each waits for the queue to drain (a sync)
HOST_READS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "aten::equal")
# ops whose CPU kernels read their scalar arguments themselves; their CUDA kernels read them on the device
CPU_KERNEL_READS = ("aten::_fused_adamw_", "aten::_fused_adam_", "aten::_fused_sgd_")


@pytest.mark.parametrize(
    "strategy", [[], ["trainer=fsdp", "trainer.devices=1"]], ids=["single_device", "fsdp_one_process"]
)
def test_training_steps_read_no_tensor_value_on_the_host_between_log_steps(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path, strategy: list[str]
):
    """Everything between two training batch ends (the fetch, augmentation, step, optimizer, every default
    callback and the logger) reads no tensor value on the host, on the steps Lightning writes no logs:
    each such read would be a sync per step on a GPU. What a CPU shows: the same Python, torch.profiler's
    record of the reads (`.item()`, `bool(t)`, `nonzero`), the CPU optimizer kernels' own reads of their step
    counts left out. The GPU's own sync check is bench/gpu_check.py's `sync_probe`. Under FSDP too (its hooks,
    the optimizer on the local shards): FSDP's longer steps on a GPU (docs/gpu.md) are not host reads."""
    from lightning.pytorch.callbacks import Callback
    from omegaconf import open_dict
    from torch.profiler import ProfilerActivity, profile

    class RecordReads(Callback):
        def __init__(self) -> None:
            self.profiler: Any = None
            self.reads: list[tuple[int, str, list[str]]] = []
            self.kernel_reads = 0
            self.steps = 0

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if self.profiler is not None:
                self.profiler.__exit__(None, None, None)
                self.steps += 1
                for event in self.profiler.events():
                    if event.name not in HOST_READS:
                        continue
                    parents, parent = [], event.cpu_parent
                    while parent is not None:
                        parents.append(parent.name)
                        parent = parent.cpu_parent
                    if set(parents) & set(CPU_KERNEL_READS):
                        self.kernel_reads += 1
                    else:
                        self.reads.append((trainer.global_step, event.name, parents[:4]))
                self.profiler = None
            if 3 <= trainer.global_step < 9:
                self.profiler = profile(activities=[ProfilerActivity.CPU])
                self.profiler.__enter__()

    recorder = RecordReads()
    overrides = [*tiny_overrides(tiny_cifar, data_cache), "trainer.log_every_n_steps=100",
                 "+trainer.limit_train_batches=12", "trainer.limit_val_batches=1", "test=false", *strategy]  # fmt: skip
    cfg = compose_cfg("train", overrides, tmp_path)
    with open_dict(cfg):
        cfg.callbacks["record_reads"] = {"_target_": f"{__name__}._recorder"}
    global _RECORDER
    _RECORDER = recorder
    train(cfg)
    assert recorder.steps == 6
    assert (
        recorder.kernel_reads > 0
    )  # the profiler sees reads: fused AdamW's CPU kernel reads its step counts
    assert recorder.reads == []


_RECORDER: Any = None


def _recorder() -> Any:
    """The config's handle on the test's live callback."""
    return _RECORDER


FREEZE_CHECK = """
import gc, weakref
from vitrain.utils.host_memory import freeze_startup_heap

gc.disable()  # no automatic collection frees the cycle below: only the one before the freeze may


class Node:
    pass

a, b = Node(), Node()
a.other, b.other = b, a  # a reference cycle: garbage once dropped, freed only by a collection
gone = weakref.ref(a)
del a, b
kept = [Node() for _ in range(1000)]
assert freeze_startup_heap()
assert gone() is None, "the cycle was frozen instead of collected"
count = gc.get_freeze_count()
assert count >= 1000, count
tracked = {id(o) for o in gc.get_objects()}  # what a full collection traverses
assert not any(id(o) in tracked for o in kept), "a start-up object is still traversed"
assert not freeze_startup_heap() and gc.get_freeze_count() == count, "frozen twice"
print("ok")
"""


def test_start_up_heap_is_collected_then_frozen_once():
    """A run's start-up objects leave the full collections (vitrain/utils/host_memory.py), after one collection
    (garbage is not frozen for good) and once a process. A new interpreter: a warm one is frozen already."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    done = subprocess.run([sys.executable, "-c", FREEZE_CHECK], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
