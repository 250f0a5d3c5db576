"""Framework overhead: training steps/s of the template vs a hand-written PyTorch loop, interleaved.

Template: `vitrain.tasks.training.train(cfg)` — what `src/train.py` runs — with `experiment=cifar_cpu` and the
default callbacks and logger (checkpoints, Rich progress bar, LR monitor, throughput, run report,
TensorBoard...). Plain: the same timm network, the same uint8 images in memory with the same on-device
augmentation, batch size, AdamW parameter groups, LR schedule and autocast precision, in a `for` loop with
an on-device running loss/accuracy. Both run in one process, alternating in blocks of a few steps
(`Interleave`); the figure is the median of the per-block ratios, after `warmup` steps of each. After the
timed blocks, a few more steps of each under torch.profiler count the top-level aten ops per step (on a GPU
each is at least one kernel launch: host work the GPU can wait behind). Then the same comparison twice with
a tiny network (batch 8), whose step is mostly host work, as a GPU step is for the host when its kernels run
behind it: without callbacks, logger and progress bar (Lightning's loop alone), then with the experiment's;
and each callback's per-step hooks timed directly, called 200 times with a step's real arguments
(`HookCost`): host work per step in milliseconds, where whole-step ratios cannot resolve it. Last, the host
work of one EMA update (`callbacks=[default,ema]`, after every optimizer step) of ViT-B's 152 weight tensors
at a width where the arithmetic is negligible, against the one fused lerp it comes down to.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from common import (
    SMALL_VIT,
    SMOKE_NET,
    Result,
    compose,
    data_overrides,
    median,
    parse_args,
    scratch_dir,
    short_run,
    synced_clock,
    top_level_ops,
)
from lightning.pytorch.callbacks import Callback

from vitrain.tasks.precision import resolve_precision

SMOKE = [
    *SMOKE_NET,
    "datamodule.batch_size=8",
    "datamodule.val_size=16",
]


def template_cfg(args: Any, workdir: Path, batches: int, extra: list[str] | None = None) -> Any:
    overrides = [
        SMALL_VIT,
        *data_overrides(args),
        f"trainer.accelerator={args.accelerator}",
        *short_run(batches, val_batches=1),
        *(SMOKE if args.smoke else []),
        *(extra or []),
    ]
    return compose(overrides, workdir)


class PlainLoop:
    """The loop a user writes by hand around the same network, data and optimizer."""

    def __init__(self, cfg: Any, device: torch.device) -> None:
        import hydra
        from timm.optim import param_groups_weight_decay

        from vitrain.data.augment import BatchTransform
        from vitrain.models.classifier import hydra_partial

        self.cfg, self.device = cfg, device
        # the same timm net (and attention setting) the template builds, used as a plain nn.Module
        module = hydra.utils.instantiate(cfg.model)
        self.net = module.net.to(device).train()
        datamodule = hydra.utils.instantiate(cfg.datamodule)
        datamodule.set_input_spec(**module.input_spec)
        datamodule.prepare_data()
        datamodule.setup("fit")
        self.x, self.y = datamodule.train_set.x.to(device), datamodule.train_set.y.to(device)
        self.transform: BatchTransform = datamodule.device_transform()
        self.batch = int(cfg.datamodule.batch_size)
        opt_factory = hydra_partial(cfg.model.optimizer)
        wd = opt_factory.keywords.get("weight_decay", 0.0)
        self.optimizer = opt_factory(params=param_groups_weight_decay(self.net, weight_decay=wd))
        steps = len(self.y) // self.batch
        self.scheduler = hydra_partial(cfg.model.scheduler)(optimizer=self.optimizer, total_steps=steps)
        self.label_smoothing = float(cfg.model.label_smoothing)
        precision = str(resolve_precision(cfg.trainer))  # `auto`: what the template's own run resolves to
        self.autocast = (
            (lambda: torch.autocast(device.type, dtype=torch.bfloat16))
            if precision.startswith("bf16")
            else (lambda: torch.autocast(device.type, dtype=torch.float16))
            if precision.startswith("16")
            else contextlib.nullcontext
        )
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision.startswith("16"))
        self.perm, self.cursor = torch.randperm(len(self.y), device=device), 0
        self.loss_sum = torch.zeros((), device=device)
        self.correct = torch.zeros((), device=device, dtype=torch.long)

    def block(self, steps: int) -> float:
        """Seconds per step over `steps` training steps (continuing through shuffled epochs)."""
        t0 = synced_clock(self.device)
        for _ in range(steps):
            if self.cursor + self.batch > len(self.perm):
                self.perm, self.cursor = torch.randperm(len(self.y), device=self.device), 0
            idx = self.perm[self.cursor : self.cursor + self.batch]
            self.cursor += self.batch
            x, y = self.transform(self.x[idx], train=True), self.y[idx]
            with self.autocast():
                logits = self.net(x)
                loss = F.cross_entropy(logits, y, label_smoothing=self.label_smoothing)
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            self.loss_sum += loss.detach()  # running figures stay on the device: no sync per step
            self.correct += (logits.argmax(-1) == y).sum()
        return (synced_clock(self.device) - t0) / steps


class Interleave(Callback):
    """Inside the template's own run: after every `block` template steps, `block` plain steps.

    Alternating in blocks of a few steps, in one process, puts both loops under the same machine load
    (other jobs come and go within seconds here), so the per-block ratios hold where whole-run figures
    drift. A template step is timed from one `on_train_batch_end` to the next: everything the trainer
    does per step (fetch, transfer, step, logging, every callback) falls inside it; the plain block runs
    in between, outside the template's clock.
    """

    def __init__(self, plain: PlainLoop, block: int, warmup: int, blocks: int, profiled: int = 4) -> None:
        self.plain, self.block, self.warmup, self.blocks = plain, block, warmup, blocks
        self.template: list[float] = []
        self.plain_times: list[float] = []
        self._since = 0
        self._t0 = 0.0
        # after the blocks: `profiled` template steps, then as many plain ones, under torch.profiler
        self.profiled = profiled
        self.ops_per_step: dict[str, float] = {}
        self._profiler: Any = None
        self._profiled_steps = 0

    def _count_ops(self) -> None:
        """Top-level aten ops per step: the template's from one batch end to the next (the whole step,
        fetch and callbacks included), then the plain loop's."""
        from torch.profiler import ProfilerActivity, profile

        if self._profiler is None:
            self._profiler = profile(activities=[ProfilerActivity.CPU])
            self._profiler.__enter__()
            return
        self._profiled_steps += 1
        if self._profiled_steps < self.profiled:
            return
        self._profiler.__exit__(None, None, None)
        self.ops_per_step["template"] = top_level_ops(self._profiler) / self.profiled
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            self.plain.block(self.profiled)
        self.ops_per_step["plain"] = top_level_ops(prof) / self.profiled

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        # the clock (a synchronize on CUDA) is read only at block ends, as in the plain loop's blocks
        if trainer.global_step <= self.warmup:
            if trainer.global_step == self.warmup:
                self._t0 = synced_clock(self.plain.device)
            return
        if len(self.template) >= self.blocks:
            if "plain" not in self.ops_per_step:
                self._count_ops()
            return
        self._since += 1
        if self._since < self.block:
            return
        now = synced_clock(self.plain.device)
        self.template.append((now - self._t0) / self.block)
        self.plain_times.append(self.plain.block(self.block))
        self._since = 0
        self._t0 = synced_clock(self.plain.device)


