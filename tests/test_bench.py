"""Every benchmark script runs in its `--smoke` mode on the tiny generated data set and writes well-formed
JSON; the renderer turns such JSON into the Markdown table. No timing is asserted: smoke runs measure
nothing (`met` stays null)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from warm import run_script

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

from run import SUITE, carry_notes  # noqa: E402

MULTI_PROCESS = {"ddp_scaling", "fsdp_memory"}


def _smoke(name: str, out: Path, data: Path, cache: Path, *extra: str) -> dict:
    """`python bench/<name>.py --smoke ...`; the script runs warm (tests/warm.py), and so do the
    `python src/train.py` runs it starts where their environment allows (a real benchmark's are new
    interpreters); a smoke run measures nothing."""
    args = ["--smoke", "--out", str(out), "--data-dir", str(data), "--cache-dir", str(cache), *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    done = run_script([BENCH / f"{name}.py", *args], env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1].startswith(f"{name}: "), done.stdout[-500:]
    return json.loads((out / f"{name}.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.distributed) if n in MULTI_PROCESS else n for n in SUITE]
)
def test_benchmark_smoke_writes_json(name: str, tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    extra, work = [], tmp_path / "work"
    if name == "gpu":
        # a scratch folder an earlier call left, its compile cache in it, and no --compile-cache
        (work / "cache" / "torch_compile").mkdir(parents=True)
        (work / "cache" / "torch_compile" / "entry").write_text("x")
        extra = ["--work", str(work)]
    result = _smoke(name, tmp_path, tiny_cifar, data_cache, *extra)
    assert result["name"] == name and result["smoke"] is True and result["met"] is None
    assert isinstance(result["line"], str) and result["line"]
    assert isinstance(result["figures"], dict)
    for key in ("date", "command", "seconds", "load_before", "load_after"):
        assert key in result, key
    assert {"cpu", "cores", "torch", "lightning", "timm"} <= set(result["machine"])
    json.dumps(result)  # plain JSON all the way down
    if name == "accuracy":  # cifar_cpu evaluates with flip TTA; the same weights are also scored without
        assert 0 <= result["figures"]["test_acc1_no_tta_percent"] <= 100
    if name == "overhead":  # the host cost with the tiny network, and each callback's per-step hooks timed
        host = result["details"]["host_cost"]
        assert host["bare"]["template_steps_per_s"] > 0 and host["default"]["template_steps_per_s"] > 0
        assert {"ExactResume", "ImageThroughputMonitor", "ProgressBar"} <= set(host["hook_us"])
        assert all(us > 0 for us in host["hook_us"].values())
    if name == "gpu":  # the JSON says where the warm cache came from (it named a --compile-cache never given)
        assert (
            result["details"]["compile_cache_at_start"]
            == f"warm: 1 files from {work / 'cache'} (an earlier run)"
        )
        # on a CPU the backward runs on the training thread: no autograd thread, its CPU in the one figure
        sections = result["details"]["sections"]
        assert "figures" in sections["hand"] and "figures" in sections["seed"], sections
        for row in (sections["hand"]["figures"]["eager"], sections["seed"]["figures"]):
            assert row["backward_threads"] == 0 and row["backward_thread_ms_per_step"] is None
            assert row["host_ms_per_step"] > 0
        # the seed_ahead row augments its batches in a thread ahead: that thread's CPU apart; the seed's has none
        ahead = sections["seed_ahead"]["figures"]
        assert ahead["ahead_threads"] == 1 and ahead["ahead_thread_ms_per_step"] > 0
        assert sections["seed"]["figures"]["ahead_threads"] == 0
        # the training thread's stack sampled over the steps after the timed window (2 in a smoke), which
        # kept its 3 timed steps
        import gpu

        seed = sections["seed"]["figures"]
        stacks = seed["stacks"]
        assert stacks["hz"] == gpu.STACK_HZ and stacks["steps"] == 2 and seed["steps_timed"] == 3
        assert {"samples", "stages", "self", "inclusive", "template", "other_threads"} <= set(stacks)
        assert any(
            "(backward included) + " in line and " ahead |" in line for line in result["details"]["table_md"]
        )
    if name == "ddp_scaling":  # the step anatomy of both DDP ranks came from their own probes
        assert len(result["details"]["anatomy"]["two"]) == 2
        for variant in ("one", "two", "independent"):
            assert result["figures"][f"cpu_ms_per_step_{variant}"] > 0
            assert 0 <= result["figures"][f"off_cpu_share_{variant}"] < 1


def test_a_rerun_keeps_the_notes_beside_the_figures_it_replaces(tmp_path: Path):
    """`bench/run.py --only X` replaces X's results file whole: the notes earlier sessions wrote beside the
    figures (why a goal is missed, what changed) are carried into the new file, before its own."""
    path = tmp_path / "data_sources.json"
    path.write_text(json.dumps({"name": "data_sources", "line": "new", "notes": ["new note"]}))
    result = carry_notes(path, ["tenth session: ...", "eleventh session: ..."])
    assert result["notes"] == ["tenth session: ...", "eleventh session: ...", "new note"]
    assert json.loads(path.read_text()) == result
    assert carry_notes(path, [])["notes"] == result["notes"]  # a first run: the file as written
    # the script's own note of the run replaced goes: its figures were of that run
    flip = "flip TTA (model.tta_flip): the same checkpoint scores {} % without it"
    path.write_text(json.dumps({"name": "accuracy", "notes": [flip.format("81.94")]}))
    carried = carry_notes(path, ["a session's finding", flip.format("81.71")])["notes"]
    assert carried == ["a session's finding", flip.format("81.94")]


def test_machine_line_says_what_auto_chose_on_the_cpu():
    """Native bf16 that measured slower than fp32 is named as such, with the precision auto chose there."""
    from render import _bf16

    assert _bf16({"avx512_bf16": False, "cpu_native_bf16": False}) == "no native bf16: CPU runs 32-true"
    slower = {
        "avx512_bf16": True,
        "cpu_native_bf16": True,
        "cpu_bf16_speedup": 0.52,
        "cpu_auto_precision": "32-true",
    }
    assert _bf16(slower) == "native bf16 (AVX-512 BF16), bf16 matmuls at 0.52x fp32: CPU runs 32-true"
    faster = {**slower, "cpu_bf16_speedup": 2.4, "cpu_auto_precision": "bf16-mixed"}
    assert _bf16(faster).endswith("at 2.40x fp32: CPU runs bf16-mixed")
    # a result from before the probe: native bf16 was always chosen
    assert (
        _bf16({"avx512_bf16": True, "cpu_native_bf16": True})
        == "native bf16 (AVX-512 BF16): CPU runs bf16-mixed"
    )


def test_render_writes_a_table(tmp_path: Path):
    from render import load, render

    machine = {
        "cpu": "Test CPU",
        "cores": 2,
        "avx512_bf16": True,
        "memory_gb": 1.0,
        "gpu": None,
        "gpus": 0,
        "python": "3",
        "torch": "t",
        "lightning": "l",
        "timm": "m",
    }
    elsewhere = {**machine, "cpu": "Other CPU", "avx512_bf16": False}
    for name, met, where in (("overhead", True, machine), ("accuracy", False, elsewhere)):
        (tmp_path / f"{name}.json").write_text(
            json.dumps(
                {
                    "name": name,
                    "smoke": False,
                    "date": "2026-01-01 00:00 UTC",
                    "command": f"python bench/{name}.py",
                    "load_before": 0.1,
                    "load_after": 0.2,
                    "line": f"{name} figure",
                    "figures": {"x": 1.5, "y": None},
                    "goal": "a goal",
                    "met": met,
                    "notes": ["a note"],
                    "details": {"k": [1, 2]},
                    "seconds": 3.0,
                    "machine": where,
                }
            )
        )
    (tmp_path / "run.json").write_text(
        json.dumps(
            {
                "command": "make bench",
                "date": "2026-01-01 00:00 UTC",
                "seconds": 600.0,
                "load_before": 0.1,
                "load_after": 0.3,
            }
        )
    )
    doc = render(*load(tmp_path))
    assert "GENERATED" in doc and "make bench" in doc and "Test CPU, 2 cores" in doc
    assert "| overhead figure | a goal | met |" in doc
    assert "**not met**" in doc and "not measured" in doc and "> a note" in doc
    assert doc.index("1. Framework overhead") < doc.index("6. Accuracy")
    # a result from another machine than the header's names it; one from the header's does not repeat it
    assert "Measured 2026-01-01 00:00 UTC on Other CPU, 2 cores, no native bf16" in doc
    assert "Measured 2026-01-01 00:00 UTC in 3 s" in doc


def test_recipes_table_compares_only_rows_of_the_current_recipe(tmp_path: Path):
    import recipes

    doc = tmp_path / "recipes.md"
    doc.write_text(f"intro\n{recipes.START}\nold table\n{recipes.END}\noutro\n")
    row = {"stopped_by_max_time": True, "train_minutes": 10.1, "epochs": 8, "steps": 5893, "smoke": False}
    results = {
        "rows": {
            "recipe": {**row, "test_acc1_percent": 81.5, "recipe": "new", "date": "d1"},
            "batch_128": {**row, "test_acc1_percent": 80.0, "recipe": "new", "date": "d2"},
            "-conv_stem": {**row, "test_acc1_percent": 70.0, "recipe": "old", "date": "d3"},
            "+ema": {**row, "test_acc1_percent": 1.0, "smoke": True},
        }
    }
    recipes.render(results, doc, current="new")
    text = doc.read_text()
    assert text.startswith("intro\n") and text.endswith("\noutro\n") and "old table" not in text
    lines = {line.split("|")[1].strip(" `"): line for line in text.splitlines() if line.startswith("| `")}
    assert "| 80.00 | -1.50 | 10.1 (stopped by max_time) | 8 | 5893 | d2 |" in lines["batch_128"]
    assert "| 70.00 |  |" in lines["-conv_stem"] and "d3, on an earlier recipe" in lines["-conv_stem"]
    assert "not measured" in lines["+ema"] and "not measured" in lines["-label_smoothing"]
    assert (
        recipes.recipe_hash() == recipes.recipe_hash(recipes.EXPERIMENT) and len(recipes.recipe_hash()) == 12
    )


def test_gpu_kernels_are_classified_by_what_they_do():
    """A fused Triton kernel that casts (Inductor names it after its ops, `_to_copy` among them) is fused
    elementwise work, not a copy; an Inductor matmul template is a matmul; cuDNN's attention kernels (with
    "wgmma" in their names) are attention."""
    from probe import kernel_kind

    assert kernel_kind("triton_per_fused__to_copy_add_mul_native_layer_norm_backward_view_8") == (
        "triton (fused elementwise)"
    )
    assert kernel_kind("triton_tem_fused_addmm_gelu_3") == "matmul"
    assert kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26") == "attention"
    assert kernel_kind("nvjet_sm90_tst_192x128_64x5_1x2_h_bz_coopB_bias_TNT") == "matmul"
    assert kernel_kind("Memcpy HtoD (Pinned -> Device)") == "copy"
    assert kernel_kind("void at::native::elementwise_kernel<128, 2, direct_copy_kernel_cuda>") == "copy"
    assert kernel_kind("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "communication"
    assert kernel_kind("void at::native::vectorized_elementwise_kernel<4, GeluCUDAKernelImpl>") == "other"


def test_gpu_idle_names_the_host_ops_the_gpu_waited_for():
    """From a profile's events: the gaps between kernels (overlapping kernels of two streams merged, gaps under
    5 us ignored) and, per host op name, how much of them it overlapped, per step; no kernels, no figures."""
    from types import SimpleNamespace

    import torch
    from probe import gpu_idle

    def event(name: str, start: float, end: float, device: str = "CPU") -> SimpleNamespace:
        kind = getattr(torch.autograd.DeviceType, device)
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=kind)

    events = [
        event("gemm", 0, 100, "CUDA"), event("nccl", 90, 150, "CUDA"),  # one busy span 0-150
        event("gelu", 152, 160, "CUDA"),  # a 2 us gap: not idle
        event("gemm", 400, 500, "CUDA"), event("gemm", 700, 800, "CUDA"),  # idle 160-400 and 500-700
        event("Optimizer.step#AdamW.step", 0, 800),  # covers both gaps
        event("cudaStreamSynchronize", 150, 390),  # inside the first
        event("aten::index_select", 550, 600), event("aten::index_select", 650, 720),  # 50 + 50 of the second
        event("aten::mm", 0, 90),  # while the GPU was busy: not listed
    ]  # fmt: skip
    idle = gpu_idle(events, steps=2)
    assert idle["idle_ms_per_step"] == 0.22 and idle["gaps_per_step"] == 1.0  # (240 + 200) us over 2 steps
    assert idle["idle_share_of_span"] == round(440 / 800, 4)
    assert idle["host_ops_during_idle"] == [
        {"op": "Optimizer.step#AdamW.step", "ms_per_step": 0.22},
        {"op": "cudaStreamSynchronize", "ms_per_step": 0.115},
        {"op": "aten::index_select", "ms_per_step": 0.05},
    ]
    assert gpu_idle([event("aten::mm", 0, 90)], steps=1) == {}


def test_gpu_idle_says_which_host_thread_was_working():
    """Per host thread: the GPU's idle time it spent inside a top-level op (children counted once, with their
    parent), named by the op it spends most time in; the idle time no thread's op covered comes last."""
    from types import SimpleNamespace

    import torch
    from probe import gpu_idle

    def event(name: str, start: float, end: float, thread: int = 0, device: str = "CPU", parent: Any = None):
        kind = getattr(torch.autograd.DeviceType, device)
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=kind,
                               thread=thread, cpu_parent=parent)  # fmt: skip

    step = event("Optimizer.step#AdamW.step", 0, 300, thread=1)
    events = [
        event("gemm", 0, 100, device="CUDA"), event("gemm", 400, 500, device="CUDA"),  # idle 100-400
        step, event("aten::mm", 10, 90, thread=1, parent=step),  # the training thread: idle 100-300
        event("autograd::engine::evaluate_function: MmBackward0", 150, 250, thread=2),  # backward: 150-250
        event("autograd::engine::evaluate_function: MmBackward0", 240, 260, thread=2),  # overlaps the last
        event("aten::copy_", 200, 220, thread=2),  # a shorter op of the same thread
    ]  # fmt: skip
    threads = gpu_idle(events, steps=1)["threads_during_idle"]
    assert threads == [
        {"busiest_op": "Optimizer.step#AdamW.step", "idle_covered_ms_per_step": 0.2},
        {"busiest_op": "autograd::engine::evaluate_function: MmBackward0", "idle_covered_ms_per_step": 0.11},
        {"busiest_op": "(no host op)", "idle_covered_ms_per_step": 0.1},  # 300-400
    ]


