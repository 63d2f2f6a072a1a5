"""Placement algebra: normalizing, comparing, costing and planning placement changes.

Placements are torch's own ``Shard(d)``, ``Replicate()`` and ``Partial()`` objects, and
``_StridedShard(d, split_factor=k)`` (dim ``d`` cut into ``k`` equal blocks, each sharded
over the ranks: a rank holds its piece of every block, in block order; fused projections
use it, see :mod:`fxtp.passes.strided`), fxtp's own :class:`BlockShard` (the same with
blocks of unequal sizes: gpt-fast's fused ``wqkv`` under grouped-query attention), and
fxtp's own :class:`UnitShard` (a dim cut into
equal units, such as heads or vocabulary rows, dealt out whole: unevenly when their number
does not divide by the world size, in groups of ranks when there are fewer units than
ranks). Shard dims are normalized to be non-negative for the tensor they describe.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from ..kernels.dealing import unit_span
from ..kernels.torch_compat import StridedShard

R = Replicate()
P = Partial()
INF = math.inf
LOCAL_COPY_COST = 1e-3  # a chunk costs no communication, but prefer not to move at all
LATENCY = 1.0  # a collective's fixed cost, in bytes: breaks ties between equal byte counts


class _FieldPlacement(Placement):
    """A placement of fxtp's own, a frozen dataclass over torch's C++ ``Placement``."""

    def __post_init__(self):  # torch 2.11's C++ Placement must see its __init__ called
        Placement.__init__(self)

    def __reduce__(self):  # pickle by fields
        return type(self), tuple(getattr(self, f.name) for f in fields(self))

    def __fx_repr__(self) -> tuple[str, dict]:
        """How generated code writes it (a graph may pass it to an op as a constant)."""
        cls = type(self)
        values = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))
        return f"{cls.__name__}({values})", {cls.__name__: cls}


@dataclass(frozen=True)
class UnitShard(_FieldPlacement):
    """Dim ``dim`` cut into ``units`` equal units (heads, vocabulary rows), each rank
    holding whole units. With ``units >= world`` they are dealt as ``torch.chunk`` deals
    them, ``ceil(units / world)`` per rank, the last ranks getting fewer (or none): a
    vocabulary of 50257 at 4 ranks, 6 heads at 4 (2, 2, 2, 0). With ``units < world``
    (dividing it) each unit is held by ``world / units`` consecutive ranks: 2 KV heads at
    4 ranks, ranks 0-1 hold head 0; a single unit (one KV head: multi-query attention) is
    held whole by every rank, whatever ``dim`` says. Only used where ``Shard(dim)`` would
    not say the same (``units`` not a multiple of ``world``), and only on static sizes.

    Gradients of a value placed so follow the placement: with ``units >= world`` each rank
    holds its units' gradient, as under ``Shard``; with fewer units each rank holds its own
    contribution to its unit's gradient (they are summed where the value meets a
    replicated or parameter input, by the usual gradient all-reduce)."""

    dim: int
    units: int

    def __str__(self):
        return f"UnitShard(dim={self.dim}, units={self.units})"


@dataclass(frozen=True)
class BlockShard(_FieldPlacement):
    """Dim ``dim`` cut into consecutive blocks of the given global sizes (q, k and v of a
    fused projection: ``(dim, kv, kv)``), each sharded over the ranks as ``Shard`` shards
    it: a rank holds its chunk of every block, in block order. Every size divides by the
    world size. ``_StridedShard(dim, k)`` is the equal-block case, which DTensor describes;
    this one it does not (such parameters stay plain local tensors, see
    :mod:`fxtp.edges.dtensor_params`)."""

    dim: int
    blocks: tuple

    def __str__(self):
        return f"BlockShard(dim={self.dim}, blocks={self.blocks})"


def is_whole(p) -> bool:
    """A :class:`UnitShard` of a single unit: every rank holds the whole tensor."""
    return isinstance(p, UnitShard) and p.units == 1


def is_grouped(p, world: int) -> bool:
    """A :class:`UnitShard` with fewer units than ranks (each unit held by a group)."""
    return isinstance(p, UnitShard) and p.units < world




def dealt_shard(dim: int, size: int, world: int):
    """``Shard(dim)`` of a dim of ``size``, or, where it does not divide by the world size,
    a :class:`UnitShard` of its elements (dealt as ``torch.chunk`` deals them)."""
    return Shard(dim) if size % world == 0 else UnitShard(dim, size)


def local_range(p, size: int, rank: int, world: int) -> tuple[int, int]:
    """``(start, length)`` of the elements of a dim of ``size`` that ``rank`` holds under
    ``Shard`` or :class:`UnitShard` ``p`` (for ``Shard``, ``torch.chunk``'s)."""
    return unit_span(p.units if isinstance(p, UnitShard) else size, size, rank, world)


def dtensor_placement(p, size: int, world: int):
    """The DTensor placement that lays a dim of ``size`` out as ``p`` does, or ``None``:
    a :class:`UnitShard` of single elements is ``Shard`` (DTensor deals uneven dims as
    ``torch.chunk`` does); one of larger units (heads) or of groups has none, nor has
    :class:`BlockShard`."""
    if isinstance(p, BlockShard):
        return None
    if not isinstance(p, UnitShard):
        return p
    return Shard(p.dim) if p.units == size and p.units >= world else None


def is_sharded(p) -> bool:
    """``Shard``, ``_StridedShard`` (which is not a ``Shard`` subclass), :class:`BlockShard`
    or :class:`UnitShard`."""
    return isinstance(p, (Shard, StridedShard, BlockShard, UnitShard))


def shardings_over(dims, shape, world: int, arrived) -> list:
    """The placements on one of ``dims`` that a kernel taking any partition of them accepts
    for a tensor of ``shape``: an even ``Shard`` of each dim of static size, and
    ``arrived``, the placement the tensor comes in, where it is sharded on one of them with
    each element on one rank (not a unit several ranks hold)."""
    offered = [Shard(d) for d in sorted(dims)
               if isinstance(shape[d], int) and shape[d] % world == 0]
    if is_sharded(arrived) and arrived.dim in dims and not is_grouped(arrived, world) and \
            arrived not in offered:
        offered.append(arrived)
    return offered


def is_blocked(p) -> bool:
    """A dim cut into blocks, each sharded: ``_StridedShard`` or :class:`BlockShard`."""
    return isinstance(p, (StridedShard, BlockShard))


def blocks(p):
    """The blocks a sharded dim is cut into before sharding, as the collectives take them:
    their number when equal (1 for ``Shard``, ``k`` for ``_StridedShard``), their global
    sizes for :class:`BlockShard`."""
    if isinstance(p, BlockShard):
        return p.blocks
    return p.split_factor if isinstance(p, StridedShard) else 1


def cut_in_blocks(dim: int, sizes) -> Placement:
    """Dim ``dim`` cut in blocks of ``sizes`` (at least 2), each sharded:
    ``_StridedShard`` when they are equal (DTensor describes it), else
    :class:`BlockShard`."""
    sizes = tuple(sizes)
    if len(set(sizes)) == 1:
        return StridedShard(dim, split_factor=len(sizes))
    return BlockShard(dim, sizes)


def block_sizes(p, size: int) -> list[int]:
    """The global size of each block of a dim of ``size`` placed ``p`` (one block for
    ``Shard``)."""
    cut = blocks(p)
    return [size // cut] * cut if isinstance(cut, int) else list(cut)


def block_bounds(p, size: int) -> list[tuple[int, int]]:
    """The global ``(start, end)`` of each block of a blocked dim of ``size``."""
    sizes = block_sizes(p, size)
    ends = [sum(sizes[:i + 1]) for i in range(len(sizes))]
    return [(end - b, end) for b, end in zip(sizes, ends)]


def with_dim(p, dim: int):
    """The placement ``p`` (sharded) with its dim replaced, keeping any blocks or unit
    count."""
    if isinstance(p, UnitShard):
        return UnitShard(dim, p.units)
    if isinstance(p, BlockShard):
        return BlockShard(dim, p.blocks)
    k = blocks(p)
    return StridedShard(dim, split_factor=k) if k > 1 else Shard(dim)


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
    value.chunk(k, d)], d)``, which needs the dim's size to divide by ``k * world``;
    :class:`BlockShard` likewise over its blocks."""
    if not is_sharded(p):
        return value
    if isinstance(p, UnitShard):
        return value.narrow(p.dim, *local_range(p, value.shape[p.dim], rank, world))
    if blocks(p) == 1:
        return value.chunk(world, p.dim)[rank]
    sizes = block_sizes(p, value.shape[p.dim])
    if sum(sizes) != value.shape[p.dim] or any(b % world for b in sizes):
        raise ValueError(f"{describe(p)}: dim {p.dim} of size {value.shape[p.dim]} does not "
                         f"divide into blocks {sizes} of {world} shards each")
    return torch.cat([block.chunk(world, p.dim)[rank]
                      for block in value.split(sizes, p.dim)], p.dim)


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
    if is_narrowing(src, dst, val, world):
        return LOCAL_COPY_COST
    if isinstance(src, Partial):
        # A reduce-scatter moves half an all-reduce's bytes, but the shards then need an
        # all-gather downstream unless a plan layout asks for them, so the choice between
        # reducing to Shard and to Replicate is left to explicit layouts: cost them alike.
        return 2 * share + (LOCAL_COPY_COST if is_sharded(dst) else 0.0)
    if is_sharded(dst):
        return LOCAL_COPY_COST if isinstance(src, Replicate) else share + LOCAL_COPY_COST
    return share  # all-gather


def is_narrowing(src, dst, val: torch.Tensor, world: int) -> bool:
    """Does every rank hold ``dst``'s elements within its ``src`` ones, so that a local
    slice turns one into the other? From ``Replicate`` to a :class:`UnitShard`, and from
    a grouped ``UnitShard`` to ``Shard`` on the same dim (each rank's chunk lies in its
    group's unit; a single unit is the whole tensor, on any dim)."""
    if not isinstance(dst, (Shard, UnitShard)) or is_blocked(dst):
        return False
    if isinstance(src, Replicate):
        return isinstance(dst, UnitShard)
    return isinstance(src, UnitShard) and (src.dim == dst.dim or src.units == 1) and \
        is_grouped(src, world) and isinstance(val.shape[dst.dim], int) and all(
            _within(local_range(dst, val.shape[dst.dim], r, world),
                    local_range(src, val.shape[dst.dim], r, world)) for r in range(world))


def _within(inner, outer) -> bool:
    return outer[0] <= inner[0] and inner[0] + inner[1] <= outer[0] + outer[1]


def transition_steps(src: Placement, dst: Placement, val: Optional[torch.Tensor] = None,
                     world: int = 1) -> list[tuple[str, Optional[Placement]]]:
    """The collectives that turn ``src`` into ``dst``: ``[(kind, sharding), ...]`` with kinds
    ``all_reduce``, ``reduce_scatter``, ``all_gather``, ``shard`` (local chunk) and
    ``narrow`` (a local slice: :func:`is_narrowing`), and the sharding each one gathers
    from or produces (``None`` for ``all_reduce``). ``val`` (the value's global
    meta tensor) and ``world`` decide narrowing."""
    if src == dst:
        return []
    if val is not None and is_narrowing(src, dst, val, world):
        return [("narrow", dst)]
    if isinstance(dst, UnitShard):  # held whole or reduced first, then sliced
        steps = transition_steps(src, R)
        return steps + [("narrow", dst)]
    if isinstance(src, Partial):
        return [("all_reduce", None)] if isinstance(dst, Replicate) else \
            [("reduce_scatter", dst)]
    if isinstance(src, Replicate):
        return [("shard", dst)]
    steps = [("all_gather", src)]
    return steps + [("shard", dst)] if is_sharded(dst) else steps


def describe(p) -> str:
    """Short text for dumps: ``S(1)``, ``S(1)/3`` (strided in 3 blocks), ``S(1)/512+256+256``
    (in blocks of those sizes), ``S(1)~6`` (in 6 units), ``R``, ``P``;
    tuples joined with commas."""
    if p is None:
        return "-"
    if isinstance(p, (tuple, list)):
        return "(" + ", ".join(describe(q) for q in p) + ")"
    if isinstance(p, UnitShard):
        return f"S({p.dim})~{p.units}"
    if is_sharded(p):
        cut = blocks(p)
        if isinstance(cut, tuple):
            return f"S({p.dim})/" + "+".join(map(str, cut))
        return f"S({p.dim})" + (f"/{cut}" if cut > 1 else "")
    return "R" if isinstance(p, Replicate) else "P"