PER_STEP_HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
)


class HookCost(Callback):
    """Microseconds per training step that each other callback's per-step hooks take, called `calls` times
    each with the step's real arguments at the first step after `at` that writes no logs (so no hook logs
    or saves on the repeated calls). A direct figure where whole-step timings cannot resolve tens of
    microseconds out of a step's noise."""

    def __init__(self, at: int, calls: int = 200) -> None:
        self.at, self.calls = at, calls
        self.us: dict[str, float] = {}
        self._args: dict[str, tuple] = {}

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Any) -> None:
        self._args["on_before_backward"] = (trainer, pl_module, loss)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *rest: Any
    ) -> None:
        from vitrain.compat import should_update_logs

        if self.us or trainer.global_step < self.at or should_update_logs(trainer) or trainer.is_last_batch:
            return
        batch, batch_idx = rest
        optimizer = trainer.optimizers[0]
        args = {
            "on_train_batch_start": (trainer, pl_module, batch, batch_idx),
            "on_before_backward": self._args["on_before_backward"],
            "on_after_backward": (trainer, pl_module),
            "on_before_optimizer_step": (trainer, pl_module, optimizer),
            "on_before_zero_grad": (trainer, pl_module, optimizer),
            "on_train_batch_end": (trainer, pl_module, outputs, batch, batch_idx),
        }
        for callback in trainer.callbacks:
            if isinstance(callback, (HookCost, Interleave)):
                continue
            hooks = [h for h in PER_STEP_HOOKS if getattr(type(callback), h) is not getattr(Callback, h)]
            if not hooks:
                continue
            t0 = time.perf_counter()
            for _ in range(self.calls):
                for hook in hooks:
                    getattr(callback, hook)(*args[hook])
            name = type(callback).__name__
            self.us[name] = self.us.get(name, 0.0) + 1e6 * (time.perf_counter() - t0) / self.calls


