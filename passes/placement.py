"""Placement algebra: normalizing, comparing, costing and planning placement changes.

Placements are torch's own ``Shard(d)``, ``Replicate()`` and ``Partial()`` objects, and
``_StridedShard(d, split_factor=k)`` (dim ``d`` cut into ``k`` equal blocks, each sharded
over the ranks: a rank holds its piece of every block, in block order; fused projections
use it, see :mod:`fxtp.passes.strided`). Shard dims are normalized to be non-negative for the
tensor they describe.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

R = Replicate()
P = Partial()
INF = math.inf
LOCAL_COPY_COST = 1e-3  # a chunk costs no communication, but prefer not to move at all
LATENCY = 1.0  # a collective's fixed cost, in bytes: breaks ties between equal byte counts


def is_sharded(p) -> bool:
    """``Shard`` or ``_StridedShard`` (which is not a ``Shard`` subclass)."""
    return isinstance(p, (Shard, _StridedShard))


def split_factor(p) -> int:
    """The number of blocks a sharded dim is cut into before sharding: 1 for ``Shard``."""
    return p.split_factor if isinstance(p, _StridedShard) else 1


def with_dim(p, dim: int):
    """The placement ``p`` (sharded) with its dim replaced, keeping any split factor."""
    k = split_factor(p)
    return _StridedShard(dim, split_factor=k) if k > 1 else Shard(dim)


def normalize(p: Optional[Placement], ndim: int) -> Optional[Placement]:
    """``Shard(-1)`` -> ``Shard(ndim - 1)``; other placements unchanged."""
    if is_sharded(p) and p.dim < 0:
        if p.dim + ndim < 0:
            raise ValueError(f"{p} is out of range for a {ndim}-d tensor")
        return with_dim(p, p.dim + ndim)
    return p


def is_replicate(p) -> bool:
    return isinstance(p, Replicate)


def local_part(value: torch.Tensor, p, rank: int, world: int) -> torch.Tensor:
    """The part of the global ``value`` that ``rank`` holds under ``p`` (a view).
    ``_StridedShard(d, k)``: ``cat([block.chunk(world, d)[rank] for block in
    value.chunk(k, d)], d)``, which needs the dim's size to divide by ``k * world``."""
    if not is_sharded(p):
        return value
    k = split_factor(p)
    if k == 1:
        return value.chunk(world, p.dim)[rank]
    if value.shape[p.dim] % (k * world):
        raise ValueError(f"{describe(p)}: dim {p.dim} of size {value.shape[p.dim]} does not "
                         f"divide into {k} blocks of {world} shards")
    return torch.cat([block.chunk(world, p.dim)[rank] for block in value.chunk(k, p.dim)],
                     p.dim)


def size_hint(size) -> int:
    """A dim's size: an int as is, a symbolic size by its hint (1024 where it has none)."""
    if isinstance(size, int):
        return size
    return int(size.node.hint) if size.node.has_hint() else 1024


def numel_hint(val: torch.Tensor) -> int:
    """Number of elements, using size hints for symbolic dims."""
    n = 1
    for s in val.shape:
        n *= size_hint(s)
    return n


def transition_cost(src: Placement, dst: Placement, val: torch.Tensor, world: int) -> float:
    """Bytes one rank sends to turn ``src`` into ``dst`` (ring algorithms), plus
    ``LATENCY`` per collective (so fewer collectives win ties, e.g. on one rank)."""
    if src == dst:
        return 0.0
    nbytes = numel_hint(val) * val.dtype.itemsize
    share = (world - 1) / world * nbytes + LATENCY
    if isinstance(dst, Partial):
        return INF  # fxtp never creates partial values by redistribution
    if isinstance(src, Partial):
        # A reduce-scatter moves half an all-reduce's bytes, but the shards then need an
        # all-gather downstream unless a plan layout asks for them, so the choice between
        # reducing to Shard and to Replicate is left to explicit layouts: cost them alike.
        return 2 * share + (LOCAL_COPY_COST if is_sharded(dst) else 0.0)
    if is_sharded(dst):
        return LOCAL_COPY_COST if isinstance(src, Replicate) else share + LOCAL_COPY_COST
    return share  # all-gather


def transition_steps(src: Placement, dst: Placement) -> list[tuple[str, Optional[Placement]]]:
    """The collectives that turn ``src`` into ``dst``: ``[(kind, sharding), ...]`` with kinds
    ``all_reduce``, ``reduce_scatter``, ``all_gather`` and ``shard`` (local chunk), and the
    sharding each one gathers from or produces (``None`` for ``all_reduce``)."""
    if src == dst:
        return []
    if isinstance(src, Partial):
        return [("all_reduce", None)] if isinstance(dst, Replicate) else \
            [("reduce_scatter", dst)]
    if isinstance(src, Replicate):
        return [("shard", dst)]
    steps = [("all_gather", src)]
    return steps + [("shard", dst)] if is_sharded(dst) else steps


def describe(p) -> str:
    """Short text for dumps: ``S(1)``, ``S(1)/3`` (strided in 3 blocks), ``R``, ``P``;
    tuples joined with commas."""
    if p is None:
        return "-"
    if isinstance(p, (tuple, list)):
        return "(" + ", ".join(describe(q) for q in p) + ")"
    if is_sharded(p):
        k = split_factor(p)
        return f"S({p.dim})" + (f"/{k}" if k > 1 else "")
    return "R" if isinstance(p, Replicate) else "P"