def test_backward_threads_are_found_by_name_and_their_cpu_time_read():
    """torch runs a GPU backward on an autograd thread named `pt_autograd_<device>`: the probe finds this
    process's threads by that name (a thread named so here, not the others) and reads the CPU time each has
    used, the clock the thread itself reads with `time.thread_time`; a thread that is gone counts 0."""
    import threading
    import time

    from probe import backward_threads, threads_cpu_seconds

    named, done, seen = threading.Event(), threading.Event(), {}

    def worker() -> None:
        tid = threading.get_native_id()
        Path(f"/proc/self/task/{tid}/comm").write_text("pt_autograd_0")
        start = time.thread_time()
        while time.thread_time() - start < 0.05:  # CPU work of its own, however fast the machine
            pass
        seen.update(tid=tid, cpu=time.thread_time())
        named.set()
        done.wait(60)

    other = threading.Thread(target=done.wait, args=(60,))  # an unnamed thread: not a backward thread
    thread = threading.Thread(target=worker)
    other.start(), thread.start()
    try:
        assert named.wait(60)
        assert backward_threads() == [seen["tid"]]
        assert threads_cpu_seconds([seen["tid"]]) >= seen["cpu"] * 0.999 >= 0.05 * 0.999
        assert threads_cpu_seconds([seen["tid"], 2**31 - 1]) == threads_cpu_seconds([seen["tid"]])
    finally:
        done.set()
        thread.join(), other.join()
    # a joined thread's task can linger in /proc a moment (its id is cleared before the kernel reaps it)
    gone = Path(f"/proc/self/task/{seen['tid']}")
    for _ in range(1000):
        if not gone.exists():
            break
        time.sleep(0.01)
    assert backward_threads() == [] and threads_cpu_seconds([]) == 0.0


