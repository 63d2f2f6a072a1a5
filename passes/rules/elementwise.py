"""Elementwise ops: the pointwise ops torch leaves untagged or that pass ``Partial``
through, ``*_like`` ops, adds into partial sums, dropout, and ``tril`` / ``triu``."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate

from ..dimspec import DimSpec
from ..effects import writes_first_input
from ..graph import INTO_PARTIAL, op_arg, tensor_inputs, val
from ...kernels.local_ops import add_replicated_once, sharded_dropout
from ..placement import P, R, block_bounds, is_blocked, is_sharded, local_range
from .base import Rule, dim_labels, ndim_of, pointwise, same_size, shard_start

aten = torch.ops.aten


def _shifted_diagonal(node, inputs, output, group):
    """``tril`` / ``triu`` of a shard: element ``(i, j)`` is kept by comparing ``j - i``
    with the diagonal, so a shard whose rows start at global row ``o`` shifts the diagonal
    by ``+o``, one whose columns start at ``o`` by ``-o``: both trailing dims may shard."""
    p = inputs[0]
    n = ndim_of(node.args[0])
    if not is_sharded(p) or p.dim < n - 2:
        return node.target, node.args, node.kwargs
    offset = shard_start(p, val(node.args[0]), group)
    shift = offset if p.dim == n - 2 else -offset
    return node.target, (node.args[0], op_arg(node, 1, "diagonal", 0) + shift), {}


def _tri_spec(node):
    labels = dim_labels(ndim_of(node.args[0]))
    return DimSpec((labels,), (labels,), "sum")


def _dropout(node, inputs, output, group):
    """Dropout of a shard draws the whole mask and keeps this rank's part of it, a chunk or
    one per block (see :func:`~fxtp.kernels.local_ops.sharded_dropout`); of a replicated
    value, the same mask on every rank (all ranks' generators are in step), which also
    drops the same elements of every rank's part of a partial sum."""
    if not is_sharded(inputs[0]):
        return node.target, node.args, node.kwargs
    x, p, train = node.args[0], op_arg(node, 1, "p"), op_arg(node, 2, "train")
    d, size = inputs[0].dim, val(x).shape[inputs[0].dim]
    if is_blocked(inputs[0]):
        pieces = [(a + start, length) for a, b in block_bounds(inputs[0], size)
                  for start, length in [local_range(inputs[0], b - a, group.rank,
                                                    group.world)]]
    else:
        pieces = [local_range(inputs[0], size, group.rank, group.world)]
    return sharded_dropout, (x, p, train, d, pieces, size), {}


LINEAR_POINTWISE = [
    aten.neg.default, aten.neg_.default, aten.clone.default, aten.alias.default,
    aten.detach.default, aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout,
    aten.to.device, aten.lift_fresh_copy.default, aten.contiguous.default,
    aten.positive.default, aten.mul.Scalar, aten.mul_.Scalar, aten.div.Scalar,
    aten.div_.Scalar, aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor, aten.sub_.Tensor,
    aten.zeros_like.default, aten.zero_.default, aten.real.default, aten.imag.default,
    aten.conj.default, aten._conj.default, aten.copy_.default,
    aten.copy.default,
]
"""Pointwise ops linear in all their tensor operands jointly: Partial in, Partial out."""

NONLINEAR_POINTWISE = [
    aten.masked_fill.Tensor, aten.masked_fill_.Tensor, aten.ones_like.default,
    aten.full_like.default, aten.empty_like.default, aten.fill_.Scalar, aten.fill_.Tensor,
    aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar, aten.__and__.Tensor,
    aten.__or__.Tensor, aten.__xor__.Tensor,
]
"""Elementwise ops torch does not tag ``pointwise`` (0-d operands, scalar forms, the
Python operator aliases of the bitwise ops; Hugging Face's mask code uses them)."""

RULES: dict = {op: pointwise("sum") for op in LINEAR_POINTWISE}
RULES.update({op: pointwise() for op in NONLINEAR_POINTWISE})

_LINEAR_POINTWISE = pointwise("sum")
_LIKE = {aten.zeros_like.default: aten.new_zeros.default,
         aten.ones_like.default: aten.new_ones.default,
         aten.full_like.default: aten.new_full.default,
         aten.empty_like.default: aten.new_empty.default}
"""``*_like`` ops -> the factory that makes their result from a shape."""


def _whole_like(node: fx.Node, world: int, actual=()):
    """A ``*_like`` op of a sharded or partial tensor of static shape may give its result
    whole: only the input's metadata is read, not its values."""
    if not actual or isinstance(actual[0], Replicate) or \
            not all(isinstance(n, int) for n in val(node).shape):
        return
    if any(ins[0] == actual[0] for ins, _ in _LINEAR_POINTWISE.strategies(node, world, actual)):
        yield (actual[0],), (R,)  # a layout the input can have


def _like_of_whole(node, inputs, output, group):
    """The whole result from the factory, at the global shape (the shard is not read)."""
    if isinstance(inputs[0], Replicate) or not isinstance(output, Replicate):
        return node.target, node.args, node.kwargs
    kwargs = {k: v for k, v in node.kwargs.items() if k != "memory_format"}
    return _LIKE[node.target], (node.args[0], list(val(node).shape), *node.args[1:]), kwargs


RULES.update({op: replace(RULES[op], extra=_whole_like, local_op=_like_of_whole)
              for op in _LIKE})
_ADDS = {aten.add.Tensor: False, aten.add_.Tensor: False, aten.sub.Tensor: True,
         aten.sub_.Tensor: True}
"""Adds and subtractions -> whether they subtract."""


def replicated_into_partial(target, ins, outs) -> Optional[int]:
    """Under the strategy ``ins -> outs`` of an add or subtraction, the index of its
    replicated operand added into the other's partial sum (on one rank:
    :func:`~fxtp.kernels.local_ops.add_replicated_once`), whose gradient is then whole on
    every rank, not partial; else ``None``."""
    if target not in _ADDS or len(ins) != 2 or not isinstance(outs[0], Partial):
        return None
    partial = [isinstance(p, Partial) for p in ins]
    return partial.index(False) if sum(partial) == 1 and \
        isinstance(ins[partial.index(False)], Replicate) else None


def _into_partial(node: fx.Node, world: int, actual=()):
    """On an add marked ``meta[INTO_PARTIAL]`` (by :mod:`~fxtp.passes.unpin`, which leaves
    partial sums unreduced; elsewhere reducing first costs as much and keeps the plan's
    layouts): ``(R, P) -> P`` and ``(P, R) -> P``, where the partial operand has the
    output's shape (a sum is not broadcast to more elements) and this op alone reads it (a
    value another op needs reduced is reduced once, for both), and the other arrives
    replicated (``actual``; never gathered for it). The replicated value is added into the
    partial sum; in place, into a partial ``self`` only."""
    inputs = tensor_inputs(node)
    if not node.meta.get(INTO_PARTIAL) or len(inputs) != 2 or inputs[0] is inputs[1]:
        return
    out = val(node).shape
    for i in (0,) if writes_first_input(node.target) else (0, 1):
        shape = val(inputs[i]).shape
        if len(shape) == len(out) and all(map(same_size, shape, out)) and \
                len(inputs[i].users) == 1 and (not actual or isinstance(actual[1 - i], Replicate)):
            yield (P, R) if i == 0 else (R, P), (P,)


def _added_once(node: fx.Node, inputs, output, group):
    replicated = replicated_into_partial(node.target, inputs, (output,))
    if replicated is None:
        return node.target, node.args, node.kwargs
    return add_replicated_once, (*node.args[:2], node.kwargs.get("alpha", 1),
                                 _ADDS[node.target], replicated, group.rank == 0,
                                 writes_first_input(node.target)), {}


RULES.update({op: replace(RULES[op], extra=_into_partial, local_op=_added_once)
              for op in _ADDS})
RULES.update({
    # pointwise with a Partial pass-through in one operand
    aten.mul.Tensor: pointwise("product"),
    aten.mul_.Tensor: pointwise("product"),
    aten.div.Tensor: pointwise("product", partial_args=(0,)),
    aten.div_.Tensor: pointwise("product", partial_args=(0,)),
    aten.type_as.default: pointwise("sum", unread=(1,)),
    aten.to.other: pointwise("sum", unread=(1,)),
    aten.dropout.default: Rule(lambda node: replace(pointwise().spec(node), partial="sum"),
                               local_op=_dropout),
    aten.tril.default: Rule(_tri_spec, local_op=_shifted_diagonal, strided=False),
    aten.triu.default: Rule(_tri_spec, local_op=_shifted_diagonal, strided=False),
})
