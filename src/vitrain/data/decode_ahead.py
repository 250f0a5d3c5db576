"""Training batches prepared one or more batches ahead, in a thread of its own: GPU decode
(`datamodule.decode_ahead`), and in-memory batches sliced and augmented (`datamodule.augment_ahead`).

With `decode_device=cuda` the training thread used to decode each batch itself (`on_before_batch_transfer`):
nvJPEG's host side (its Huffman decoding) and the crop-and-resize launches took 9-11 ms of that thread per
384-image batch on an H100, on top of the step's own host work, and the GPU waited (image folder 0.69x,
streaming 0.56x the in-memory seed run, docs/benchmarks.md section 7; with this thread, on one H200: 0.78x
and 0.84x, section 8). Here a thread takes the encoded
batches from the loader and decodes, crops, resizes and flips them on a CUDA stream of its own, `depth`
batches ahead; the training thread only makes its stream wait for the batch's event, then applies the random
augmentation (auto-augment, random erasing) and the normalisation itself, so the global generators are drawn
from in the same order as before: the batches, and a resumed run's, are bitwise those of the inline decode.

In-memory batches (`datamodule.augment_ahead`, off by default): the recipes' RandAugment and random erasing
are ~160 small device ops a batch, launched by the training thread between two steps while the GPU waited
(21.5 % of the recipes path's step on one H200, docs/benchmarks.md section 8). There the thread slices each
batch and runs the whole augmentation, random ops included: each batch draws from generators seeded by its own
seed (`loaders.Seeded`), not from the global ones, so the batches are bitwise the inline ones all the same.

The C++ decode and the tensor ops release the GIL while they run, but the thread's Python holds it: on a
host-bound step the training thread, which lets the GIL go around every op, then waits to get it back. On a
CPU a thread augmenting ahead saved at most a seventh of what the same work costs such a step inline, and
in one run of three cost more (docs/benchmarks.md section 2); whether a GPU step gains is for
bench/gpu.py's `recipes_ahead` to say.

Nothing here is a DataLoader feature: torch's workers are processes, which cannot hold CUDA tensors, and
Lightning's prefetching runs on the training thread. The thread starts at the first batch asked for (the
resumable loaders read the trainer's restored counters then), and stops when the pass ends or its consumer
goes away; an error in it (a file that does not decode) is raised on the training thread as it was, in one
line.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from vitrain.errors import DataError

_END = object()
#: how long a pass left before its end waits for the thread to finish the batch it is decoding
JOIN_TIMEOUT_S = 60

log = logging.getLogger(__name__)


def check_depth(value: Any) -> None:
    """`datamodule.decode_ahead`: batches decoded ahead, 0 = on the training thread."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DataError(
            f"datamodule.decode_ahead={value!r} must be a whole number of batches, at least 0 (0: decode on the "
            "training thread)"
        )


class DecodedAhead:
    """A training batch the thread has prepared (decoded, cropped, resized and flipped: float, 0-255; or
    augmented model input), and the event on its stream that marks it done (None on a CPU).

    Not a tuple or dataclass: Lightning's precision plugins (`bf16-true`, `16-true`, `64-true`) cast the
    floating tensors of a batch's collections before `on_before_batch_transfer`, which would read `x` on the
    current stream before it waits for the thread's event."""

    __slots__ = ("done", "x")

    def __init__(self, x: Tensor, done: torch.cuda.Event | None) -> None:
        self.x, self.done = x, done

    def wait(self, *also: Tensor) -> Tensor:
        """`x` for the current stream: it waits for the thread's work on the GPU, and the memory of `x` and of
        the GPU tensors in `also` (labels the thread sliced) stays theirs until the current stream is done."""
        if self.done is not None:
            stream = torch.cuda.current_stream(self.x.device)
            stream.wait_event(self.done)
            for t in (self.x, *also):
                if t.is_cuda:
                    t.record_stream(stream)
        return self.x


def decode_ahead(
    batches: Iterator[tuple[Any, Tensor]],
    decode: Callable[[Any], Tensor],
    device: torch.device,
    depth: int,
    name: str = "gpu-decode-ahead",
) -> Iterator[tuple[DecodedAhead, Tensor]]:
    """(encoded, labels) batches -> (DecodedAhead, labels), `decode` run by a thread up to `depth` batches
    ahead. A generator: nothing starts before the first batch is asked for."""
    out: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        cuda = device.type == "cuda"
        stream = torch.cuda.Stream(device) if cuda else None
        place = torch.cuda.device(device) if cuda else contextlib.nullcontext()
        try:
            with place, torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                for encoded, labels in batches:
                    x = decode(encoded)
                    done = None
                    if stream is not None:
                        done = torch.cuda.Event()
                        done.record(stream)
                    if not put((DecodedAhead(x, done), labels)):
                        return
        except BaseException as err:  # raised again on the training thread
            put(err)
            return
        put(_END)

    thread = threading.Thread(target=work, name=name, daemon=True)
    thread.start()
    try:
        while True:
            item = out.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        # a pass left before its end (trainer.limit_train_batches): the thread ends at its next batch, and is
        # waited for, since the loader's next pass resets the iterator (persistent workers) it reads from
        stop.set()
        thread.join(timeout=JOIN_TIMEOUT_S)
        if thread.is_alive():
            log.warning("the %s thread did not end within %d s of its pass", name, JOIN_TIMEOUT_S)
