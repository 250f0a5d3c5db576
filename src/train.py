"""Train a timm vision transformer: `python src/train.py experiment=cifar [overrides...]`."""

import hydra
from omegaconf import DictConfig

from vitrain.training import train
from vitrain.utils.cli import check_overrides
from vitrain.utils.run_id import register_resolvers
from vitrain.utils.task import run_task

register_resolvers()


@hydra.main(version_base="1.3", config_path="../configs", config_name="train.yaml")
def main(cfg: DictConfig) -> float | None:
    metrics, _ = run_task(train, cfg)
    # the value a Hydra sweeper optimises, when one is configured
    return metrics.get(cfg.get("optimized_metric") or "val/acc1")


if __name__ == "__main__":
    check_overrides("train")
    main()
