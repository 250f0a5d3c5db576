"""Lightning + Hydra template for (distributed) training of timm vision transformers."""
