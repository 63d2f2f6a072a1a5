"""Differentiable collectives over a process group, built on torch's functional collectives.

Each function here is what a placement change becomes in the rewritten graph. Forward and
backward are conjugates, so autograd on local tensors yields correct local gradients:

====================  ==========================  ==============================
function              forward                     backward
====================  ==========================  ==============================
``all_reduce``        Partial -> Replicate        identity
``reduce_scatter``    Partial -> Shard(d)         all-gather
``all_gather``        Shard(d) -> Replicate       local chunk, or reduce-scatter
                                                  when the gradient is partial
``shard``             Replicate -> Shard(d)       all-gather (no forward comm)
``grad_sync``         identity                    all-reduce of a partial gradient
``grad_sync_bucket``  identity on n tensors       one all-reduce of all their
                                                  partial gradients (per dtype)
``all_gather_units``  UnitShard(d) -> Replicate   this rank's units, or an all-
                                                  reduce first when partial
====================  ==========================  ==============================

``all_gather_units`` gathers whole units dealt unevenly or to groups of ranks
(:class:`~fxtp.passes.placement.UnitShard`): every rank's piece is padded to the longest,
gathered, and each unit taken once. With fewer units than ranks the gradient goes to the
first rank of each group (the others' contributions are zero), so that summing a group's
contributions gives it once.

``blocks=k`` makes the sharding ``_StridedShard(d, k)``: dim ``d`` is ``k`` equal blocks
and a rank holds its piece of every block, in block order; ``blocks=(b0, b1, ...)`` does
the same with blocks of those global sizes (:class:`~fxtp.passes.placement.BlockShard`).
The blocks are reordered locally around the same collectives (block-major on the full
tensor, rank-major on the wire), so a blocked gather or scatter moves exactly the bytes of
a contiguous one.

Collectives are the ``torch.ops._c10d_functional`` ops followed by ``wait_tensor``, which
inductor lowers natively. Collectives along a dim other than 0 move it to the front and
back. Every result is a tensor of its own, never a view, so user code may ``view`` it or
write it in place. Groups are passed by name so graphs stay printable.

The ``*_bucket`` functions issue one collective for several tensors (flatten, concatenate,
one collective, split; ``grad_sync_bucket`` copies nothing forward); their backward is
bucketed too. Under ``torch.compile`` the functions in :data:`COLLECTIVES` appear in
dynamo's graph as single calls (``allow_in_graph``), which graph passes recognize; autograd
traces through them when the graph is lowered.
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from .dealing import unit_span
from .torch_compat import c10d_functional, detect_fake_mode, function_apply

_c10d = c10d_functional

KINDS = {
    _c10d.all_reduce.default: "all_reduce",
    _c10d.all_gather_into_tensor.default: "all_gather",
    _c10d.reduce_scatter_tensor.default: "reduce_scatter",
    _c10d.all_to_all_single.default: "all_to_all",
}
"""The functional-collective ops that communicate, by kind (each is followed by a
``wait_tensor``)."""

BEFORE_ISSUE: list = []
"""Functions called with the group's name before a collective here is issued on real
tensors outside compiled code (:mod:`fxtp.runtime.first_call` has the ranks agree on errors so);
empty otherwise."""


def _tracing() -> bool:
    """Whether ops are being traced into a graph (``make_fx``: a ``torch.cond`` branch
    materialized at its call), not run on real tensors."""
    return get_proxy_mode() is not None or detect_fake_mode() is not None


def _communicate(op, *args) -> torch.Tensor:
    """Issue the functional collective ``op(*args)`` (its group last) and wait for it."""
    if not torch.compiler.is_compiling() and BEFORE_ISSUE and not _tracing():
        for check in BEFORE_ISSUE:
            check(args[-1])
    return _c10d.wait_tensor(op(*args))


def _all_reduce(x: torch.Tensor, group: str, op: str = "sum") -> torch.Tensor:
    return _communicate(_c10d.all_reduce, x.contiguous(), op, group)


def _all_gather(x: torch.Tensor, dim: int, world: int, group: str,
                blocks=1) -> torch.Tensor:
    # gathered as laid out (no copy of the input), rank-major; one copy puts each rank's
    # blocks in place along dim
    x = x.contiguous()
    out = _communicate(_c10d.all_gather_into_tensor, x, world, group)
    if dim % max(x.dim(), 1) == 0 and blocks == 1:
        return out  # rank-major is dim 0's order
    out = out.view(world, *x.shape)
    if isinstance(blocks, int):
        out = out.unflatten(dim + 1, (blocks, -1))
        return _fresh(out.movedim(0, dim + 1).flatten(dim, dim + 2))
    pieces = out.split([b // world for b in blocks], dim + 1)
    return torch.cat([p.movedim(0, dim).flatten(dim, dim + 1) for p in pieces], dim)


def _reduce_scatter(x: torch.Tensor, dim: int, world: int, group: str,
                    blocks=1) -> torch.Tensor:
    # one copy lays ``x`` out rank-major (rank r's piece of every block, as ``(world, ...)``
    # with dim ``d`` cut to the piece), so the scattered result needs no reordering
    dim %= x.dim()
    if blocks == 1:
        x = x.unflatten(dim, (world, -1)).movedim(dim, 0)
    elif isinstance(blocks, int):
        x = x.unflatten(dim, (blocks, world, -1)).movedim(dim + 1, 0).flatten(dim + 1, dim + 2)
    else:
        x = torch.cat([b.unflatten(dim, (world, -1)).movedim(dim, 0)
                       for b in x.split(list(blocks), dim)], dim + 1)
    # the leading (world, s0) merged: each rank's result comes out as its own tensor
    x = x.contiguous().flatten(0, 1)
    return _communicate(_c10d.reduce_scatter_tensor, x, "sum", world, group)


def _chunk(x: torch.Tensor, dim: int, rank: int, world: int, blocks=1) -> torch.Tensor:
    if blocks == 1:
        return _fresh(x.chunk(world, dim)[rank])
    if isinstance(blocks, int):
        pieces = x.unflatten(dim, (blocks, world, -1)).select(dim + 1, rank)
        return _fresh(pieces.flatten(dim, dim + 1))
    return torch.cat([b.chunk(world, dim)[rank] for b in x.split(list(blocks), dim)], dim)


def _gather_units(x: torch.Tensor, dim: int, units: int, size: int, world: int,
                  group: str) -> torch.Tensor:
    ranges = [unit_span(units, size, r, world) for r in range(world)]
    longest = max(length for _, length in ranges)
    x = x.movedim(dim, 0)
    padded = torch.cat([x, x.new_zeros(longest - x.shape[0], *x.shape[1:])]) \
        if x.shape[0] < longest else x
    out = _communicate(_c10d.all_gather_into_tensor, padded.contiguous(), world, group)
    pieces, covered = [], 0
    for r, (start, length) in enumerate(ranges):
        if start == covered and length:  # the first rank holding these units
            pieces.append(out.narrow(0, r * longest, length))
            covered += length
    return _fresh(torch.cat(pieces).movedim(0, dim))


def _own_units(grad: torch.Tensor, dim: int, units: int, rank: int, world: int
               ) -> torch.Tensor:
    start, length = unit_span(units, grad.shape[dim], rank, world)
    mine = grad.narrow(dim, start, length)
    first = units >= world or rank % (world // units) == 0
    return _fresh(mine) if first else torch.zeros_like(mine)


def _fresh(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of the view ``x``: user code may write a collective's result in
    place, which autograd refuses on a view a custom ``Function`` returns (and a view of its
    input would write the input)."""
    return x.clone(memory_format=torch.contiguous_format)


