"""Ops along a dim (softmax, cumulative ops, sorting, ``topk``, ``diff``) and reductions
(sums and means, extrema, logical ``any`` / ``all``, variances, vector norms)."""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, Optional

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate

from ...kernels.local_ops import mean_of_shard
from ...kernels.sharded_norm import norm_of_shards
from ...kernels.sharded_softmax import (any_of_shards, arg_of_shards, cumsum_of_shards,
                                        extremum_of_shards, logsumexp_of_shards,
                                        pick_of_shards, softmax_of_shards, topk_of_shards)
from ..dimspec import DimSpec, fixed_label
from ..graph import op_arg, output_vals, tensor_inputs, val
from ..placement import UnitShard, is_blocked, is_sharded, local_range, shardings_over
from .base import Rule, communicating, dims_arg, local_size, ndim_of

aten = torch.ops.aten


ALL_DIMS = lambda node: list(range(ndim_of(node.args[0])))  # noqa: E731
"""The dims of an op without a dim argument (``sum(x)``): all of them."""


def along(dims_of: Callable[[fx.Node], list[int]], partial: str = "none"):
    """An op that keeps its input's shape and computes along ``dims_of(node)`` (softmax,
    cumulative sums, sorting): those dims never shard, the others shard freely. Every
    output (values, indices) has the input's shape."""
    def spec(node):
        n = ndim_of(node.args[0])
        dims = {d % n for d in dims_of(node)} if n else set()
        labels = tuple(f"d{j}!" if j in dims else f"d{j}" for j in range(n))
        return DimSpec((labels,) + (None,) * (len(tensor_inputs(node)) - 1),
                       tuple(labels for _ in output_vals(node)), partial)
    return Rule(spec)


def reduction(dims_of: Callable[[fx.Node], list[int]], summed: bool = False,
              partial: str = "none", keepdim_arg: Optional[int] = 2):
    """An op that reduces ``dims_of(node)`` away (kept as size 1 with ``keepdim``, read from
    argument ``keepdim_arg``; every output, e.g. values and indices, has the reduced
    shape). With ``summed`` sharding a reduced dim leaves per-rank partial sums
    (``Partial``); otherwise reduced dims never shard. ``partial="sum"``: a Partial input
    gives a Partial output (the op is linear)."""
    def spec(node):
        n = ndim_of(node.args[0])
        dims = {d % n for d in dims_of(node)} if n else set()
        mark = "+" if summed else "!"
        labels = tuple(f"d{j}{mark}" if j in dims else f"d{j}" for j in range(n))
        keepdim = keepdim_arg is not None and op_arg(node, keepdim_arg, "keepdim", False)
        out = tuple(fixed_label() if j in dims else labels[j] for j in range(n)
                    if keepdim or j not in dims)
        return DimSpec((labels,) + (None,) * (len(tensor_inputs(node)) - 1),
                       tuple(out for _ in output_vals(node)), partial)
    return Rule(spec)


def softmax():
    """Softmax and log-softmax along argument 1: along a sharded dim too, by
    :mod:`~fxtp.kernels.sharded_softmax` (the output placed as the input)."""
    return replace(along(dims_arg(1)), **communicating(softmax_rule_parts()))


def extremum(largest: bool):
    """``amax`` / ``amin`` (``max`` / ``min`` of every element): over sharded dims too,
    replicated by one all-reduce."""
    return replace(reduction(dims_arg(1, omitted="all")),
                   **communicating(reduction_rule_parts("amax" if largest else "amin")))


def logical(dims_of: Callable[[fx.Node], list[int]], every: bool, keepdim_arg=2):
    """``any`` (``every``: ``all``) over ``dims_of(node)``: over sharded dims too,
    replicated by one all-reduce."""
    return replace(reduction(dims_of, keepdim_arg=keepdim_arg),
                   **communicating(reduction_rule_parts("all" if every else "any")))


def pick(largest: bool, values: bool):
    """``max`` / ``min`` along a dim (``values``: values and indices) and ``argmax`` /
    ``argmin``: along a sharded dim too, each rank's candidate all-gathered."""
    dims = dims_arg(1) if values else dims_arg(1, omitted="all")
    return replace(reduction(dims), **communicating(pick_rule_parts(largest, values)))


def vector_norm():
    """A p-norm over ``dim`` (argument 2, every dim when omitted) of order argument 1:
    a reduction whose reduced dims may also arrive sharded, for finite ``p > 0``: the
    local op then sums every rank's powers (one all-reduce, see
    :mod:`~fxtp.kernels.sharded_norm`) into a replicated norm."""
    dims_of = dims_arg(2, omitted="all")
    return replace(reduction(dims_of, keepdim_arg=3), **communicating(norm_rule_parts(dims_of)))


