"""Readers: finding, decoding and caching what the datamodules load (CIFAR, image-folder trees)."""
