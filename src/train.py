"""Train a timm vision transformer: `python src/train.py experiment=cifar [overrides...]`."""

import hydra
from omegaconf import DictConfig

from vitrain.tasks.cli import check_overrides, ctrl_c_in_one_line
from vitrain.tasks.runs import register_resolvers

register_resolvers()


@hydra.main(version_base="1.3", config_path="../configs", config_name="train.yaml")
def main(cfg: DictConfig) -> float | None:
    metrics, objects = run_task(train, cfg)
    # what a Hydra sweeper (hparams_search=...) optimises: the best value the run reached; a run without one
    # (debug=fdr keeps no checkpoint) is not told that its last value stands for it
    metric = cfg.get("optimized_metric")
    return best_value(metric or "val/acc1", metrics, objects.trainer, warn=bool(metric))


if __name__ == "__main__":
    with ctrl_c_in_one_line():  # the config check and the imports too
        check_overrides("train")
        # torch, Lightning and timm load after the config check (a mistyped override fails in a second, not after
        # ~10 s of imports) and before Hydra sets up logging: imported later, Lightning would not install its own
        # log handler and its records would reach Hydra's handlers as well
        from vitrain.tasks.harness import run_task
        from vitrain.tasks.training import best_value, train

        main()