class _AllGatherUnits(torch.autograd.Function):
    @staticmethod
    def forward(x, dim, units, size, rank, world, group, partial_grad):
        return _gather_units(x, dim, units, size, world, group)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, dim, units, _, rank, world, group, partial_grad = inputs
        ctx.args = (dim, units, rank, world, group, partial_grad)

    @staticmethod
    def backward(ctx, grad):
        dim, units, rank, world, group, partial_grad = ctx.args
        if partial_grad:
            grad = _all_reduce(grad, group)
        return _own_units(grad, dim, units, rank, world), *(None,) * 7


class _ShardUnits(torch.autograd.Function):
    @staticmethod
    def forward(x, dim, units, rank, world, group):
        return _own_units(x, dim, units, rank, world)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, dim, units, _, world, group = inputs
        ctx.args = (dim, units, x.shape[dim], world, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_units(grad, *ctx.args), None, None, None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(x, group):
        return _all_reduce(x, group)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(x, dim, world, group, blocks):
        return _reduce_scatter(x, dim, world, group, blocks)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.args = inputs[1:]

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, *ctx.args), None, None, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(x, dim, rank, world, group, partial_grad, blocks):
        return _all_gather(x, dim, world, group, blocks)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.args = inputs[1:]

    @staticmethod
    def backward(ctx, grad):
        dim, rank, world, group, partial_grad, blocks = ctx.args
        if partial_grad:
            grad = _reduce_scatter(grad, dim, world, group, blocks)
        else:
            grad = _chunk(grad, dim, rank, world, blocks)
        return grad, None, None, None, None, None, None


