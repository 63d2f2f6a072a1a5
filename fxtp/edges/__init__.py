"""The edges: what the ecosystem sees of a parallelized module. ``DTensor`` parameters and
outputs over plain local tensors, ``gm.fxtp``, checkpoints, clipping, meta-device
initialization and loss parallel on a sharded output."""
