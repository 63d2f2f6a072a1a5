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

import torch

from .collectives import _all_gather, _all_reduce
from .cross_entropy import compute_dtype


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
