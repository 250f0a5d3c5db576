"""Evaluate a checkpoint: `python src/eval.py ckpt_path=<file | FSDP folder | s3://bucket/key>`."""

import sys

import hydra
from omegaconf import DictConfig

from vitrain.tasks.cli import check_overrides, checkpoint_overrides, ctrl_c_in_one_line
from vitrain.tasks.runs import register_resolvers

register_resolvers()


@hydra.main(version_base="1.3", config_path="../configs", config_name="eval.yaml")
def main(cfg: DictConfig) -> None:
    run_task(evaluate, cfg)


if __name__ == "__main__":
    sys.argv[1:] = checkpoint_overrides(sys.argv[1:])  # model.*/datamodule.* apply to the checkpoint's config
    with ctrl_c_in_one_line():  # the config check and the imports too
        check_overrides("eval")
        # loaded after the config check, before Hydra's logging set-up (src/train.py says why)
        from vitrain.tasks.evaluation import evaluate
        from vitrain.tasks.harness import run_task

        main()