def _wait_in_known_place(stop: list[bool]) -> None:  # the sampled thread's only frame of its own
    while not stop[0]:  # a flag, not an Event: no call into threading's Python to be caught in
        time.sleep(0.001)


def test_stack_sampler_counts_where_the_training_thread_is():
    """The probe's stack sampler counts the Python line the target thread is at (here a sleep in a known
    function), by line, by function and by part of a training step; of the other threads it counts those
    that run Python, not one that waits for an event, and reads each one's CPU time over the window."""
    import threading

    from probe import StackSampler

    stop = threading.Event()

    def busy() -> None:  # Python work of its own, however fast the machine
        while not stop.is_set():
            sum(range(200))

    stop_target = [False]
    target = threading.Thread(target=_wait_in_known_place, args=(stop_target,))
    ahead = threading.Thread(target=busy, name="augment-ahead")
    idle = threading.Thread(target=stop.wait, name="idle")
    for t in (target, ahead, idle):
        t.start()
    sampler = StackSampler(target.ident, hz=500)
    try:
        sampler.start()
        for _ in range(6000):  # however slowly the machine samples: until 20 samples are in
            if sampler.samples >= 20:
                break
            time.sleep(0.01)
        summary = sampler.finish()
    finally:
        stop.set()
        stop_target[0] = True
        for t in (target, ahead, idle):
            t.join()
    assert summary["samples"] >= 20 and summary["hz"] == 500
    assert summary["training_thread_share"] == 1.0
    # every sample in the known function (at its sleep, or at its loop's test if the GIL was taken there)
    assert all("tests/test_bench.py:" in r["where"] for r in summary["self"]), summary["self"]
    assert all(r["where"].endswith(" _wait_in_known_place") for r in summary["self"]), summary["self"]
    assert abs(sum(r["share"] for r in summary["self"]) - 1.0) < 0.01
    # the thread's outermost frames (threading's run) are on every sample: left out of `inclusive`
    assert summary["inclusive"] == []
    assert summary["stages"] == {"the rest of Lightning's loop": 1.0}
    threads = {row["where"].split(":")[0] for row in summary["other_threads"]}
    assert "augment-ahead" in threads and "idle" not in threads, summary["other_threads"]
    assert summary["threads_cpu_share"]["augment-ahead"] > 0


