"""Float8's accuracy effect: `experiment=cifar_cpu` trained for the same epochs on the real CIFAR-10 from the
same seed, with and without `model.float8=true` (torchao's Float8Linear for the blocks' linear layers:
inputs, weights and gradients rounded to float8 with dynamic per-tensor scales), then the test accuracy of
each run's best checkpoint as the run reports it.

The rounding is the same on any device, so the accuracy effect measured here is float8's (a GPU adds no
other arithmetic error than its accumulation order). The speed is not: a CPU computes float8 matmuls no
faster than bf16, so the images/s ratio below is this CPU's, and the gain on a GPU with float8 tensor cores
is `bench/gpu.py`'s to measure. Epochs, not the experiment's time budget, bound the runs, so the slower
float8 run on a CPU trains the same steps.
"""

from __future__ import annotations

import json

from common import (
    SMALL_VIT,
    SMOKE_NET,
    Result,
    data_overrides,
    parse_args,
    probe_overrides,
    run_train,
    scratch_dir,
    train_command,
)

EPOCHS = 3
NOISE = (
    "One pair of runs from one seed: on this recipe differences under about a point are within a run's noise "
    "(docs/recipes.md's ablation), so what this shows is float8 costing less than about a point here; the "
    "recipe's 10-minute budget is not used (epochs bound both runs)."
)
SMOKE = [*SMOKE_NET, "datamodule.batch_size=16", "datamodule.val_size=32", "datamodule.train_subset=64"]


def main() -> None:
    args = parse_args(__doc__)
    result = Result("float8", args)
    scratch = scratch_dir("float8")
    epochs = 1 if args.smoke else EPOCHS
    runs, commands = {}, {}
    for float8 in (False, True):
        run_dir = scratch / f"float8-{str(float8).lower()}"
        argv = [
            SMALL_VIT,
            *data_overrides(args),
            f"trainer.max_epochs={epochs}",
            "trainer.max_time=null",  # epochs bound both runs: the same steps, the same schedule
            f"model.float8={str(float8).lower()}",
            f"hydra.run.dir={run_dir}",
            *(SMOKE if args.smoke else []),
        ]
        run_train([*argv, *probe_overrides(run_dir / "probe.json")], log=run_dir / "output.log", timeout=3600)
        runs[float8] = json.loads((run_dir / "probe.json").read_text())
        commands[float8] = train_command(argv)

    def acc(float8: bool) -> float:
        return 100 * runs[float8]["metrics"].get("test", {}).get("test/acc1", 0.0)

    def images_per_s(float8: bool) -> float:
        rec = runs[float8]
        report = json.loads((scratch / f"float8-{str(float8).lower()}" / "report.json").read_text())
        batch = int((report.get("batch_size") or {}).get("per_device_observed") or 0)
        return rec["global_step"] * batch / rec["fit_seconds"]

    delta = acc(True) - acc(False)
    speed = images_per_s(True) / images_per_s(False)
    line = (
        f"test accuracy after {epochs} epochs: {acc(True):.2f} % with float8 matmuls, {acc(False):.2f} % without "
        f"({delta:+.2f} points); images/s on this CPU {speed:.2f}x (no float8 tensor cores: not the GPU's gain)"
    )
    result.save(
        line,
        figures={
            "test_acc1_float8_percent": round(acc(True), 2),
            "test_acc1_plain_percent": round(acc(False), 2),
            "delta_points": round(delta, 2),
            "cpu_images_per_s_ratio": round(speed, 3),
            "epochs": epochs,
        },
        goal=None,
        met=None,
        notes=[NOISE],
        precision=runs[False].get("precision"),
        command=commands[True],
        command_plain=commands[False],
    )


if __name__ == "__main__":
    main()
