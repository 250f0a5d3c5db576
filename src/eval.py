"""Evaluate a checkpoint: `python src/eval.py ckpt_path=<file | FSDP folder | s3://bucket/key>`."""

import sys

import hydra
from omegaconf import DictConfig

from vitrain.utils.cli import check_overrides, checkpoint_overrides
from vitrain.utils.run_id import register_resolvers

register_resolvers()


@hydra.main(version_base="1.3", config_path="../configs", config_name="eval.yaml")
def main(cfg: DictConfig) -> None:
    run_task(evaluate, cfg)


if __name__ == "__main__":
    sys.argv[1:] = checkpoint_overrides(sys.argv[1:])  # model.*/datamodule.* apply to the checkpoint's config
    check_overrides("eval")
    # loaded after the config check, before Hydra's logging set-up (src/train.py says why)
    from vitrain.evaluation import evaluate
    from vitrain.utils.task import run_task

    main()
