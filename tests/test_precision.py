"""`trainer.precision=auto`: the decision on given capabilities, and torch's own answer on this machine."""

import math
import os
import platform
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, compose_cfg, tiny_overrides
from vitrain.compat import mkldnn_bf16_supported
from vitrain.errors import UserError
from vitrain.tasks import precision
from vitrain.tasks.precision import (
    SPEEDUP_ENV,
    choose_precision,
    cpu_bf16_choice,
    cpu_bf16_support,
    resolve_precision,
)


def test_decision_on_injected_capabilities():
    assert choose_precision("cuda", cuda_capability=(9, 0)) == "bf16-mixed"
    assert choose_precision("cuda", cuda_capability=(8, 0)) == "bf16-mixed"
    assert choose_precision("cuda", cuda_capability=(7, 5)) == "16-mixed"
    # Lightning's ModelParallelStrategy (FSDP2) refuses 16-mixed
    assert choose_precision("cuda", cuda_capability=(7, 0), sharded=True) == "32-true"
    assert choose_precision("cuda", cuda_capability=(8, 6), sharded=True) == "bf16-mixed"
    assert choose_precision("cpu", cpu_bf16=True) == "bf16-mixed"
    assert choose_precision("cpu", cpu_bf16=False) == "32-true"
    assert choose_precision("mps") == "32-true"


def test_explicit_value_wins_and_auto_follows_torch(tmp_path, monkeypatch):
    """`auto` on this machine: the expectation is this CPU's own measurement, taken once here; every later
    decision reads that kept value back, so none can fall on the other side of the threshold."""
    assert resolve_precision({"precision": "16-mixed", "accelerator": "cpu"}) == "16-mixed"
    assert resolve_precision({"precision": 32, "accelerator": "cpu"}) == 32
    native, why = cpu_bf16_support()
    caps = torch.cpu.get_capabilities()
    if native:  # hardware bf16 instructions that oneDNN may use
        assert caps.get("avx512_bf16") or caps.get("amx_bf16") or caps.get("bf16") or caps.get("sve_bf16")
        assert mkldnn_bf16_supported()
    monkeypatch.delenv(SPEEDUP_ENV, raising=False)  # measured here, not taken from elsewhere
    faster, why = cpu_bf16_choice()
    assert faster <= native, why  # never bf16 where it is emulated
    kept = os.environ.get(SPEEDUP_ENV)
    if native:  # the decision is the kept value's, and so is every later one (no second probe)
        assert faster == (float(kept) >= precision.MIN_CPU_BF16_SPEEDUP) and f" {kept}x fp32" in why
    else:
        assert kept is None  # no probe where bf16 is emulated
    expected = "bf16-mixed" if faster else "32-true"
    cfg = compose_cfg("train", ["trainer=cpu"], tmp_path)
    assert cfg.trainer.precision == "auto"  # the default trainer's
    assert resolve_precision(cfg.trainer) == expected, why
    fsdp = compose_cfg("train", ["trainer=fsdp", "trainer.accelerator=cpu"], tmp_path)
    assert resolve_precision(fsdp.trainer) == expected
    assert os.environ.get(SPEEDUP_ENV) == kept
    shipped = compose_cfg("train", ["experiment=cifar_cpu"], tmp_path)
    assert shipped.trainer.precision == "auto" and shipped.model.scheduler.follow_max_time


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="ONEDNN_MAX_CPU_ISA caps x86 ISAs")
def test_auto_is_fp32_where_onednn_has_no_bf16():
    """With oneDNN capped at AVX2 (as on a CPU without AVX-512), torch reports no usable bf16: auto is fp32."""
    code = (
        "from vitrain.tasks.precision import cpu_bf16_support, resolve_precision\n"
        "print(cpu_bf16_support()[0], resolve_precision({'precision': 'auto', 'accelerator': 'cpu'}))"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "32-true"]