class _Shard(torch.autograd.Function):
    @staticmethod
    def forward(x, dim, rank, world, group, blocks):
        return _chunk(x, dim, rank, world, blocks)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, dim, _, world, group, blocks = inputs
        ctx.args = (dim, world, group, blocks)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, *ctx.args), None, None, None, None, None


class _GradSync(torch.autograd.Function):
    @staticmethod
    def forward(x, group):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _GradSyncBucket(torch.autograd.Function):
    @staticmethod
    def forward(group, *xs):
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        out = list(grads)
        for dtype in dict.fromkeys(g.dtype for g in grads):
            idx = [i for i, g in enumerate(grads) if g.dtype == dtype]
            flat = _all_reduce(torch.cat([grads[i].reshape(-1) for i in idx]), ctx.group)
            for i, part in zip(idx, flat.split([grads[i].numel() for i in idx])):
                out[i] = part.view_as(grads[i])
        return (None, *out)


def _apply(function: type[torch.autograd.Function], *args):
    """``function.apply(*args)``, or its forward alone where grad mode is off: no gradient
    to record, and none of autograd's machinery for a compiler to trace (a nested compile
    region cannot functionalize an autograd function under ``no_grad``)."""
    if not torch.is_grad_enabled():
        return function.forward(*args)
    if torch.compiler.is_compiling():
        return function.apply(*args)
    return function_apply(function, *args)


def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """Sum a Partial tensor over ``group``; the gradient passes through unchanged."""
    return _apply(_AllReduce, x, group)


def reduce_scatter(x: torch.Tensor, dim: int, world: int, group: str,
                   blocks=1) -> torch.Tensor:
    """Sum a Partial tensor and keep this rank's chunk along ``dim``."""
    return _apply(_ReduceScatter, x, dim, world, group, blocks)


def all_gather(x: torch.Tensor, dim: int, rank: int, world: int, group: str,
               partial_grad: bool = False, blocks=1) -> torch.Tensor:
    """Concatenate every rank's shard along ``dim``. With ``partial_grad`` the incoming
    gradient is a per-rank partial sum and is reduce-scattered; otherwise it is replicated
    and this rank's chunk is taken."""
    return _apply(_AllGather, x, dim, rank, world, group, partial_grad, blocks)


def shard(x: torch.Tensor, dim: int, rank: int, world: int, group: str,
          blocks=1) -> torch.Tensor:
    """Keep this rank's chunk of a replicated tensor (no forward communication)."""
    return _apply(_Shard, x, dim, rank, world, group, blocks)


def all_gather_units(x: torch.Tensor, dim: int, units: int, size: int, rank: int, world: int,
                     group: str, partial_grad: bool = False) -> torch.Tensor:
    """Concatenate the ranks' whole units of a dim of global ``size`` dealt in ``units``
    (a :class:`~fxtp.passes.placement.UnitShard`); the gradient as in :func:`all_gather`,
    each unit's to one rank."""
    return _apply(_AllGatherUnits, x, dim, units, size, rank, world, group, partial_grad)


def shard_units(x: torch.Tensor, dim: int, units: int, rank: int, world: int, group: str
                ) -> torch.Tensor:
    """Keep this rank's whole units of a replicated tensor (``units >= world``: each unit on
    one rank); the gradient is gathered."""
    return _apply(_ShardUnits, x, dim, units, rank, world, group)


