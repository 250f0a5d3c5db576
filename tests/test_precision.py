"""`trainer.precision=auto`: the decision on given capabilities, and torch's own answer on this machine."""

import os
import platform
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, compose_cfg
from vitrain.compat import mkldnn_bf16_supported
from vitrain.precision import choose_precision, cpu_bf16_support, resolve_precision


def test_decision_on_injected_capabilities():
    assert choose_precision("cuda", cuda_capability=(9, 0)) == "bf16-mixed"
    assert choose_precision("cuda", cuda_capability=(8, 0)) == "bf16-mixed"
    assert choose_precision("cuda", cuda_capability=(7, 5)) == "16-mixed"
    # Lightning's ModelParallelStrategy (FSDP2) refuses 16-mixed
    assert choose_precision("cuda", cuda_capability=(7, 0), sharded=True) == "32-true"
    assert choose_precision("cuda", cuda_capability=(8, 6), sharded=True) == "bf16-mixed"
    assert choose_precision("cpu", cpu_native_bf16=True) == "bf16-mixed"
    assert choose_precision("cpu", cpu_native_bf16=False) == "32-true"
    assert choose_precision("mps") == "32-true"


def test_explicit_value_wins_and_auto_follows_torch(tmp_path):
    assert resolve_precision({"precision": "16-mixed", "accelerator": "cpu"}) == "16-mixed"
    assert resolve_precision({"precision": 32, "accelerator": "cpu"}) == 32
    native, why = cpu_bf16_support()
    caps = torch.cpu.get_capabilities()
    if native:  # hardware bf16 instructions that oneDNN may use
        assert caps.get("avx512_bf16") or caps.get("amx_bf16") or caps.get("bf16") or caps.get("sve_bf16")
        assert mkldnn_bf16_supported()
    expected = "bf16-mixed" if native else "32-true"
    cfg = compose_cfg("train", ["trainer=cpu"], tmp_path)
    assert cfg.trainer.precision == "auto"  # the default trainer's
    assert resolve_precision(cfg.trainer) == expected, why
    fsdp = compose_cfg("train", ["trainer=fsdp", "trainer.accelerator=cpu"], tmp_path)
    assert resolve_precision(fsdp.trainer) == expected
    shipped = compose_cfg("train", ["experiment=cifar_cpu"], tmp_path)
    assert shipped.trainer.precision == "auto" and shipped.model.scheduler.follow_max_time


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="ONEDNN_MAX_CPU_ISA caps x86 ISAs")
def test_auto_is_fp32_where_onednn_has_no_bf16():
    """With oneDNN capped at AVX2 (as on a CPU without AVX-512), torch reports no usable bf16: auto is fp32."""
    code = (
        "from vitrain.precision import cpu_bf16_support, resolve_precision\n"
        "print(cpu_bf16_support()[0], resolve_precision({'precision': 'auto', 'accelerator': 'cpu'}))"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "32-true"]
