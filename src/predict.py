"""Classify image files with a trained checkpoint: `python src/predict.py ckpt_path=<checkpoint> inputs=<folder>`."""

import sys

import hydra
from omegaconf import DictConfig

from vitrain.tasks.cli import check_overrides, checkpoint_overrides, ctrl_c_in_one_line
from vitrain.tasks.runs import register_resolvers

register_resolvers()


@hydra.main(version_base="1.3", config_path="../configs", config_name="predict.yaml")
def main(cfg: DictConfig) -> None:
    run_task(predict, cfg)


if __name__ == "__main__":
    sys.argv[1:] = checkpoint_overrides(sys.argv[1:])  # model.*/datamodule.* apply to the checkpoint's config
    with ctrl_c_in_one_line():  # the config check and the imports too
        check_overrides("predict")
        # loaded after the config check, before Hydra's logging set-up (src/train.py says why)
        from vitrain.tasks.harness import run_task
        from vitrain.tasks.prediction import predict

        main()