def test_stack_summary_lists_the_top_n_lines_however_deep_the_stacks():
    """The summary's lists hold the `n` most frequent entries, each a share of all samples, whatever the
    depth of the stacks counted (30 lines in one function, 2 frames deep, 3 samples at the first)."""
    from probe import StackSampler

    sampler = StackSampler(0, hz=100)
    inner = compile("def inner(): pass", "/x/site-packages/timm/layers/mlp.py", "exec").co_consts[0]
    outer = compile("def run(): pass", "/x/site-packages/lightning/loop.py", "exec").co_consts[0]
    sampler.codes = {id(inner): inner, id(outer): outer}
    for line in range(30):
        sampler.stacks[(line, (id(inner), id(outer)))] = 3 if line == 0 else 1
    sampler.samples = 32
    summary = sampler.summary(n=25)
    assert len(summary["self"]) == 25
    assert summary["self"][0] == {"where": "timm/layers/mlp.py:0 inner", "share": round(3 / 32, 3)}
    assert summary["inclusive"] == []  # both functions on every sample


def test_sampled_stacks_are_told_apart_by_part_of_the_step():
    """A sampled stack's part of the step is its innermost frame that names one: an FSDP2 hook inside the
    forward is FSDP's, the forward inside Lightning's optimizer closure is the forward's, the backward's wait
    and the optimizer's own kernels are theirs."""
    from probe import stage_of

    def code(path: str, name: str):
        return compile(f"def {name}(): pass", path, "exec").co_consts[0]

    site = "/usr/lib/python3/site-packages/"
    step = code(site + "lightning/pytorch/core/module.py", "training_step")
    classifier = code("/repo/src/vitrain/models/classifier.py", "training_step")
    adam = code(site + "torch/optim/adam.py", "step")
    closure = code(site + "lightning/pytorch/loops/optimization/automatic.py", "closure")
    fsdp = code(site + "torch/distributed/fsdp/_fully_shard/_fsdp_state.py", "_pre_forward")
    timm = code(site + "timm/models/vision_transformer.py", "forward")
    backward = code(site + "torch/autograd/graph.py", "_engine_run_backward")
    fused = code(site + "torch/optim/adam.py", "_fused_adam")
    graph = code("/tmp/torchinductor_root/ab/cabcdef.py", "call")
    loop = code(site + "lightning/pytorch/loops/training_epoch_loop.py", "advance")

    def stack(*codes):  # innermost first, as sampled
        return tuple((c, 1) for c in codes)

    assert stage_of(stack(fsdp, timm, classifier, step, closure, adam, loop)) == "FSDP2 hooks"
    assert stage_of(stack(timm, classifier, closure, adam, loop)) == "forward and loss (eager)"
    assert stage_of(stack(graph, timm, classifier, closure, adam, loop)).startswith("compiled code")
    assert stage_of(stack(backward, closure, adam, loop)).startswith("backward")
    assert stage_of(stack(fused, adam, loop)) == "optimizer step"
    assert stage_of(stack(loop)) == "the rest of Lightning's loop"


