"""Recipe ablation on `experiment=cifar_cpu`: the experiment as it is, then one option changed at a time
(switched off when the recipe uses it, on when it does not), each a full run under the experiment's
10-minute budget on the real CIFAR-10; the test accuracy of each, as the run reports it.

    python bench/recipes.py                     # every row: ~11 min each, see ROWS
    python bench/recipes.py --only=-ema,recipe  # a subset (`=`: a row may start with "-"); others are kept
    python bench/recipes.py --render-only 1     # only rewrite the table in docs/recipes.md

Results: bench/results/recipes.json (one entry per row, each with its date, machine and the recipe it ran:
a hash of configs/experiment/cifar_cpu.yaml); docs/recipes.md's table is generated from it, and says which
rows are measured, and which on an earlier version of the recipe (those are not compared with it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

from common import (
    RESULTS,
    ROOT,
    SMALL_VIT,
    SMOKE_NET,
    data_overrides,
    load_average,
    machine,
    probe_overrides,
    run_train,
    scratch_dir,
    train_command,
)

# name -> (what changes, overrides on top of experiment=cifar_cpu)
ROWS: dict[str, tuple[str, list[str]]] = {
    "recipe": ("experiment=cifar_cpu as it is", []),
    "-progressive_resize": (
        "every step at 32 px (no 16 -> 24 -> 32 px ramp)",
        ["model.progressive_resize.start_size=null"],
    ),
    "batch_128": ("batch 128 instead of 64 (half the steps)", ["datamodule.batch_size=128"]),
    "-conv_stem": (
        "plain ViT: 4 px patches (64 tokens) instead of the convolutional stem",
        ["~model.net.embed_layer", "model.net.patch_size=4"],
    ),
    "-label_smoothing": ("no label smoothing", ["model.label_smoothing=0.0"]),
    "-adam_beta2": ("AdamW betas (0.9, 0.999) instead of (0.9, 0.99)", ["model.optimizer.betas=[0.9,0.999]"]),
    "+crop_shifts": ("random crops with +-2 px shifts (besides flips)", ["datamodule.crop_padding=2"]),
    "+ema": ("EMA of the weights (decay 0.999)", ["callbacks=[default,ema]"]),
    "+mixup_cutmix": (
        "mixup 0.8 / cutmix 1.0",
        ["model.mixup.mixup_alpha=0.8", "model.mixup.cutmix_alpha=1.0"],
    ),
    "+randaugment": (
        "RandAugment rand-m9-n2-mstd0.5, per image",
        ["datamodule.auto_augment=rand-m9-n2-mstd0.5"],
    ),
    "+trivialaugment": ("TrivialAugmentWide, per image", ["datamodule.auto_augment=trivial"]),
    "+random_erasing": ("random erasing p=0.25", ["datamodule.re_prob=0.25"]),
}
SMOKE = [*SMOKE_NET, "datamodule.batch_size=16", "datamodule.val_size=32", "datamodule.train_subset=64",
         "trainer.max_epochs=1"]  # fmt: skip
DOC = ROOT / "docs" / "recipes.md"
EXPERIMENT = ROOT / "configs" / "experiment" / "cifar_cpu.yaml"
START, END = "<!-- recipes-table:start -->", "<!-- recipes-table:end -->"


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    what, overrides = ROWS[name]
    run_dir = scratch_dir(f"recipes-{name}") / "run"
    argv = [
        SMALL_VIT,
        *overrides,
        *data_overrides(args),
        f"hydra.run.dir={run_dir}",
        *(SMOKE if args.smoke else []),
    ]
    if args.smoke and name == "-conv_stem":
        argv = [a for a in argv if not a.startswith("model.net.embed_layer.")]
    load_before = load_average()
    run_train([*argv, *probe_overrides(run_dir / "probe.json")], log=run_dir / "output.log", timeout=3600)
    rec = json.loads((run_dir / "probe.json").read_text())
    test = rec["metrics"].get("test", {})
    return {
        "what": what,
        "test_acc1_percent": round(100 * test.get("test/acc1", 0), 2),
        "train_minutes": round(rec["fit_seconds"] / 60, 2),
        "epochs": rec["epochs"],
        "steps": rec["global_step"],
        "recipe": recipe_hash(),
        "stopped_by_max_time": rec["stopped_early"],
        "command": train_command(argv),
        "date": _now(),
        "load_before": load_before,
        "load_after": load_average(),
        "smoke": bool(args.smoke),
        "machine": machine(),
    }


def recipe_hash(path: Path = EXPERIMENT) -> str:
    """Which version of the experiment a row ran: the first 12 hex digits of the SHA-256 of its config
    file's settings (parsed: editing a comment does not make the measured rows stale)."""
    import yaml

    settings = json.dumps(yaml.safe_load(path.read_text()), sort_keys=True)
    return hashlib.sha256(settings.encode()).hexdigest()[:12]


def render(results: dict[str, Any], doc: Path = DOC, current: str | None = None) -> None:
    """The ablation table of docs/recipes.md, between its markers, from the results file. Rows measured on
    another version of the recipe than `current` are listed as such, without a difference to the recipe."""
    current = current or recipe_hash()
    rows = results.get("rows", {})
    base_row = rows.get("recipe", {})
    base = base_row.get("test_acc1_percent") if base_row.get("recipe") == current else None
    lines = [
        "| row | change | test acc1 % | vs recipe | minutes | epochs | steps | measured |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, (what, _) in ROWS.items():
        r = rows.get(name)
        if r is None or r.get("smoke"):
            lines.append(f"| `{name}` | {what} | not measured | | | | | no |")
            continue
        same = r.get("recipe") == current
        delta = (
            "" if base is None or name == "recipe" or not same else f"{r['test_acc1_percent'] - base:+.2f}"
        )
        early = " (stopped by max_time)" if r["stopped_by_max_time"] else ""
        when = r["date"] if same else f"{r['date']}, on an earlier recipe"
        lines.append(
            f"| `{name}` | {what} | {r['test_acc1_percent']:.2f} | {delta} | {r['train_minutes']:.1f}{early} "
            f"| {r['epochs']} | {r.get('steps', '')} | {when} |"
        )
    text = doc.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{START}\n" + "\n".join(lines) + f"\n{END}{tail}")


def _now() -> str:
    from datetime import datetime, timezone

    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def main() -> int:
    from common import parse_args

    args = parse_args(
        __doc__,
        only=(str, "", "comma-separated rows: " + ",".join(ROWS)),
        render_only=(int, 0, "1: only rewrite the table from the results file"),
    )
    path = args.out / "recipes.json"
    results = json.loads(path.read_text()) if path.is_file() else {"name": "recipes", "rows": {}}
    if not args.render_only:
        names = [n for n in args.only.split(",") if n] or list(ROWS)
        unknown = set(names) - set(ROWS)
        if unknown:
            raise SystemExit(f"unknown row(s) {', '.join(sorted(unknown))}; known: {', '.join(ROWS)}")
        for name in names:
            results["rows"][name] = measure(name, args)
            args.out.mkdir(parents=True, exist_ok=True)
            path.write_text(
                json.dumps(results, indent=2, default=str) + "\n"
            )  # after each row: a kill keeps it
            print(f"  {name}: {results['rows'][name]['test_acc1_percent']} %", flush=True)
    if not args.smoke and args.out == RESULTS:
        render(results)
    measured = {k: v["test_acc1_percent"] for k, v in results["rows"].items()}
    print(f"recipes: test acc1 % per row {measured}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