def _mean_of_shard(dims_of):
    """A mean over a sharded dim: each rank's mean of its shard, scaled by its share of
    that dim (``1 / world`` for equal shards), is its Partial contribution (OLMo-2
    normalizes q and k over all heads)."""
    def local(node, inputs, output, group):
        p = inputs[0]
        n = ndim_of(node.args[0])
        if not (is_sharded(p) and p.dim in {d % n for d in dims_of(node)}):
            return node.target, node.args, node.kwargs
        dim = None if node.target is aten.mean.default else op_arg(node, 1, "dim")
        share = (local_size(p, val(node.args[0]).shape[p.dim], group),
                 val(node.args[0]).shape[p.dim]) if isinstance(p, UnitShard) else \
            (1, group.world)
        return mean_of_shard, (node.args[0], *share), dict(
            dim=dim, keepdim=op_arg(node, 2, "keepdim", False), dtype=node.kwargs.get("dtype"))
    return local


def _diff_spec(node):
    """``diff(x, n, dim, prepend, append)``: ``dim`` never shards; ``prepend`` / ``append``
    shard with ``x`` on the other dims."""
    n = ndim_of(node.args[0])
    d = op_arg(node, 2, "dim", -1) % n
    labels = tuple(f"d{j}!" if j == d else f"d{j}" for j in range(n))
    return DimSpec(tuple(labels for _ in tensor_inputs(node)), (labels,))


# --- the kernels that reduce over a sharded dim without gathering it ---------------------

def _offered(node: fx.Node, dims: set, world: int, actual) -> list:
    """The placements of the input sharded on one of ``dims`` these kernels take."""
    return shardings_over(dims, val(node.args[0]).shape, world, actual[0] if actual else None)


def _along(node: fx.Node) -> set:
    n = val(node.args[0]).dim()
    return {node.args[1] % n} if n else set()


def _reduced(node: fx.Node) -> set:
    """The dims an ``amax`` / ``amin`` / ``logsumexp`` / ``any`` / ``all`` / ``max``
    reduces (``[]``, ``None`` or none given: all)."""
    n = val(node.args[0]).dim()
    dims = op_arg(node, 1, "dim", None)
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    return {d % n for d in dims} if dims else set(range(n))


_SOFTMAX = {  # op -> (log, safe, its dtype argument: (index, name) or a flag for fp32)
    aten.softmax.int: (False, False, (2, "dtype")),
    aten.log_softmax.int: (True, False, (2, "dtype")),
    aten._safe_softmax.default: (False, True, (2, "dtype")),
    aten._softmax.default: (False, False, "half_to_float"),
    aten._log_softmax.default: (True, False, "half_to_float"),
}


def softmax_rule_parts():
    """``(extra, local_op)`` of a :class:`~fxtp.passes.rules.Rule` for the softmax ops:
    an input sharded along the softmax dim gives an output placed as it is."""
    def extra(node: fx.Node, world: int, actual=()):
        if val(node.args[0]).dim():
            for p in _offered(node, _along(node), world, actual):
                yield (p,), (p,)

    def local_op(node: fx.Node, inputs, output, group):
        if not (is_sharded(inputs[0]) and inputs[0].dim in _along(node)):
            return node.target, node.args, node.kwargs
        log, safe, dtype_arg = _SOFTMAX[node.target]
        if dtype_arg == "half_to_float":
            dtype = torch.float32 if node.args[2] else None
        else:
            dtype = op_arg(node, *dtype_arg)
        return softmax_of_shards, (node.args[0], node.args[1], log, safe, dtype,
                                   group.name), {}

    return extra, local_op


def pick_rule_parts(largest: bool, values: bool):
    """``(extra, local_op)`` for ``max.dim`` / ``min.dim`` (``values``: values and indices)
    or ``argmax`` / ``argmin`` along a dim that arrives sharded: replicated results.
    ``argmax`` without a dim (over the flattened tensor) keeps to its spec."""
    def dim_of(node):
        dim = op_arg(node, 1, "dim")
        return None if dim is None or not val(node.args[0]).dim() else \
            dim % val(node.args[0]).dim()

    def extra(node: fx.Node, world: int, actual=()):
        d = dim_of(node)
        if d is None or not isinstance(val(node.args[0]).shape[d], int):
            return  # each rank's offset into the dim is a number
        for p in _offered(node, {d}, world, actual):
            if not is_blocked(p):  # the indices count from one offset per rank
                yield (p,), (Replicate(),) * (2 if values else 1)

    def local_op(node: fx.Node, inputs, output, group):
        d = dim_of(node)
        if d is None or not (is_sharded(inputs[0]) and inputs[0].dim == d):
            return node.target, node.args, node.kwargs
        x = node.args[0]
        offset = local_range(inputs[0], val(x).shape[d], group.rank, group.world)[0]
        return (pick_of_shards if values else arg_of_shards), (
            x, d, op_arg(node, 2, "keepdim", False), largest, offset, group.rank, group.world,
            group.name), {}

    return extra, local_op