LIVE: dict[str, Callback] = {}
PROFILED = 4  # steps of each loop counted under torch.profiler after the timed blocks


def interleaver() -> Callback:
    """The config's handle on the live callbacks (they hold the plain loop, which a config cannot)."""
    return LIVE["interleave"]


def hook_cost() -> Callback:
    return LIVE["hook_cost"]


def interleaved(cfg: Any, args: Any, device: torch.device, hook_cost_at: int | None = None) -> dict[str, Any]:
    """The template's run of `cfg` with the plain loop's blocks in between: per-block ratios, steps/s of
    each, top-level ops per step; with `hook_cost_at`, the callbacks' per-step hook costs too."""
    from omegaconf import open_dict

    from vitrain.tasks.training import train

    plain = PlainLoop(cfg, device)
    plain.block(args.warmup)
    LIVE["interleave"] = live = Interleave(plain, args.block, args.warmup, args.blocks, PROFILED)
    sys.modules.setdefault("overhead", sys.modules[__name__])  # so the config's _target_ finds this one
    with open_dict(cfg):
        if cfg.get("callbacks") is None:
            cfg.callbacks = {}
        cfg.callbacks["bench_interleave"] = {"_target_": "overhead.interleaver"}
        if hook_cost_at is not None:
            LIVE["hook_cost"] = HookCost(hook_cost_at)
            cfg.callbacks["bench_hook_cost"] = {"_target_": "overhead.hook_cost"}
    train(cfg)
    per_block = [p / t for t, p in zip(live.template, live.plain_times, strict=True)]
    if len(per_block) < args.blocks or "plain" not in live.ops_per_step:
        raise RuntimeError(f"only {len(per_block)} of {args.blocks} blocks ran, or the op count did not")
    t_sps, p_sps = 1 / median(live.template), 1 / median(live.plain_times)
    return {
        "ratio": median(per_block),
        "per_block": per_block,
        "template_steps_per_s": t_sps,
        "plain_steps_per_s": p_sps,
        "overhead_ms": 1000 * (1 / t_sps - 1 / p_sps),
        "ratio_of_totals": sum(live.plain_times) / sum(live.template),
        "ops": live.ops_per_step,
        "hook_us": LIVE["hook_cost"].us if hook_cost_at is not None else None,
    }


# the host cost of a step apart from the network's work: a network so small that the step is mostly host
# work (Lightning's loop, the callbacks, the logger), as on a GPU whose kernels run behind the host
HOST_NET = [*SMOKE_NET, "datamodule.batch_size=8"]
BARE = ["callbacks=none", "logger=none", "+trainer.enable_progress_bar=false"]


def ema_update_cost(rounds: int = 15, calls: int = 40) -> dict[str, float]:
    """The host work of one EMA update (`callbacks=[default,ema]`) of ViT-B/32's 152 weight tensors, at a
    width (16) where the arithmetic is negligible (the meta device would not do: its foreach ops run a Python
    fallback, tensor by tensor): the callback's update (`EMA._update`, what runs after every optimizer step)
    against the one fused lerp it comes down to, called on lists made beforehand (the floor). Medians of
    `rounds` rounds of `calls` calls, in microseconds."""
    from types import SimpleNamespace

    import timm

    from vitrain.callbacks.ema import EMA
    from vitrain.compat import averaged_model, foreach_lerp_

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = timm.create_model(
                "vit_base_patch32_224", pretrained=False, embed_dim=16, num_heads=2, num_classes=10
            )

    module = Net()
    ema = EMA(decay=0.999)
    ema.setup(SimpleNamespace(strategy=SimpleNamespace(root_device=module.device)), module, "fit")
    ema._update(module)  # the first update copies; the rest lerp
    tracked, current = list(averaged_model(ema).module.parameters()), list(module.parameters())

    def per_call(fn: Any) -> float:
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - start) / calls * 1e6)
        return median(times)

    return {
        "tensors": len(tracked),
        "update_us": round(per_call(lambda: ema._update(module)), 1),
        "floor_us": round(per_call(torch.no_grad()(lambda: foreach_lerp_(tracked, current, 0.001))), 1),
    }


