"""Asking whether CUDA is available, without loading a library that is not there on every step.

Lightning sets `PYTORCH_NVML_BASED_CUDA_CHECK=1` when it is imported, so that the question does not
initialise CUDA in a process that forks later. torch then answers it through NVML (`libnvidia-ml`) until
CUDA is initialised; on a host with no NVIDIA driver that library load fails and is tried again at every
question, and torch's Adam/AdamW ask once per optimizer step. Measured here: ~0.25 ms per step (a failed
`dlopen`, cProfile), from within the noise to 3 % of a `cifar_cpu` training step over runs
(docs/benchmarks.md, "Levers"). Where NVML cannot load, torch falls back to the CUDA
runtime's device count, which is what it asks with the variable unset: the same answer, without the load.
"""

from __future__ import annotations

import ctypes
import os
import sys

import torch

NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def skip_failing_nvml_check() -> bool:
    """Unset the NVML-based check where NVML cannot load and no GPU is seen; True if it did so."""
    if os.environ.get(NVML_CHECK) != "1" or not sys.platform.startswith("linux"):
        return False
    if not torch.backends.cuda.is_built():
        return False
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
        return False  # NVML is there: its check is cheap and keeps CUDA uninitialised before a fork
    except OSError:
        pass
    if torch.cuda.device_count() > 0:  # a GPU without NVML (a stripped container): leave it as it is
        return False
    os.environ[NVML_CHECK] = "0"
    return True
