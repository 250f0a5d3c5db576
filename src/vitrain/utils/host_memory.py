"""Host memory of a run's process: freed memory kept instead of handed back to the kernel after every step,
and the objects of start-up kept out of the garbage collector's way.

glibc's malloc serves tensors of more than a few hundred KB with fresh `mmap`s and returns them with
`munmap` when freed, so every training step on the CPU faults in (and the kernel zeroes) the pages of all
its activations again. Measured here (docs/benchmarks.md, "Levers"): about 14 % of the step time in one
process and a quarter of it with two DDP processes, which fault in parallel. PyTorch's own advice is an
allocator that caches (jemalloc, tcmalloc via LD_PRELOAD); that needs a package and an environment set
before start-up, so we set glibc's equivalent knobs (`mallopt`, the MALLOC_*_ env vars' calls) at run
time. The cost is the one a caching allocator has: the process's RSS stays at its peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import sys

log = logging.getLogger(__name__)

# mallopt parameters (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
# the largest mmap threshold glibc accepts on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): blocks below it come
# from the heap and are reused; a batch of 128 ViT activations is a few MB
MMAP_THRESHOLD = 32 * 1024 * 1024
TRIM_THRESHOLD = 1024 * 1024 * 1024
TOP_PAD = 64 * 1024 * 1024


def retain_freed_memory() -> bool:
    """Tell glibc malloc to reuse freed blocks (no mmap/munmap per tensor); False where that is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = all(
        mallopt(param, value) == 1
        for param, value in (
            (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (M_TOP_PAD, TOP_PAD),
        )
    )
    if not done:
        log.debug("mallopt refused a setting: host memory allocation left as it is")
    return done


def freeze_startup_heap() -> bool:
    """Once per process: collect, then move every object alive into the collector's permanent generation.

    What is alive at start-up is mostly what torch, Lightning and timm imported (about half a million tracked
    objects), none of it ever freed. Every full collection would traverse it all again, with the training
    loop stopped: Python's own (each time the heap grew by a quarter) and the `gc.collect()` of Lightning's
    batch-size finder at every trial (docs/benchmarks.md, "Start-up", has a collection's time with and
    without). Frozen, a collection sees only what the run made, and the collections of DataLoader workers
    forked later do not write into those objects' pages (copy-on-write), as `gc.freeze`'s documentation
    advises. An object frozen is never collected: hence a collection first, and once, before the run builds
    anything (a sweep's later jobs in the same process are collected as usual). False where this process
    already froze.
    """
    if gc.get_freeze_count():
        return False
    gc.collect()
    gc.freeze()
    return True