def main() -> None:
    args = parse_args(
        __doc__,
        blocks=(int, 150, "template/plain block pairs"),
        block=(int, 2, "steps per block"),
        warmup=(int, 5, "untimed steps first (each loop)"),
        accelerator=(str, "auto", "cpu | gpu | auto"),
    )
    if args.smoke:
        args.blocks, args.block, args.warmup = 2, 2, 1
    result = Result("overhead", args)
    # as src/train.py does: the in-process loops run with the template's malloc and CUDA check
    from vitrain.utils.cuda_check import skip_failing_nvml_check
    from vitrain.utils.host_memory import retain_freed_memory

    retain_freed_memory()
    skip_failing_nvml_check()
    workdir = scratch_dir("overhead")
    batches = args.warmup + args.blocks * args.block + 2 + PROFILED
    cfg = template_cfg(args, workdir / "run", batches)
    device = torch.device("cuda" if torch.cuda.is_available() and args.accelerator != "cpu" else "cpu")
    main_run = interleaved(cfg, args, device)
    # the same comparison with a tiny network: without, then with the default callbacks and logger
    host = {}
    for name, extra in (("bare", BARE), ("default", [])):
        tiny = template_cfg(args, workdir / f"host_{name}", batches, [*HOST_NET, *extra])
        host[name] = interleaved(tiny, args, device, hook_cost_at=None if extra else args.warmup)
    ema = ema_update_cost(*((2, 2) if args.smoke else ()))
    r = main_run["ratio"]
    t_sps, p_sps, overhead_ms = (
        main_run["template_steps_per_s"],
        main_run["plain_steps_per_s"],
        main_run["overhead_ms"],
    )
    loop_ms = host["bare"]["overhead_ms"]
    callbacks_ms = host["default"]["overhead_ms"] - loop_ms
    hook_us = host["default"]["hook_us"] or {}
    goal_met = r >= 0.97
    line = (
        f"template/plain steps/s = {r:.3f} (goal >= 0.97: {'met' if goal_met else 'NOT met'}); "
        f"{t_sps:.2f} vs {p_sps:.2f} steps/s, {overhead_ms:+.1f} ms per step; "
        f"{main_run['ops']['template']:.0f} vs {main_run['ops']['plain']:.0f} top-level ops per step; "
        f"host work per step with a tiny network: Lightning's loop {loop_ms:+.2f} ms, the default callbacks "
        f"and logger {callbacks_ms:+.2f} ms more (their per-step hooks {sum(hook_us.values()):.0f} us); "
        f"an EMA update of ViT-B's {ema['tensors']} tensors {ema['update_us']:.0f} us of host work "
        f"(its one fused lerp {ema['floor_us']:.0f} us)"
    )
    net = cfg.model.net
    result.save(
        line,
        figures={
            "ratio": round(r, 4),
            "template_steps_per_s": round(t_sps, 3),
            "plain_steps_per_s": round(p_sps, 3),
            "overhead_ms_per_step": round(overhead_ms, 2),
            "ratio_of_totals": round(main_run["ratio_of_totals"], 4),
            "template_ops_per_step": round(main_run["ops"]["template"], 1),
            "plain_ops_per_step": round(main_run["ops"]["plain"], 1),
            "tiny_net_loop_ms_per_step": round(loop_ms, 3),
            "tiny_net_callbacks_logger_ms_per_step": round(callbacks_ms, 3),
            "callback_hooks_us_per_step": round(sum(hook_us.values()), 1),
            "ema_update_us": ema["update_us"],
            "ema_update_floor_us": ema["floor_us"],
        },
        goal="template/plain >= 0.97",
        met=goal_met,
        block_ratios=[round(v, 4) for v in main_run["per_block"]],
        device=str(device),
        model={
            k: net.get(k) for k in ("model_name", "img_size", "patch_size", "embed_dim", "depth", "num_heads")
        },
        batch_size=int(cfg.datamodule.batch_size),
        precision=str(resolve_precision(cfg.trainer)),
        callbacks=sorted(k for k in cfg.callbacks if not k.startswith("bench_")),
        loggers=sorted(cfg.logger or []),
        blocks=args.blocks,
        block=args.block,
        warmup=args.warmup,
        host_cost={
            "how": "the same interleaved comparison with a tiny network (HOST_NET) and batch 8, where the "
            "step is mostly host work: `bare` without callbacks, logger or progress bar (Lightning's loop "
            "alone), `default` with the experiment's callbacks and logger; `hook_us`: each callback's "
            "per-step hooks timed directly (HookCost)",
            **{
                name: {
                    "ratio": round(h["ratio"], 4),
                    "template_steps_per_s": round(h["template_steps_per_s"], 2),
                    "plain_steps_per_s": round(h["plain_steps_per_s"], 2),
                    "overhead_ms_per_step": round(h["overhead_ms"], 3),
                    "template_ops_per_step": round(h["ops"]["template"], 1),
                    "plain_ops_per_step": round(h["ops"]["plain"], 1),
                }
                for name, h in host.items()
            },
            "hook_us": {k: round(v, 1) for k, v in sorted(hook_us.items(), key=lambda kv: -kv[1])},
        },
    )


if __name__ == "__main__":
    main()