def test_gpu_rows_give_the_host_cpu_of_both_threads():
    """A template row's host CPU per step: the training thread's and the backward thread's, each the median of
    the timed steps' differences; on a CPU (no backward thread) one figure, the backward included; a probe
    from before the backward thread was recorded says it was not measured."""
    import gpu

    probe = {
        "step_starts": [0.0, 1.0, 2.0, 3.0], "step_ends": [0.5, 1.5, 2.5, 3.5],
        "step_cpu": [0.1, 0.2, 0.32, 0.43], "step_backward_cpu": [1.0, 1.05, 1.09, 1.16],
        "backward_threads": 1,
    }  # fmt: skip
    report = {"batch_size": {"per_device_observed": 8}}
    f = gpu.template_figures(probe, report, warmup=1)
    assert round(f["host_ms_per_step"], 6) == 115.0 and round(f["backward_thread_ms_per_step"], 6) == 55.0
    assert f["timed_steps_ms"]["training_thread_cpu"] == [120.0, 110.0]
    assert f["timed_steps_ms"]["backward_thread_cpu"] == [40.0, 70.0]
    assert gpu.host_cpu(f) == "115.0 + 55.0"
    cpu_only = gpu.template_figures({**probe, "backward_threads": 0}, report, warmup=1)
    assert cpu_only["backward_thread_ms_per_step"] is None
    assert gpu.host_cpu(cpu_only) == "115.0 (backward included)"
    old = {k: v for k, v in probe.items() if k not in ("step_backward_cpu", "backward_threads")}
    assert gpu.host_cpu(gpu.template_figures(old, report, warmup=1)) == "115.0 + not measured"
    assert gpu.host_cpu({}) == "—"
    # a thread that prepared the batches ahead (in-memory augmentation, GPU decode): its CPU besides
    threaded = {**probe, "step_ahead_cpu": [2.0, 2.01, 2.03, 2.06], "ahead_threads": 1}
    ahead = gpu.template_figures(threaded, report, warmup=1)
    assert round(ahead["ahead_thread_ms_per_step"], 6) == 25.0
    assert ahead["timed_steps_ms"]["ahead_thread_cpu"] == [20.0, 30.0]
    assert gpu.host_cpu(ahead) == "115.0 + 55.0 + 25.0 ahead"
    assert f["ahead_thread_ms_per_step"] is None and "ahead" not in gpu.host_cpu(f)


