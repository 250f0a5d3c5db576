"""Write a checkpoint's network as a timm model folder: `python src/export.py ckpt_path=<checkpoint>`."""

import hydra
from omegaconf import DictConfig

from vitrain.tasks.cli import check_overrides, ctrl_c_in_one_line
from vitrain.tasks.runs import register_resolvers

register_resolvers()


@hydra.main(version_base="1.3", config_path="../configs", config_name="export.yaml")
def main(cfg: DictConfig) -> None:
    run_task(export_model, cfg)


if __name__ == "__main__":
    with ctrl_c_in_one_line():  # the config check and the imports too
        check_overrides("export")
        # loaded after the config check, before Hydra's logging set-up (src/train.py says why)
        from vitrain.tasks.export import export_model
        from vitrain.tasks.harness import run_task

        main()
