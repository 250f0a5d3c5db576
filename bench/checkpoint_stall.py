"""Checkpoint stall: how long a save holds up the training thread, written in place or in the background.

`trainer=default` saves twice an epoch (the best by val/acc1 and `last`), each the whole training state:
for the seed's model (ViT-B/32 with AdamW) about 1 GB. On a GPU a CIFAR-10 epoch takes seconds, so a save
that serialises, writes and fsyncs on the training thread costs a large share of the run's wall time.
`AtomicCheckpointIO` in the background (vitrain/checkpoints.py; `background: auto`, the default, does so
for a state on a GPU) copies the state to host memory on the training thread and leaves the rest to a
worker thread.

Measured here, on this machine's disk: the seed's model and optimizer state after one step (on the GPU when
there is one, as a run would hold it), saved by `AtomicCheckpointIO` as Lightning calls it, alternately
with `background=False` and `True` (A, B, B, A, ...). Per save: the time the call takes on the training
thread (the stall), and for the background save the time until the file is on disk. Then what the write
costs the training that goes on meanwhile: the steps of a small network (the `cifar_cpu` size) timed
while a background write runs, against steps with none.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from common import Result, interleave, median, parse_args, scratch_dir, synced_clock

from vitrain.checkpoints import AtomicCheckpointIO


def state(model_name: str, device: torch.device, **kwargs: int) -> dict:
    """A checkpoint as Lightning builds one: weights and optimizer state (after a step), where training keeps them."""
    import timm

    net = timm.create_model(model_name, num_classes=10, **kwargs).to(device)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    size = kwargs.get("img_size", 224)
    F.cross_entropy(
        net(torch.randn(2, 3, size, size, device=device)), torch.tensor([0, 1], device=device)
    ).backward()
    optimizer.step()
    return {
        "epoch": 0,
        "global_step": 1,
        "state_dict": net.state_dict(),
        "optimizer_states": [optimizer.state_dict()],
    }


def small_step(device: torch.device) -> Callable[[], float]:
    """One training step of a network of the `cifar_cpu` experiment's cost."""
    import timm

    net = timm.create_model(
        "vit_tiny_patch16_224", img_size=32, patch_size=4, embed_dim=192, depth=4, num_heads=3, num_classes=10
    ).to(device)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    x, y = torch.randn(64, 3, 32, 32, device=device), torch.randint(0, 10, (64,), device=device)

    def step() -> float:
        start = synced_clock(device)
        F.cross_entropy(net(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return synced_clock(device) - start

    return step


def main() -> None:
    args = parse_args(
        __doc__,
        rounds=(int, 4, "save pairs (in place, background)"),
        accelerator=(str, "auto", "cpu | gpu | auto"),
    )
    if args.smoke:
        args.rounds = 1
    result = Result("checkpoint_stall", args)
    device = torch.device("cuda" if torch.cuda.is_available() and args.accelerator != "cpu" else "cpu")
    model = {"model_name": "vit_base_patch32_224"}
    if args.smoke:
        model = {
            "model_name": "vit_tiny_patch16_224",
            "img_size": 32,
            "patch_size": 8,
            "embed_dim": 32,
            "depth": 2,
            "num_heads": 2,
        }
    checkpoint = state(**model, device=device)
    folder = scratch_dir("checkpoint_stall")
    in_place, background = AtomicCheckpointIO(background=False), AtomicCheckpointIO(background=True)
    written: list[float] = []

    def save_in_place() -> float:
        start = time.perf_counter()
        in_place.save_checkpoint(checkpoint, folder / "in_place.ckpt")
        return time.perf_counter() - start

    def save_in_background() -> float:
        start = time.perf_counter()
        background.save_checkpoint(checkpoint, folder / "background.ckpt")
        stall = time.perf_counter() - start
        background.wait()  # measured apart: the next save starts with nothing queued
        written.append(time.perf_counter() - start)
        return stall

    times = interleave({"in_place": save_in_place, "background": save_in_background}, args.rounds)
    size_gb = (folder / "background.ckpt").stat().st_size / 1e9

    # what a write in the background costs the steps that run meanwhile (the GIL, memory bandwidth, cores)
    step = small_step(device)
    for _ in range(3):
        step()
    quiet, during = [], []
    for _ in range(args.rounds):
        quiet += [step() for _ in range(5)]
        background.save_checkpoint(checkpoint, folder / "background.ckpt")
        while background.busy:
            during.append(step())
        background.wait()
    background.teardown()
    stall_in_place, stall_background = median(times["in_place"]), median(times["background"])
    speed_during = median(quiet) / median(during) if during else None
    line = (
        f"a {size_gb:.2f} GB checkpoint ({model['model_name']} + AdamW, on {device.type}) holds up the training "
        f"thread {stall_in_place:.2f} s written in place, {stall_background:.2f} s in the background "
        f"({stall_in_place / stall_background:.1f}x less), which writes it in {median(written):.2f} s"
        + (
            f"; training steps run meanwhile at {speed_during:.2f}x their speed ({len(during)} steps)"
            if speed_during
            else ""
        )
    )
    notes = []
    if speed_during:
        # training time lost to a background save: its stall, plus what the concurrent steps lose
        lost = stall_background + (1 - speed_during) * median(written)
        notes.append(
            f"Training time a save costs here: {stall_in_place:.2f} s in place, about {lost:.2f} s in the "
            f"background (its {stall_background:.2f} s stall plus the {1 - speed_during:.0%} the steps lose "
            f"during its {median(written):.2f} s write). `background: auto` writes a state held in host "
            "memory in place and one held on a GPU in the background, where the training thread mostly "
            "launches kernels and the host's cores are free; the GPU side is not measured on this machine."
        )
    result.save(
        line,
        notes=notes,
        figures={
            "checkpoint_gb": round(size_gb, 3),
            "stall_in_place_s": round(stall_in_place, 3),
            "stall_background_s": round(stall_background, 3),
            "stall_ratio": round(stall_in_place / stall_background, 2),
            "background_write_s": round(median(written), 3),
            "step_speed_during_write": None if speed_during is None else round(speed_during, 3),
        },
        device=str(device),
        model=model,
        times=times,
        written=[round(w, 3) for w in written],
        steps_quiet_ms=round(1000 * median(quiet), 2),
        steps_during_write_ms=round(1000 * median(during), 2) if during else None,
        checkpoint_dir=str(Path(folder)),
    )


if __name__ == "__main__":
    main()