def test_gpu_table_says_where_each_rows_training_thread_was():
    """Below the GPU table, one row per template path that has sampled stacks: the share of its samples in
    each part of the step, the parts no row was in left out; no such table when no row has samples."""
    import gpu

    def row(samples: int, stages: dict[str, float]) -> dict[str, Any]:
        return {"figures": {"stacks": {"samples": samples, "hz": 200.0, "steps": 10, "stages": stages}}}

    results = {
        "hand": {"figures": {"compiled": {"images_per_s": 10.0}}},
        "seed": row(120, {"backward (on a GPU: waiting for its thread)": 0.6, gpu.REST: 0.4}),
        "fsdp": row(80, {"FSDP2 hooks": 0.25, "backward (on a GPU: waiting for its thread)": 0.75}),
        "recipes": row(0, {}),
        "folder": {"error": "RuntimeError: no photos"},
    }
    lines = gpu.stages_table(results)
    header = next(line for line in lines if line.startswith("| path | samples |"))
    assert header == (
        "| path | samples | FSDP2 hooks | backward (on a GPU: waiting for its thread) | "
        "the rest of Lightning's loop |"
    )
    assert f"| {gpu.WHAT['seed']} | 120 | 0% | 60% | 40% |" in lines
    assert f"| {gpu.WHAT['fsdp']} | 80 | 25% | 75% | 0% |" in lines
    assert not any(gpu.WHAT["recipes"] in line for line in lines)
    assert "200 Hz over 10 steps after the timed window" in "".join(lines)
    assert gpu.stages_table({"seed": row(0, {})}) == []