def grad_sync(x: torch.Tensor, group: str) -> torch.Tensor:
    """Identity forward; all-reduce the partial gradient backward (Megatron's ``f``)."""
    return _apply(_GradSync, x, group)


def all_reduce_bucket(xs: Sequence[torch.Tensor], group: str) -> tuple[torch.Tensor, ...]:
    """:func:`all_reduce` of each tensor in ``xs`` (one dtype), as one collective."""
    return _split_like(all_reduce(_flat_cat(xs), group), xs)


def grad_sync_bucket(xs: Sequence[torch.Tensor], group: str) -> tuple[torch.Tensor, ...]:
    """:func:`grad_sync` of each tensor in ``xs``: identity forward (no copy); backward, once
    every gradient is computed, one all-reduce of all of them per dtype (replicated
    parameters used on sharded activations: one all-reduce per step, not one each)."""
    return _apply(_GradSyncBucket, group, *xs)


def all_gather_bucket(xs: Sequence[torch.Tensor], dims: Sequence[int], rank: int, world: int,
                      group: str, partial_grad: bool = False) -> tuple[torch.Tensor, ...]:
    """:func:`all_gather` of each ``xs[i]`` along ``dims[i]``, as one collective."""
    rows = [x.movedim(d, 0) for x, d in zip(xs, dims)]
    flat = torch.cat([r.reshape(1, -1) for r in rows], dim=1)
    full = all_gather(flat, 0, rank, world, group, partial_grad)  # (world, total)
    parts = full.split([r.numel() for r in rows], dim=1)
    return tuple(p.reshape(world * r.shape[0], *r.shape[1:]).movedim(0, d)
                 for p, r, d in zip(parts, rows, dims))


def reduce_scatter_bucket(xs: Sequence[torch.Tensor], dims: Sequence[int], world: int,
                          group: str) -> tuple[torch.Tensor, ...]:
    """:func:`reduce_scatter` of each ``xs[i]`` along ``dims[i]``, as one collective."""
    rows = [x.movedim(d, 0) for x, d in zip(xs, dims)]
    flat = torch.cat([r.reshape(world, -1) for r in rows], dim=1)  # row w: rank w's chunks
    local = reduce_scatter(flat, 0, world, group)  # (1, total / world)
    parts = local.split([r.numel() // world for r in rows], dim=1)
    return tuple(p.reshape(r.shape[0] // world, *r.shape[1:]).movedim(0, d)
                 for p, r, d in zip(parts, rows, dims))


def shard_bucket(xs: Sequence[torch.Tensor], dims: Sequence[int], rank: int, world: int,
                 group: str) -> tuple[torch.Tensor, ...]:
    """:func:`shard` of each ``xs[i]`` along ``dims[i]``: one all-gather of their
    gradients (the forward copies ``xs`` once)."""
    rows = [x.movedim(d, 0) for x, d in zip(xs, dims)]
    flat = torch.cat([r.reshape(world, -1) for r in rows], dim=1)
    local = shard(flat, 0, rank, world, group)
    parts = local.split([r.numel() // world for r in rows], dim=1)
    return tuple(p.reshape(r.shape[0] // world, *r.shape[1:]).movedim(0, d)
                 for p, r, d in zip(parts, rows, dims))


def _flat_cat(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([x.reshape(-1) for x in xs])


def _split_like(flat: torch.Tensor, xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return tuple(p.view(x.shape) for p, x in zip(flat.split([x.numel() for x in xs]), xs))


COLLECTIVES = (all_reduce, reduce_scatter, all_gather, shard, grad_sync, all_gather_units,
               shard_units)
BUCKETS = {all_reduce: all_reduce_bucket, grad_sync: grad_sync_bucket,
           all_gather: all_gather_bucket, reduce_scatter: reduce_scatter_bucket,
           shard: shard_bucket}
"""Collective -> its bucketed form."""


@functools.cache
def allow_in_dynamo_graphs() -> None:
    """Have dynamo keep each of :data:`COLLECTIVES` as one call in its graphs
    (``allow_in_graph``). ``parallelize`` and the backend call it, so that importing fxtp
    does not import dynamo."""
    for fn in COLLECTIVES:
        torch.compiler.allow_in_graph(fn)
