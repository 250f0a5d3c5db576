"""The datamodules: a shared base and one per kind of source (CIFAR, image folders, litdata shards)."""