_REDUCTIONS = {  # kind -> (kernel, its flag)
    "logsumexp": (logsumexp_of_shards,), "amax": (extremum_of_shards, True),
    "amin": (extremum_of_shards, False), "any": (any_of_shards, False),
    "all": (any_of_shards, True),
}


def reduction_rule_parts(kind: str):
    """``(extra, local_op)`` for a reduction of a kind of :data:`_REDUCTIONS` (``amax``:
    ``max`` of every element too): an input sharded on a reduced dim gives a replicated
    output."""
    kernel, *flag = _REDUCTIONS[kind]

    def extra(node: fx.Node, world: int, actual=()):
        if val(node.args[0]).dim():
            for p in _offered(node, _reduced(node), world, actual):
                yield (p,), (Replicate(),)

    def local_op(node: fx.Node, inputs, output, group):
        dims = _reduced(node)
        if not (is_sharded(inputs[0]) and inputs[0].dim in dims):
            return node.target, node.args, node.kwargs
        return kernel, (node.args[0], sorted(dims), op_arg(node, 2, "keepdim", False), *flag,
                        group.name), {}

    return extra, local_op


def scan_rule_parts():
    """``(extra, local_op)`` for ``cumsum`` along a dim that arrives sharded, each element
    on one rank and the ranks' parts in order (no blocks): the output placed as the
    input."""
    def extra(node: fx.Node, world: int, actual=()):
        x = val(node.args[0])
        if x.dim() and all(isinstance(x.shape[d], int) for d in _along(node)):
            for p in _offered(node, _along(node), world, actual):
                if not is_blocked(p):  # each rank's offset into the dim is a number
                    yield (p,), (p,)

    def local_op(node: fx.Node, inputs, output, group):
        if not (is_sharded(inputs[0]) and inputs[0].dim in _along(node)):
            return node.target, node.args, node.kwargs
        d = inputs[0].dim
        size = val(node.args[0]).shape[d]
        parts = [local_range(inputs[0], size, r, group.world) for r in range(group.world)]
        start, length = parts[group.rank]
        before = [n > 0 and s + n <= start for s, n in parts]
        after = [n > 0 and s >= start + length for s, n in parts]
        return cumsum_of_shards, (node.args[0], d, op_arg(node, 2, "dtype"), before, after,
                                  group.world, group.name), {}

    return extra, local_op


def topk_rule_parts():
    """``(extra, local_op)`` for ``topk`` along a dim that arrives sharded (no blocks):
    replicated values and indices."""
    def extra(node: fx.Node, world: int, actual=()):
        x = val(node.args[0])
        d = _topk_dim(node)
        if d is None or not isinstance(x.shape[d], int) or not isinstance(node.args[1], int):
            return
        for p in _offered(node, {d}, world, actual):
            if not is_blocked(p):  # the indices count from one offset per rank
                yield (p,), (Replicate(), Replicate())

    def local_op(node: fx.Node, inputs, output, group):
        d = _topk_dim(node)
        if d is None or not (is_sharded(inputs[0]) and inputs[0].dim == d):
            return node.target, node.args, node.kwargs
        size = val(node.args[0]).shape[d]
        offset = local_range(inputs[0], size, group.rank, group.world)[0]
        return topk_of_shards, (node.args[0], node.args[1], d, op_arg(node, 3, "largest", True),
                                offset, size, group.world, group.name), {}

    return extra, local_op


def _topk_dim(node: fx.Node):
    n = val(node.args[0]).dim()
    return op_arg(node, 2, "dim", -1) % n if n else None


def norm_rule_parts(dims_of: Callable[[fx.Node], list[int]], ord_arg: int = 1,
                    keepdim_arg: int = 3):
    """``(extra, local_op)`` of a :class:`~fxtp.passes.rules.Rule` for a norm op whose
    order is argument ``ord_arg`` (default 2) and whose reduced dims are ``dims_of``."""
    def order(node):
        p = op_arg(node, ord_arg, "ord")
        return 2.0 if p is None else float(p)

    def reduced(node):
        n = val(node.args[0]).dim()
        return {d % n for d in dims_of(node)} if n else set()

    def extra(node: fx.Node, world: int, actual=()):
        p = order(node)
        if not (0 < p < math.inf):
            return
        for placement in shardings_over(reduced(node), val(node.args[0]).shape, world,
                                        actual[0] if actual else None):
            yield (placement,), (Replicate(),)

    def local_op(node: fx.Node, inputs, output, group):
        p, dims = order(node), reduced(node)
        if not (is_sharded(inputs[0]) and inputs[0].dim in dims and 0 < p < math.inf):
            return node.target, node.args, node.kwargs
        return norm_of_shards, (node.args[0], p, sorted(dims),
                                op_arg(node, keepdim_arg, "keepdim", False),
                                node.kwargs.get("dtype"), group.name), {}

    return extra, local_op


