"""`trainer.precision=auto`: the fastest precision that trains correctly on the machine in hand.

bf16 autocast is a gain only where the hardware computes in bf16 faster than in fp32: GPUs of compute
capability >= 8.0, and CPUs with native bf16 instructions (AVX-512 BF16 or AMX on x86, BF16 on ARM) that oneDNN
is allowed to use *and* that measure faster here. On a CPU without them torch emulates bf16, and a small ViT
trained 18x slower than in fp32 (issue 12). Having them is no promise either: on a 2-core Intel Xeon with
AVX-512 BF16 but no AMX, oneDNN's bf16 matmuls ran at half the fp32 rate and experiment=cifar_cpu trained 1.5x
slower in bf16, where a Zen 4 EPYC trained 2.4x faster. So on a CPU with native bf16 a ~0.1 s matmul probe
decides (`cpu_bf16_speedup`). Older GPUs (capability < 8.0) have fp16 tensor cores: 16-mixed. Everything else
trains in 32-true.

Under FSDP2 (`trainer=fsdp`, Lightning's ModelParallelStrategy) `auto` picks the autocast precision only;
the strategy's own `mixed_precision` (bf16 weights in the all-gather and the compute, fp32 reduction) is a
separate choice and stays as configured. Lightning refuses 16-mixed there, so an older GPU gets 32-true.
"""

from __future__ import annotations

import logging
import math
import platform
import time
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig

from vitrain.compat import mkldnn_bf16_supported
from vitrain.errors import UserError
from vitrain.tasks.decisions import CPU_BF16_SPEEDUP, RankZeroDecisions, decisions

log = logging.getLogger(__name__)

AUTO = "auto"
# bf16 autocast is chosen on a CPU when its matmuls measure at least this much faster than fp32's: autocast also
# pays casts around every matmul and convolution, which the probe does not
MIN_CPU_BF16_SPEEDUP = 1.2
# the probe's result, a rank-zero decision (vitrain/tasks/decisions.py) kept in the environment: the ranks
# Lightning starts inherit the launching process's measurement (all ranks choose alike), and later calls in a
# process reuse it; a user may set it to skip the probe
SPEEDUP_ENV = RankZeroDecisions.variable(CPU_BF16_SPEEDUP)


def cpu_bf16_support() -> tuple[bool, str]:
    """(native bf16 on this CPU, why), from what torch reports.

    Two conditions: the CPU has bf16 instructions (`torch.cpu.get_capabilities()`, cpuinfo), and oneDNN,
    which runs torch's bf16 matmuls on CPU, may use bf16 kernels (`mkldnn_bf16_supported`: False when
    `ONEDNN_MAX_CPU_ISA` caps it below AVX-512, or without AVX-512 at all). The second alone is not enough:
    it is also True on AVX-512 CPUs without BF16 instructions, where oneDNN converts and runs fp32.
    """
    caps = torch.cpu.get_capabilities()
    if platform.machine().lower() in ("arm64", "aarch64"):
        native = [name for name in ("bf16", "sve_bf16") if caps.get(name)]
    else:
        native = [name for name in ("avx512_bf16", "amx_bf16") if caps.get(name)]
    if not native:
        return False, f"{caps.get('cpu_name') or 'CPU'} has no bf16 instructions"
    if not mkldnn_bf16_supported():
        return False, f"{caps.get('cpu_name') or 'CPU'} has {'+'.join(native)}, but oneDNN may not use it"
    return True, f"{caps.get('cpu_name') or 'CPU'} with native {'+'.join(native)}"


def cpu_bf16_speedup(m: int = 2048, k: int = 256, n: int = 1024, rounds: int = 5) -> float:
    """bf16 matmul throughput over fp32's on this CPU with this process's threads: the best of `rounds`
    interleaved timings of a transformer-MLP-sized product (1 GFLOP each, ~3-6 ms on 2 cores)."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    operands = {torch.float32: (a, b), torch.bfloat16: (a.bfloat16(), b.bfloat16())}
    best = dict.fromkeys(operands, math.inf)
    for x, y in operands.values():  # oneDNN builds its kernels on the first call
        torch.mm(x, y)
    for _ in range(rounds):
        for dtype, (x, y) in operands.items():
            start = time.perf_counter()
            torch.mm(x, y)
            best[dtype] = min(best[dtype], time.perf_counter() - start)
    return best[torch.float32] / best[torch.bfloat16]


def measured_cpu_bf16_speedup() -> float:
    """`cpu_bf16_speedup()` to three significant digits, measured once per launch: read from `SPEEDUP_ENV` where an earlier
    call or the launching process left it, else measured and left there."""
    # kept at the precision the messages show, and read back: this call, the ranks and later calls all
    # decide on (and print) one value, whatever side of a rounding boundary the probe measured
    value = decisions.decide(CPU_BF16_SPEEDUP, lambda: f"{cpu_bf16_speedup():.3g}")
    try:
        speedup = float(value)
    except ValueError:
        speedup = math.nan
    if not math.isfinite(speedup) or speedup <= 0:
        raise UserError(
            f"{SPEEDUP_ENV}={value!r} is not a positive number: unset it (trainer.precision=auto then measures "
            "bf16 against fp32 itself) or give bf16's matmul speed over fp32's, e.g. 2.0"
        )
    return speedup


def cpu_bf16_choice() -> tuple[bool, str]:
    """(bf16 autocast pays on this CPU, why): native bf16 (`cpu_bf16_support`) that also measures at least
    `MIN_CPU_BF16_SPEEDUP` times fp32's matmul speed. No probe runs where bf16 is emulated."""
    native, why = cpu_bf16_support()
    if not native:
        return False, why
    speedup = measured_cpu_bf16_speedup()
    if speedup < MIN_CPU_BF16_SPEEDUP:
        return False, f"{why}, but its bf16 matmuls run at {speedup:.3g}x fp32 here"
    return True, f"{why}, bf16 matmuls at {speedup:.3g}x fp32"


