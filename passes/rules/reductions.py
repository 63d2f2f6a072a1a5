"""Ops along a dim (softmax, cumulative ops, sorting, ``topk``, ``diff``) and reductions
(sums and means, extrema, logical ``any`` / ``all``, variances, vector norms)."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

import torch
import torch.fx as fx

from ..dimspec import DimSpec, fixed_label
from ..graph import op_arg, output_vals, tensor_inputs, val
from ..local_ops import mean_of_shard
from ..placement import UnitShard, is_sharded
from ..sharded_norm import norm_rule_parts
from ..sharded_softmax import (pick_rule_parts, reduction_rule_parts, scan_rule_parts,
                               softmax_rule_parts, topk_rule_parts)
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
    :mod:`~fxtp.passes.sharded_softmax` (the output placed as the input)."""
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
    :mod:`~fxtp.passes.sharded_norm`) into a replicated norm."""
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
