"""The run's curves against the global step: plots/loss.png and plots/accuracy.png."""

from __future__ import annotations

from pathlib import Path

from vitrain.utils.run_files import Scalars

PLOTS = {
    "loss": ("Loss", ["train/loss_step", "train/loss_epoch", "val/loss"]),
    "accuracy": ("Accuracy", ["train/acc1", "val/acc1", "val/acc5", "test/acc1"]),
}


def plot_curves(scalars: Scalars, out_dir: Path) -> dict[str, str]:
    """plots/loss.png and plots/accuracy.png against the global step; names relative to the run dir."""
    from matplotlib.figure import Figure  # no pyplot: no global state, the Agg canvas, no display needed

    written: dict[str, str] = {}
    for name, (title, tags) in PLOTS.items():
        present = [t for t in tags if scalars.get(t)]
        if not present:
            continue
        fig = Figure(figsize=(7, 4), dpi=100, layout="constrained")
        ax = fig.add_subplot()
        for tag in present:
            steps, values = zip(*scalars[tag], strict=True)
            if len(steps) == 1:
                ax.plot(steps, values, "o", label=tag)
            else:
                thin = tag.endswith("_step")
                ax.plot(
                    steps,
                    values,
                    label=tag,
                    linewidth=0.8 if thin else 1.8,
                    alpha=0.5 if thin else 1.0,
                    marker=None if thin else ".",
                )
        ax.set(title=title, xlabel="step", ylabel=title.lower())
        ax.grid(alpha=0.3)
        ax.legend()
        out_dir.mkdir(parents=True, exist_ok=True)
        fig.savefig(out_dir / f"{name}.png")
        written[name] = f"{out_dir.name}/{name}.png"
    return written
