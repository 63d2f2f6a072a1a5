"""``fxtp.cross_entropy``: loss parallel outside the graph, on a sharded model output.
The kernel (and the description of its collectives) is :mod:`fxtp.kernels.cross_entropy`."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard

from ..kernels.cross_entropy import loss_parallel_cross_entropy
from ..passes.errors import InputError
from ..plans.mesh import resolve_group


def cross_entropy(local_logits: torch.Tensor, target: torch.Tensor,
                  weight: torch.Tensor | None = None, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0, *, group=None,
                  class_dim: int = -1) -> torch.Tensor:
    """``F.cross_entropy`` of logits whose class dim is sharded over ``group``.

    ``local_logits``: this rank's equal share of the classes along ``class_dim`` (what a
    ``ColwiseParallel`` LM head returns with its default ``Shard(-1)`` output), or the
    DTensor sharded by class a head with ``use_local_output=False`` hands on (its local
    tensor is taken, on its mesh).
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
    if isinstance(local_logits, DTensor):  # a head that hands on DTensors: its shard
        local_logits, group = _class_shard(local_logits, class_dim, group)
    g = resolve_group(group)
    return loss_parallel_cross_entropy(local_logits, target, weight, reduction, ignore_index,
                                       label_smoothing, class_dim, g.rank, g.world, g.name)


def _class_shard(logits: DTensor, class_dim: int, group):
    """The local tensor of ``logits``, a DTensor sharded by class on a 1-D mesh, and the
    mesh (``group``, where given, must be that mesh or its group)."""
    dim = class_dim % logits.dim()
    if logits.device_mesh.ndim != 1 or logits.placements != (Shard(dim),):
        raise InputError(f"fxtp.cross_entropy takes DTensor logits sharded by class on a 1-D "
                         f"mesh (Shard({dim})), got {logits.placements} on a "
                         f"{logits.device_mesh.ndim}-D mesh: use F.cross_entropy under "
                         f"torch's loss_parallel(), or redistribute them")
    mesh = logits.device_mesh
    if group is not None and group is not mesh and group is not mesh.get_group():
        raise InputError("fxtp.cross_entropy: group is not the mesh the DTensor logits are on; "
                         "leave group out")
    return logits.to_local(), mesh