RULES: dict = {
    # along a dim
    aten.softmax.int: softmax(),
    aten._softmax.default: softmax(),
    aten._safe_softmax.default: softmax(),
    aten.log_softmax.int: softmax(),
    aten._log_softmax.default: softmax(),
    aten.cumsum.default: replace(along(dims_arg(1), partial="sum"),
                                 **communicating(scan_rule_parts())),
    aten.cumsum_.default: along(dims_arg(1), partial="sum"),
    aten.cumprod.default: along(dims_arg(1)),
    aten.logcumsumexp.default: along(dims_arg(1)),
    aten.cummax.default: along(dims_arg(1)),
    aten.cummin.default: along(dims_arg(1)),
    aten.sort.default: along(dims_arg(1, omitted="last")),
    aten.sort.stable: along(dims_arg(2, omitted="last")),
    aten.argsort.default: along(dims_arg(1, omitted="last")),
    aten.argsort.stable: along(dims_arg(2, omitted="last")),
    aten.topk.default: replace(along(dims_arg(2, omitted="last")),
                               **communicating(topk_rule_parts())),
    aten.diff.default: Rule(_diff_spec),
    # reductions
    aten.sum.default: reduction(ALL_DIMS, summed=True, partial="sum",
                                keepdim_arg=None),
    aten.sum.dim_IntList: reduction(dims_arg(1, omitted="all"), summed=True, partial="sum"),
    aten.nansum.default: reduction(dims_arg(1, omitted="all"), summed=True, partial="sum"),
    aten.mean.default: Rule(reduction(ALL_DIMS, summed=True, partial="sum", keepdim_arg=None)
                            .spec, local_op=_mean_of_shard(ALL_DIMS)),
    aten.mean.dim: Rule(reduction(dims_arg(1, omitted="all"), summed=True, partial="sum").spec,
                        local_op=_mean_of_shard(dims_arg(1, omitted="all"))),
    aten.prod.default: reduction(ALL_DIMS, keepdim_arg=None),
    aten.prod.dim_int: reduction(dims_arg(1)),
    aten.amax.default: extremum(largest=True),
    aten.amin.default: extremum(largest=False),
    aten.max.default: extremum(largest=True),
    aten.min.default: extremum(largest=False),
    aten.max.dim: pick(largest=True, values=True),
    aten.min.dim: pick(largest=False, values=True),
    aten.argmax.default: pick(largest=True, values=False),
    aten.argmin.default: pick(largest=False, values=False),
    aten.any.default: logical(ALL_DIMS, every=False, keepdim_arg=None),
    aten.any.dim: logical(dims_arg(1), every=False),
    aten.any.dims: logical(dims_arg(1, omitted="all"), every=False),
    aten.all.default: logical(ALL_DIMS, every=True, keepdim_arg=None),
    aten.all.dim: logical(dims_arg(1), every=True),
    aten.all.dims: logical(dims_arg(1, omitted="all"), every=True),
    aten.logsumexp.default: replace(reduction(dims_arg(1)),
                                    **communicating(reduction_rule_parts("logsumexp"))),
    aten.var.correction: reduction(dims_arg(1, omitted="all"), keepdim_arg=3),
    aten.std.correction: reduction(dims_arg(1, omitted="all"), keepdim_arg=3),
    aten.var_mean.correction: reduction(dims_arg(1, omitted="all"), keepdim_arg=3),
    aten.std_mean.correction: reduction(dims_arg(1, omitted="all"), keepdim_arg=3),
    aten.var.dim: reduction(dims_arg(1, omitted="all"), keepdim_arg=3),
    aten.std.dim: reduction(dims_arg(1, omitted="all"), keepdim_arg=3),
    aten.linalg_vector_norm.default: vector_norm(),
    aten.norm.ScalarOpt_dim: vector_norm(),
    aten.count_nonzero.dim_IntList: reduction(dims_arg(1, omitted="all"), keepdim_arg=None),
    aten.count_nonzero.default: reduction(dims_arg(1, omitted="all"), keepdim_arg=None),
    aten.median.dim: reduction(dims_arg(1)),
    aten.kthvalue.default: reduction(dims_arg(2, omitted="last"), keepdim_arg=3),
}