def test_native_bf16_is_chosen_only_where_it_measures_faster(monkeypatch):
    """Native bf16 instructions are no promise of speed (bf16 matmuls ran at 0.5x fp32 on an Intel Xeon with
    AVX-512 BF16): the probe decides, once per launch, and its result reaches the ranks through the environment."""
    speedup = precision.cpu_bf16_speedup(m=256, k=64, n=128, rounds=2)
    assert math.isfinite(speedup) and speedup > 0
    monkeypatch.setattr(precision, "cpu_bf16_support", lambda: (True, "a CPU with native bf16"))
    monkeypatch.delenv(SPEEDUP_ENV, raising=False)
    measured, why = cpu_bf16_choice()  # measures here, and leaves the result for the ranks and later calls
    kept = os.environ[SPEEDUP_ENV]
    assert measured == (float(kept) >= precision.MIN_CPU_BF16_SPEEDUP) and f" {kept}x fp32" in why
    assert cpu_bf16_choice() == (measured, why)  # a later call (or a rank) reads the same value back
    auto = {"precision": "auto", "accelerator": "cpu"}
    monkeypatch.setenv(SPEEDUP_ENV, "0.5")
    assert cpu_bf16_choice() == (False, "a CPU with native bf16, but its bf16 matmuls run at 0.5x fp32 here")
    assert resolve_precision(auto) == "32-true"
    monkeypatch.setenv(SPEEDUP_ENV, "2.4")
    assert cpu_bf16_choice()[0] and resolve_precision(auto) == "bf16-mixed"
    monkeypatch.setenv(SPEEDUP_ENV, "fast")
    with pytest.raises(UserError, match=f"{SPEEDUP_ENV}='fast' is not a positive number"):
        resolve_precision(auto)
    # emulated bf16 is never chosen, whatever the environment says, and no probe runs
    monkeypatch.setattr(precision, "cpu_bf16_support", lambda: (False, "a CPU without bf16"))
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: pytest.fail("probed where bf16 is emulated"))
    monkeypatch.delenv(SPEEDUP_ENV)
    assert cpu_bf16_choice() == (False, "a CPU without bf16") and resolve_precision(auto) == "32-true"


@pytest.mark.parametrize("probed", [0.0149, 0.015, 0.0152, 0.004, 1.195, 1.1996, 1.2, 1.2004, 2.4])
def test_first_call_decides_and_reports_what_it_keeps(monkeypatch, probed):
    """The launching process's first call (which measures) and every later reader (the ranks, later calls)
    make the same decision and print the same number, whatever side of a rounding boundary the probe fell on."""
    monkeypatch.setattr(precision, "cpu_bf16_support", lambda: (True, "a CPU with native bf16"))
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: probed)
    monkeypatch.delenv(SPEEDUP_ENV, raising=False)
    first = cpu_bf16_choice()
    kept = os.environ[SPEEDUP_ENV]
    assert float(kept) > 0 and f" {kept}x fp32" in first[1]
    assert first[0] == (float(kept) >= precision.MIN_CPU_BF16_SPEEDUP)
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: pytest.fail("measured twice"))
    assert cpu_bf16_choice() == first
    assert precision.measured_cpu_bf16_speedup() == float(kept)


@pytest.mark.parametrize(
    "chosen, dtype", [("bf16-true", torch.bfloat16), ("16-true", torch.float16), ("64-true", torch.float64)]
)
def test_true_precisions_train_test_and_predict(chosen, dtype, tmp_path, tiny_cifar, data_cache):
    """`trainer.precision=bf16-true` (16-true, 64-true): the weights in that dtype, and the images, made float
    on the device after Lightning converted the (uint8) batch, in it too: the run trains, tests and saves
    weights of that dtype, and predict.py classifies with them."""
    from vitrain.tasks.prediction import predict
    from vitrain.tasks.training import train

    overrides = [*tiny_overrides(tiny_cifar, data_cache), f"trainer.precision={chosen}", "logger=none"]
    metrics, objects = train(compose_cfg("train", overrides, tmp_path / "run"))
    assert math.isfinite(metrics["test/loss"]) and 0 <= metrics["test/acc1"] <= 1
    weights = torch.load(objects.best_model_path, weights_only=True)["state_dict"]
    assert {w.dtype for k, w in weights.items() if k.endswith(".weight")} == {dtype}
    ckpt = [
        f"ckpt_path={objects.best_model_path}",
        f"inputs={tiny_cifar / 'test'}",
        f"trainer.precision={chosen}",
    ]
    predicted, _ = predict(compose_cfg("predict", ckpt, tmp_path / "predict"))
    assert predicted["images"] == 40 and 0 <= predicted["acc1"] <= 1
    assert len((tmp_path / "predict" / "predictions.csv").read_text().splitlines()) == 41
