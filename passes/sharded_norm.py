"""Vector norms and LayerNorm over a sharded dim, without gathering the tensor.

A p-norm over dims that are split among the ranks is the p-th root of the sum of every
rank's ``sum |x|^p``: one all-reduce of a tensor of the norm's (output) shape. DoRA takes
the norm of each weight row over the input features, which a row-parallel layer shards.
Offered as an extra strategy of ``linalg_vector_norm`` / ``norm`` for finite ``p > 0``
(``0`` and ``+-inf`` norms keep to the dim spec: the reduced dims are gathered), it gives
a replicated norm whatever partition of the reduced dim the input arrives in, even or
not, blocked or strided, as long as each element lies on exactly one rank. Backward is
local: the gradient of this rank's elements, from the replicated norm.

``layer_norm`` over normalized dims one of which is split among the ranks (a q / k norm
over all heads, read on a colwise projection's head shards: ESM-C's ``nn.LayerNorm``)
needs each row's mean and variance: each rank's mean and sum of squared deviations, all
gathered in one collective and combined exactly (Chan's parallel formula, no cancellation
of large means); backward needs two row sums of the gradient, stacked in one all-reduce.
One collective each way where the norm's decomposition into means costs two.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from .collectives import _all_gather, _all_reduce
from .cross_entropy import compute_dtype
from .graph import op_arg, tensor_inputs, val
from .placement import (UnitShard, is_blocked, is_grouped, is_sharded, local_range,
                        shardings_over)


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


def layer_norm_of_shards(x: torch.Tensor, k: int, weight, bias, eps: float,
                         counts: tuple[int, ...], group: str) -> torch.Tensor:
    """This rank's part of ``F.layer_norm`` over ``x``'s last ``k`` dims, whose elements
    are split among the ranks of ``group``, rank ``r`` holding ``counts[r]`` of each row's;
    ``weight`` and ``bias`` (or ``None``) are this rank's part of them."""
    return _LayerNormOfShards.apply(x, k, weight, bias, eps, counts, group)


def layer_norm_bytes(rows: int, dtype: torch.dtype) -> tuple[list, list]:
    """``(kind, bytes per rank)`` of :func:`layer_norm_of_shards`'s collectives, forward
    and backward, over ``rows`` rows of a ``dtype`` input: two statistics per row each way,
    in fp32 (fp64 for fp64)."""
    size = 2 * rows * compute_dtype(dtype).itemsize
    return [("all_gather", size)], [("all_reduce", size)]


class _LayerNormOfShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k, weight, bias, eps, counts, group):
        dims = list(range(x.dim() - k, x.dim()))
        a = x.to(compute_dtype(x.dtype))
        world, total = len(counts), float(sum(counts))
        if all(a.shape[d] for d in dims):
            mean = a.mean(dims, keepdim=True)
            squares = (a - mean).square().sum(dims, keepdim=True)
        else:  # this rank holds none of the rows' elements (an uneven split)
            mean = squares = a.new_zeros([1 if d in dims else s for d, s in enumerate(a.shape)])
        parts = _all_gather(torch.stack([mean, squares]), 0, world, group)
        means, sums = parts.unflatten(0, (world, 2)).unbind(1)  # (world, rows...)
        n = torch.tensor(counts, dtype=a.dtype, device=a.device).view(-1, *[1] * a.dim())
        mean = (n * means).sum(0) / total
        rstd = torch.rsqrt((sums + n * (means - mean).square()).sum(0) / total + eps)
        ctx.save_for_backward(x, mean, rstd, weight)
        ctx.k, ctx.total, ctx.group = k, total, group
        ctx.bias_dtype = None if bias is None else bias.dtype
        out = (a - mean) * rstd
        out = out if weight is None else out * weight
        return (out if bias is None else out + bias).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, mean, rstd, weight = ctx.saved_tensors
        dims = list(range(x.dim() - ctx.k, x.dim()))
        leading = list(range(x.dim() - ctx.k))
        g = grad.to(mean.dtype)
        xhat = (x.to(mean.dtype) - mean) * rstd
        gw = g if weight is None else g * weight
        rows = _all_reduce(torch.stack([gw.sum(dims, keepdim=True),
                                        (gw * xhat).sum(dims, keepdim=True)]), ctx.group)
        dx = rstd * (gw - rows[0] / ctx.total - xhat * rows[1] / ctx.total)
        dw = None if weight is None else (g * xhat).sum(leading).to(weight.dtype)
        db = None if ctx.bias_dtype is None else g.sum(leading).to(ctx.bias_dtype)
        return dx.to(x.dtype), None, dw, db, None, None, None


def layer_norm_rule_parts():
    """``(extra, local_op)`` of ``layer_norm``'s :class:`~fxtp.passes.rules.Rule`: ``x``
    arriving sharded on a normalized dim, evenly or in units, with ``weight`` and ``bias``
    sharded alike on their matching dim, gives an output sharded as ``x``."""
    def normalized(node):
        n, k = val(node.args[0]).dim(), len(node.args[1])
        return n, k

    def extra(node: fx.Node, world: int, actual=()):
        n, k = normalized(node)
        shape = val(node.args[0]).shape
        if not all(isinstance(shape[d], int) for d in range(n - k, n)):
            return  # the ranks' counts of a row's elements are numbers
        offered = [Shard(d) for d in range(n - k, n) if shape[d] % world == 0]
        arrived = actual[0] if actual else None
        if isinstance(arrived, UnitShard) and arrived.dim >= n - k and \
                not is_grouped(arrived, world):
            offered.append(arrived)
        for p in offered:
            params = Shard(p.dim - (n - k)) if type(p) is Shard else \
                UnitShard(p.dim - (n - k), p.units)
            yield (p,) + (params,) * (len(tensor_inputs(node)) - 1), (p,)

    def local_op(node: fx.Node, inputs, output, group):
        n, k = normalized(node)
        p = inputs[0]
        if not (is_sharded(p) and not is_blocked(p) and p.dim >= n - k):
            return node.target, node.args, node.kwargs
        shape = val(node.args[0]).shape
        rows = math.prod(shape[d] for d in range(n - k, n)) // shape[p.dim]
        counts = tuple(rows * local_range(p, shape[p.dim], r, group.world)[1]
                       for r in range(group.world))
        return layer_norm_of_shards, (node.args[0], k, op_arg(node, 2, "weight"),
                                      op_arg(node, 3, "bias"), op_arg(node, 4, "eps", 1e-5),
                                      counts, group.name), {}

    return extra, local_op
