"""Vector norms over a sharded dim, without gathering the tensor.

A p-norm over dims that are split among the ranks is the p-th root of the sum of every
rank's ``sum |x|^p``: one all-reduce of a tensor of the norm's (output) shape. DoRA takes
the norm of each weight row over the input features, which a row-parallel layer shards.
Offered as an extra strategy of ``linalg_vector_norm`` / ``norm`` for finite ``p > 0``
(``0`` and ``+-inf`` norms keep to the dim spec: the reduced dims are gathered), it gives
a replicated norm whatever partition of the reduced dim the input arrives in, even or
not, blocked or strided, as long as each element lies on exactly one rank. Backward is
local: the gradient of this rank's elements, from the replicated norm.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from .collectives import _all_reduce
from .graph import val
from .placement import is_grouped, is_sharded


def norm_of_shards(x: torch.Tensor, ord: float, dims: list[int], keepdim: bool, dtype,
                   group: str) -> torch.Tensor:
    """``torch.linalg.vector_norm(x, ord, dims, keepdim, dtype=dtype)`` of the tensor
    whose part along ``dims`` this rank's ``x`` is, the parts of all ranks of ``group``
    partitioning them: the same replicated result on every rank."""
    return _NormOfShards.apply(x, float(ord), [d % x.dim() for d in dims], keepdim, dtype,
                               group)


class _NormOfShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ord, dims, keepdim, dtype, group):
        a = x if dtype is None else x.to(dtype)
        powers = a.abs().square() if ord == 2 else a.abs().pow(ord)
        norm = _all_reduce(powers.sum(dims, keepdim=True), group).pow(1 / ord)
        ctx.save_for_backward(x, norm)
        ctx.ord, ctx.dims = ord, dims
        return norm if keepdim else norm.squeeze(dims)

    @staticmethod
    def backward(ctx, grad):
        x, norm = ctx.saved_tensors
        if grad.dim() < x.dim():  # keepdim=False: put the reduced dims back
            for d in sorted(ctx.dims):
                grad = grad.unsqueeze(d)
        a = x.to(norm.dtype) if not x.is_complex() else x
        if ctx.ord == 2:
            scale = a / norm
        elif ctx.ord == 1:
            scale = a.sgn()
        else:
            scale = a.sgn() * a.abs().pow(ctx.ord - 1) / norm.pow(ctx.ord - 1)
        # as torch's own norm backward: no gradient through a zero norm
        return (grad * scale).masked_fill(norm == 0, 0).to(x.dtype), None, None, None, \
            None, None


def norm_rule_parts(dims_of: Callable[[fx.Node], list[int]], ord_arg: int = 1,
                    keepdim_arg: int = 3):
    """``(extra, local_op)`` of a :class:`~fxtp.passes.rules.Rule` for a norm op whose
    order is argument ``ord_arg`` (default 2) and whose reduced dims are ``dims_of``."""
    def order(node):
        p = node.args[ord_arg] if len(node.args) > ord_arg else node.kwargs.get("ord")
        return 2.0 if p is None else float(p)

    def reduced(node):
        n = val(node.args[0]).dim()
        return {d % n for d in dims_of(node)} if n else set()

    def extra(node: fx.Node, world: int, actual=()):
        p = order(node)
        if not (0 < p < math.inf):
            return
        dims = reduced(node)
        shape = val(node.args[0]).shape
        offered = [Shard(d) for d in sorted(dims)
                   if isinstance(shape[d], int) and shape[d] % world == 0]
        arrived = actual[0] if actual else None
        if is_sharded(arrived) and arrived.dim in dims and not is_grouped(arrived, world) \
                and arrived not in offered:
            offered.append(arrived)
        for placement in offered:
            yield (placement,), (Replicate(),)

    def local_op(node: fx.Node, inputs, output, group):
        p, dims = order(node), reduced(node)
        if not (is_sharded(inputs[0]) and inputs[0].dim in dims and 0 < p < math.inf):
            return node.target, node.args, node.kwargs
        keepdim = node.args[keepdim_arg] if len(node.args) > keepdim_arg else \
            node.kwargs.get("keepdim", False)
        return norm_of_shards, (node.args[0], p, sorted(dims), keepdim,
                                node.kwargs.get("dtype"), group.name), {}

    return extra, local_op