def test_threads_preparing_batches_ahead_are_found_by_their_python_names():
    """The threads of vitrain/data/decode_ahead.py carry Python names only (the OS sees "python"): the probe
    finds them through `threading` by those names, as Linux thread ids whose CPU time it reads."""
    import threading
    import time

    import torch
    from probe import AHEAD_THREAD_NAMES, ahead_threads, threads_cpu_seconds

    from vitrain.data.decode_ahead import decode_ahead

    before = set(ahead_threads())  # none, unless another test of this process left one running
    done, seen = threading.Event(), {}

    def work(item: int) -> torch.Tensor:
        start = time.thread_time()
        while time.thread_time() - start < 0.05:  # CPU work of its own, however fast the machine
            pass
        seen.update(tid=threading.get_native_id(), cpu=time.thread_time())
        done.wait(60)
        return torch.zeros(1)

    batches = decode_ahead(iter([(0, torch.zeros(1))]), work, torch.device("cpu"), 1, name="augment-ahead")
    waiter = threading.Thread(target=lambda: list(batches))
    waiter.start()
    try:
        for _ in range(6000):
            if "cpu" in seen:
                break
            time.sleep(0.01)
        assert "augment-ahead" in AHEAD_THREAD_NAMES and set(ahead_threads()) - before == {seen["tid"]}
        assert threads_cpu_seconds([seen["tid"]]) >= seen["cpu"] * 0.999 >= 0.05 * 0.999
    finally:
        done.set()
        waiter.join(60)


