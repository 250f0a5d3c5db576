"""Framework overhead: training steps/s of the template vs a hand-written PyTorch loop, interleaved.

Template: `vitrain.training.train(cfg)` — what `src/train.py` runs — with `experiment=cifar_cpu` and the
default callbacks and logger (checkpoints, Rich progress bar, LR monitor, throughput, run report,
TensorBoard...). Plain: the same timm network, the same uint8 images in memory with the same on-device
augmentation, batch size, AdamW parameter groups, LR schedule and autocast precision, in a `for` loop with
an on-device running loss/accuracy. Steps/s are taken over the steady-state window (after `warmup` steps).
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import SMALL_VIT, Result, compose, data_overrides, interleave, median, parse_args, ratio
from probe import BenchProbe

SMOKE = [
    "model.net.patch_size=8",
    "model.net.embed_dim=32",
    "model.net.depth=2",
    "model.net.num_heads=2",
    "datamodule.batch_size=8",
    "datamodule.val_size=16",
]


def template_cfg(args: Any, workdir: Path, batches: int) -> Any:
    overrides = [
        SMALL_VIT,
        *data_overrides(args),
        f"trainer.accelerator={args.accelerator}",
        "trainer.max_epochs=1",
        f"trainer.limit_train_batches={batches}",
        "trainer.limit_val_batches=1",
        "trainer.max_time=null",
        "test=false",
        "extras.print_config=false",
        *(SMOKE if args.smoke else []),
    ]
    return compose(overrides, workdir)


def template_steps_per_s(cfg: Any, warmup: int) -> tuple[float, BenchProbe]:
    """One `train(cfg)` (a fresh model, trainer and datamodule, as a new run); steps/s after `warmup`."""
    from vitrain.training import train

    _, objects = train(cfg)
    probe = next(c for c in objects["trainer"].callbacks if isinstance(c, BenchProbe))
    ends = probe.record["step_ends"]
    return (len(ends) - 1 - warmup) / (ends[-1] - ends[warmup]), probe


class PlainLoop:
    """The loop a user writes by hand around the same network, data and optimizer."""

    def __init__(self, cfg: Any, device: torch.device) -> None:
        import hydra
        from timm.optim import param_groups_weight_decay

        from vitrain.data.augment import BatchTransform

        self.cfg, self.device = cfg, device
        # the same timm net (and attention setting) the template builds, used as a plain nn.Module
        module = hydra.utils.instantiate(cfg.model)
        self.net = module.net.to(device).train()
        datamodule = hydra.utils.instantiate(cfg.datamodule)
        datamodule.set_input_spec(**module.input_spec)
        datamodule.prepare_data()
        datamodule.setup("fit")
        self.x, self.y = datamodule.train_set.x.to(device), datamodule.train_set.y.to(device)
        self.transform: BatchTransform = datamodule.transform
        self.batch = int(cfg.datamodule.batch_size)
        opt_factory = hydra.utils.instantiate(cfg.model.optimizer)
        wd = opt_factory.keywords.get("weight_decay", 0.0)
        self.optimizer = opt_factory(params=param_groups_weight_decay(self.net, weight_decay=wd))
        steps = len(self.y) // self.batch
        self.scheduler = hydra.utils.instantiate(cfg.model.scheduler)(
            optimizer=self.optimizer, total_steps=steps
        )
        self.label_smoothing = float(cfg.model.label_smoothing)
        precision = str(cfg.trainer.precision)
        self.autocast = (
            (lambda: torch.autocast(device.type, dtype=torch.bfloat16))
            if precision.startswith("bf16")
            else (lambda: torch.autocast(device.type, dtype=torch.float16))
            if precision.startswith("16")
            else contextlib.nullcontext
        )
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision.startswith("16"))

    def steps_per_s(self, steps: int, warmup: int) -> float:
        perm = torch.randperm(len(self.y), device=self.device)
        loss_sum = torch.zeros((), device=self.device)
        correct = torch.zeros((), device=self.device, dtype=torch.long)
        t0 = 0.0
        for i in range(warmup + steps):
            if i == warmup:
                t0 = _now(self.device)
            idx = perm[i * self.batch : (i + 1) * self.batch]
            x, y = self.transform(self.x[idx], train=True), self.y[idx]
            with self.autocast():
                logits = self.net(x)
                loss = F.cross_entropy(logits, y, label_smoothing=self.label_smoothing)
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            loss_sum += loss.detach()  # running figures stay on the device: no sync per step
            correct += (logits.argmax(-1) == y).sum()
        return steps / (_now(self.device) - t0)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def main() -> None:
    args = parse_args(
        __doc__,
        rounds=(int, 3, "A/B rounds"),
        steps=(int, 16, "timed steps per segment"),
        warmup=(int, 3, "untimed steps first"),
        accelerator=(str, "auto", "cpu | gpu | auto"),
    )
    if args.smoke:
        args.rounds, args.steps, args.warmup = 1, 3, 1
    result = Result("overhead", args)
    workdir = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    batches = args.warmup + args.steps + 1
    cfg = template_cfg(args, workdir / "run", batches)
    from omegaconf import open_dict

    with open_dict(cfg):
        cfg.callbacks["bench_probe"] = {"_target_": "probe.BenchProbe", "out": str(workdir / "probe.json")}
    device = torch.device("cuda" if torch.cuda.is_available() and args.accelerator != "cpu" else "cpu")
    plain = PlainLoop(cfg, device)

    probes: list[BenchProbe] = []

    def template() -> float:
        sps, probe = template_steps_per_s(cfg, args.warmup)
        probes.append(probe)
        return sps

    runs = interleave(
        {"template": template, "plain": lambda: plain.steps_per_s(args.steps, args.warmup)}, args.rounds
    )
    r = ratio(runs["template"], runs["plain"])
    t_ms = 1000 / median(runs["template"])
    p_ms = 1000 / median(runs["plain"])
    goal_met = r >= 0.97
    line = (
        f"template/plain steps/s = {r:.3f} (goal >= 0.97: {'met' if goal_met else 'NOT met'}); "
        f"{median(runs['template']):.2f} vs {median(runs['plain']):.2f} steps/s, "
        f"{t_ms - p_ms:+.1f} ms per step"
    )
    net = cfg.model.net
    result.save(
        line,
        figures={
            "ratio": round(r, 4),
            "template_steps_per_s": round(median(runs["template"]), 3),
            "plain_steps_per_s": round(median(runs["plain"]), 3),
            "overhead_ms_per_step": round(t_ms - p_ms, 2),
        },
        goal="template/plain >= 0.97",
        met=goal_met,
        rounds={k: [round(v, 4) for v in vs] for k, vs in runs.items()},
        device=str(device),
        model={
            k: net.get(k) for k in ("model_name", "img_size", "patch_size", "embed_dim", "depth", "num_heads")
        },
        batch_size=int(cfg.datamodule.batch_size),
        precision=str(cfg.trainer.precision),
        callbacks=sorted(k for k in cfg.callbacks if k != "bench_probe"),
        loggers=sorted(cfg.logger or []),
        steps=args.steps,
        warmup=args.warmup,
    )


if __name__ == "__main__":
    main()