def choose_precision(
    device: str,
    *,
    cuda_capability: tuple[int, int] | None = None,
    cpu_bf16: bool = False,
    sharded: bool = False,
) -> str:
    """The decision alone, on capabilities given (tests inject them): see the module docstring."""
    if device == "cuda":
        if cuda_capability is not None and cuda_capability >= (8, 0):
            return "bf16-mixed"
        # Lightning's ModelParallelStrategy (FSDP2) supports no 16-mixed
        return "32-true" if sharded else "16-mixed"
    if device == "cpu":
        return "bf16-mixed" if cpu_bf16 else "32-true"
    return "32-true"


def _device_type(accelerator: Any) -> str:
    """cuda, cpu or other, as Lightning will pick it for `trainer.accelerator`."""
    from lightning.pytorch.accelerators import CUDAAccelerator, MPSAccelerator

    name = str(accelerator).lower() if isinstance(accelerator, str) else type(accelerator).__name__.lower()
    if name in ("cuda", "cudaaccelerator"):
        return "cuda"
    if name in ("cpu", "cpuaccelerator"):
        return "cpu"
    if name in ("gpu", "auto"):
        # Lightning's order for both: MPS, then CUDA, then (auto) CPU
        if MPSAccelerator.is_available():
            return "mps"
        if CUDAAccelerator.is_available():
            return "cuda"
        return "cpu" if name == "auto" else "cuda"
    return name


def _first_cuda_index(devices: Any) -> int:
    if isinstance(devices, (list, tuple)) and devices:
        return int(devices[0])
    if isinstance(devices, str) and "," in devices:
        return int(next(d for d in devices.split(",") if d.strip()))
    return 0


def _is_sharded(strategy: Any) -> bool:
    from lightning.pytorch.strategies import ModelParallelStrategy

    target = strategy.get("_target_") if isinstance(strategy, (dict, DictConfig)) else None
    if target is None:
        return isinstance(strategy, ModelParallelStrategy)
    from hydra.utils import get_class

    return issubclass(get_class(target), ModelParallelStrategy)


def _check_cuda_device(accelerator: Any, index: int) -> None:
    """A GPU run on a machine without that GPU stops in one line (Lightning's: "No supported gpu backend
    found!", or CUDA's driver traceback from the capability probe below)."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index >= count:
        raise UserError(
            f"trainer.accelerator={accelerator} needs a CUDA GPU, and this machine has "
            + (f"{count} (GPU {index} asked for)" if count else "none that torch can use")
            + ": run on the CPU with trainer=cpu, or let trainer.accelerator=auto choose"
        )


def resolve_precision(trainer_cfg: DictConfig | dict[str, Any]) -> Any:
    """`trainer_cfg.precision`, with `auto` replaced by the choice for this machine (logged).

    Call it before the Trainer exists: every rank computes the same answer from the same hardware, so no
    collective is needed (the ranks Lightning starts inherit the CPU probe's result through the environment;
    ranks that torchrun or SLURM start each measure, and the threshold lies far from what the CPUs met so far
    showed: bf16 matmuls at 0.5x fp32 on one, bf16 training 2.4x faster on another). The CUDA branch reads the
    capability of the run's first device (this initialises CUDA in the process, as the Trainer does next anyway).
    """
    precision = trainer_cfg.get("precision", "32-true")
    device = _device_type(trainer_cfg.get("accelerator", "auto"))
    if device == "cuda":
        index = _first_cuda_index(trainer_cfg.get("devices", 1))
        _check_cuda_device(trainer_cfg.get("accelerator"), index)
    if str(precision) != AUTO:
        return precision
    sharded = _is_sharded(trainer_cfg.get("strategy"))
    if device == "cuda":
        capability = torch.cuda.get_device_capability(index)
        why = f"{torch.cuda.get_device_name(index)}, compute capability {capability[0]}.{capability[1]}"
        chosen = choose_precision(device, cuda_capability=capability, sharded=sharded)
    elif device == "cpu":
        faster, why = cpu_bf16_choice()
        chosen = choose_precision(device, cpu_bf16=faster)
    else:
        why = f"accelerator {device}"
        chosen = choose_precision(device)
    if rank_zero_only.rank == 0:
        log.info(f"trainer.precision=auto -> {chosen} ({why})")
    return chosen
