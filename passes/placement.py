"""Placement algebra: normalizing, comparing, costing and planning placement changes.

Placements are torch's own ``Shard(d)``, ``Replicate()`` and ``Partial()`` objects; ``Shard``
dims are normalized to be non-negative for the tensor they describe.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

R = Replicate()
P = Partial()
INF = math.inf
LOCAL_COPY_COST = 1e-3  # a chunk costs no communication, but prefer not to move at all


def normalize(p: Optional[Placement], ndim: int) -> Optional[Placement]:
    """``Shard(-1)`` -> ``Shard(ndim - 1)``; other placements unchanged."""
    if isinstance(p, Shard) and p.dim < 0:
        if p.dim + ndim < 0:
            raise ValueError(f"{p} is out of range for a {ndim}-d tensor")
        return Shard(p.dim + ndim)
    return p


def is_replicate(p) -> bool:
    return isinstance(p, Replicate)


def numel_hint(val: torch.Tensor) -> int:
    """Number of elements, using size hints for symbolic dims."""
    n = 1
    for s in val.shape:
        n *= s if isinstance(s, int) else s.node.hint if s.node.has_hint() else 1024
    return int(n)


def transition_cost(src: Placement, dst: Placement, val: torch.Tensor, world: int) -> float:
    """Bytes one rank sends to turn ``src`` into ``dst`` (ring algorithms)."""
    if src == dst:
        return 0.0
    nbytes = numel_hint(val) * val.dtype.itemsize
    share = (world - 1) / world * nbytes
    if isinstance(dst, Partial):
        return INF  # fxtp never creates partial values by redistribution
    if isinstance(src, Partial):
        # A reduce-scatter moves half an all-reduce's bytes, but the shards then need an
        # all-gather downstream unless a plan layout asks for them, so the choice between
        # reducing to Shard and to Replicate is left to explicit layouts: cost them alike.
        return 2 * share + (LOCAL_COPY_COST if isinstance(dst, Shard) else 0.0)
    if isinstance(dst, Shard):
        return LOCAL_COPY_COST if isinstance(src, Replicate) else share + LOCAL_COPY_COST
    return share  # all-gather


def transition_steps(src: Placement, dst: Placement) -> list[tuple[str, Optional[int]]]:
    """The collectives that turn ``src`` into ``dst``: ``[(kind, dim), ...]`` with kinds
    ``all_reduce``, ``reduce_scatter``, ``all_gather`` and ``shard`` (local chunk)."""
    if src == dst:
        return []
    if isinstance(src, Partial):
        return [("all_reduce", None)] if isinstance(dst, Replicate) else \
            [("reduce_scatter", dst.dim)]
    if isinstance(src, Replicate):
        return [("shard", dst.dim)]
    steps = [("all_gather", src.dim)]
    return steps + [("shard", dst.dim)] if isinstance(dst, Shard) else steps


def describe(p) -> str:
    """Short text for dumps: ``S(1)``, ``R``, ``P``; tuples joined with commas."""
    if p is None:
        return "-"
    if isinstance(p, (tuple, list)):
        return "(" + ", ".join(describe(q) for q in p) + ")"
    if isinstance(p, Shard):
        return f"S({p.dim})"
    return "R" if isinstance(p, Replicate) else "P"