def test_gpu_summary_line_names_what_ran():
    """The overview line of a GPU call: the seed against the hand-written loop when the seed ran, else each
    measured row (a levers call has no seed section), never a line of dashes; failed sections are left out."""
    import gpu

    seed = {"figures": {"images_per_s": 13695.8, "mfu": 0.363}}
    hand = {"figures": {"compiled_patchmm@1024": {"images_per_s": 14395.2, "mfu": 0.382}}}
    line = gpu.summary_line("NVIDIA H200", {"hand": hand, "seed": seed}, 1.008)
    assert line == "NVIDIA H200: seed run 13,696 images/s, MFU 36.3%, 1.01x the compiled hand-written loop"
    levers = {"hand": hand, "seed_1024": {"figures": {"images_per_s": 14506.3, "mfu": None}},
              "seed_fp8": {"error": "TimeoutExpired: 120 s"}}  # fmt: skip
    line = gpu.summary_line("NVIDIA H200", levers, None)
    assert line == (
        "NVIDIA H200: no seed section in this call; hand-written compiled_patchmm@1024 14,395 images/s "
        "(MFU 38.2%); seed_1024 14,506 images/s (MFU —)"
    )
    assert gpu.summary_line("NVIDIA H200", {"seed_fp8": levers["seed_fp8"]}, None).endswith(
        "nothing measured"
    )


def test_gpu_plans_run_known_sections_and_fit_one_device_call(monkeypatch: pytest.MonkeyPatch):
    """Each prepared run (bench/gpu.py's PLANS, what bench/lease.sh runs on a lent GPU) names sections and
    hand-written variants the script has, and its budget leaves a call of the lease script's default limit
    time to install, check and pack; flags given beside --plan win over the plan's values; --quick is the
    quick plan; a caller's deadline (VITRAIN_BENCH_DEADLINE) shortens the budget, never lengthens it."""
    import re
    import time

    import gpu

    limit = int(re.search(r"LIMIT:-(\d+)", (BENCH / "lease.sh").read_text()).group(1))
    assert limit <= 590  # the device tool's call limit is 600 s
    assert {"quick", "table"} <= set(gpu.PLANS)
    for name in gpu.PLANS:
        args = gpu.parse(["--plan", name])
        sections = args.only.split(",")
        assert set(sections) <= set(gpu.SECTIONS) and sections[0] == "hand", name  # the reference first
        assert all(gpu.split_variant(v) for v in args.hand_variants.split(","))
        assert args.budget <= limit - 100, name
    args = gpu.parse(["--plan", "table", "--steps", "5", "--only", "seed"])
    assert (args.steps, args.only, args.budget) == (5, "seed", gpu.PLANS["table"]["budget"])
    quick = gpu.parse(["--quick"])
    assert quick.plan == "quick" and quick.only == gpu.PLANS["quick"]["only"]
    assert gpu.parse([]).plan is None and gpu.parse([]).budget == 900
    assert gpu.split_variant("compiled_patchmm+cudagraphs@1024") == ("compiled_patchmm", "cudagraphs", 1024)
    for bad in ("compild", "eager+autotune", "compiled+fast", "compiled@big"):
        with pytest.raises(ValueError, match="hand-written variant"):
            gpu.split_variant(bad)
    now = time.perf_counter()
    monkeypatch.delenv("VITRAIN_BENCH_DEADLINE", raising=False)
    assert 95 < gpu.section_deadline(100) - now < 105  # seconds apart: no clock is compared closely
    for seconds, expected in ((50, 50), (500, 100)):
        monkeypatch.setenv("VITRAIN_BENCH_DEADLINE", str(time.time() + seconds))
        assert expected - 5 < gpu.section_deadline(100) - now < expected + 5
