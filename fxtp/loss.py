"""``fxtp.cross_entropy``: loss parallel outside the graph, on a sharded model output.
The kernel (and the description of its collectives) is :mod:`fxtp.passes.cross_entropy`."""
from __future__ import annotations

import torch

from .mesh import resolve_group
from .passes.cross_entropy import loss_parallel_cross_entropy


def cross_entropy(local_logits: torch.Tensor, target: torch.Tensor,
                  weight: torch.Tensor | None = None, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0, *, group=None,
                  class_dim: int = -1) -> torch.Tensor:
    """``F.cross_entropy`` of logits whose class dim is sharded over ``group``.

    ``local_logits``: this rank's equal share of the classes along ``class_dim`` (what a
    ``ColwiseParallel`` LM head returns with its default ``Shard(-1)`` output).
    ``target``: class indices, the full (replicated) tensor shaped like the logits without
    the class dim; or class probabilities (floating), sharded like the logits: each rank
    passes its slice of classes. ``weight``: the full ``(C,)`` class weights on every rank.
    ``group``: a ProcessGroup, a 1-D DeviceMesh, or None for the default group.

    Equal to ``F.cross_entropy(full_logits.movedim(class_dim, 1), full_target, ...)`` (for
    1-D logits the class dim is 0): for F's own ``(N, C, d1, ...)`` layout pass
    ``class_dim=1``; ``(B, T, C)`` logits with ``(B, T)`` targets need no flattening. The loss
    is replicated on every rank, in the dtype F.cross_entropy returns, computed in fp32 (fp64
    for fp64 logits). Issues 3 all-reduces of per-token values forward and none backward.
    """
    g = resolve_group(group)
    return loss_parallel_cross_entropy(local_logits, target, weight, reduction, ignore_index,
                                       label_smoothing, class_dim, g.rank, g.world, g.name)
