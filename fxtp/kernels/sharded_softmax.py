"""Softmax, log-softmax, log-sum-exp, max / min and their indices over a sharded dim,
without gathering.

A z-loss (``logsumexp`` of the logits) or a distillation loss (``log_softmax`` of the
student's logits) read the logits a colwise LM head leaves sharded over the vocabulary; a
gather of the logits would undo loss parallel. Over dims split among the ranks (each
element on exactly one rank, in any partition), these are per-row reductions:

==============================  =============================  ==========================
op                              forward                        backward
==============================  =============================  ==========================
``logsumexp``                   all-reduces of the max and     none (local, from the
                                the sum of exponentials        result)
``softmax``, ``log_softmax``    the same                       an all-reduce of the
                                                               gradient's row sum
``amax``, ``amin``              an all-reduce (max or min)     an all-reduce of the
                                                               count of ties
``max`` / ``min`` along a dim,  an all-gather of each rank's   none (the rank holding the
``argmax``, ``argmin``          (value, index) per row         pick takes the gradient)
``topk``                        the same, k pairs per row      none (the same)
``any``, ``all``                an all-reduce (max or min)     none (not differentiable)
``cumsum``                      an all-gather of each rank's   an all-gather of each
                                total per row                  rank's gradient sum per row
==============================  =============================  ==========================

Each collective carries a tensor of the reduced shape (a value per row, per token for
logits). The max keeps the exponentials finite, as torch's kernels do; a row that is all
``-inf`` has log-sum-exp ``-inf`` and softmax ``nan`` (``_safe_softmax``: 0), as torch's.
16-bit inputs compute in fp32 and round once. ``softmax`` / ``log_softmax`` keep their
input's placement; ``logsumexp``, ``amax`` and ``amin`` are replicated, and so are the
values and global indices of ``max`` / ``min`` along a dim and ``argmax`` / ``argmin``: the
first extreme, ``nan`` first, as torch picks it (the first rank's among equal candidates,
and within it the first index). ``topk`` gives replicated values and global indices
too. ``any`` / ``all`` are replicated; ``cumsum`` keeps its
input's placement, each rank adding the totals of the ranks before it (its parts in order
along the dim, each on one rank).
"""
from __future__ import annotations

import torch

from .collectives import _all_gather, _all_reduce
from .cross_entropy import compute_dtype


def logsumexp_of_shards(x: torch.Tensor, dims: list[int], keepdim: bool, group: str
                        ) -> torch.Tensor:
    """``torch.logsumexp(x, dims, keepdim)`` of the tensor whose part along ``dims`` this
    rank's ``x`` is: the same replicated result on every rank of ``group``."""
    return _LogSumExp.apply(x, sorted(d % x.dim() for d in dims), keepdim, group)


def softmax_of_shards(x: torch.Tensor, dim: int, log: bool, safe: bool, dtype, group: str
                      ) -> torch.Tensor:
    """This rank's part of ``softmax`` (``log``: ``log_softmax``; ``safe``:
    ``_safe_softmax``, 0 on rows of ``-inf``) along ``dim`` of the whole tensor, converted
    to ``dtype`` first where given (the ops' ``dtype`` argument)."""
    return _Softmax.apply(x, dim % x.dim(), log, safe, dtype, group)


def extremum_of_shards(x: torch.Tensor, dims: list[int], keepdim: bool, largest: bool,
                       group: str) -> torch.Tensor:
    """``torch.amax`` (``largest``) or ``torch.amin`` of the whole tensor over ``dims``:
    replicated. Its gradient is shared evenly among the ties, over all ranks, as torch's."""
    return _Extremum.apply(x, sorted(d % x.dim() for d in dims), keepdim, largest, group)


def pick_of_shards(x: torch.Tensor, dim: int, keepdim: bool, largest: bool, offset: int,
                   rank: int, world: int, group: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.max(whole, dim, keepdim)`` (``largest``; else ``torch.min``) of the tensor
    whose elements ``[offset, offset + len)`` along ``dim`` this rank's ``x`` holds: the
    values and global indices, the same on every rank of ``group`` (this rank ``rank`` of
    ``world``)."""
    return _Pick.apply(x, dim % x.dim(), keepdim, largest, offset, rank, world, group)


def arg_of_shards(x: torch.Tensor, dim: int, keepdim: bool, largest: bool, offset: int,
                  rank: int, world: int, group: str) -> torch.Tensor:
    """``torch.argmax`` (``largest``; else ``argmin``) along ``dim``: the indices of
    :func:`pick_of_shards`."""
    return pick_of_shards(x, dim, keepdim, largest, offset, rank, world, group)[1]


def topk_of_shards(x: torch.Tensor, k: int, dim: int, largest: bool, offset: int, size: int,
                   world: int, group: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(whole, k, dim, largest)`` of the tensor of ``size`` along ``dim`` whose
    elements ``[offset, offset + len)`` this rank's ``x`` holds: the values and global
    indices, sorted, the same on every rank of ``group`` (the lowest index first among
    equal values; torch's own order of ties is unspecified)."""
    return _TopK.apply(x, k, dim % x.dim(), largest, offset, size, world, group)


def any_of_shards(x: torch.Tensor, dims: list[int], keepdim: bool, every: bool, group: str
                  ) -> torch.Tensor:
    """``torch.any`` (``every``: ``torch.all``) of the whole tensor over ``dims``:
    replicated."""
    dims = sorted(d % x.dim() for d in dims)
    # an empty part of an uneven split gives any's False and all's True, which change nothing
    mine = x.all(dims, keepdim=True) if every else x.any(dims, keepdim=True)
    out = _all_reduce(mine.to(torch.uint8), group, "min" if every else "max").to(mine.dtype)
    return out if keepdim else out.squeeze(dims)


def cumsum_of_shards(x: torch.Tensor, dim: int, dtype, before: list[bool], after: list[bool],
                     world: int, group: str) -> torch.Tensor:
    """This rank's part of ``torch.cumsum(whole, dim, dtype=dtype)``, where ``before[r]``
    (``after[r]``) says whether rank ``r`` of ``world`` holds elements before (after) this
    rank's along ``dim``, each element on one rank."""
    return _Cumsum.apply(x, dim % x.dim(), dtype, before, after, world, group)


def _totals_of(parts: torch.Tensor, dim: int, ranks: list[bool], world: int, group: str
               ) -> torch.Tensor:
    """The sum over ``dim`` of the ranks' ``parts`` flagged in ``ranks``, kept as size 1
    (one all-gather of each rank's sum)."""
    totals = _all_gather(parts.sum(dim, keepdim=True), dim, world, group)
    shape = [1] * totals.dim()
    shape[dim] = world
    flags = torch.tensor(ranks, dtype=totals.dtype, device=totals.device).view(shape)
    return (totals * flags).sum(dim, keepdim=True)


class _Cumsum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, dtype, before, after, world, group):
        ctx.dim, ctx.after, ctx.world, ctx.group = dim, after, world, group
        ctx.x_dtype = x.dtype
        x = x.to(dtype) if dtype is not None else x
        return torch.cumsum(x, dim) + _totals_of(x, dim, before, world, group)

    @staticmethod
    def backward(ctx, grad):  # each element's gradient: the output gradient summed after it
        within = grad.flip(ctx.dim).cumsum(ctx.dim).flip(ctx.dim)
        later = _totals_of(grad, ctx.dim, ctx.after, ctx.world, ctx.group)
        return (within + later).to(ctx.x_dtype), None, None, None, None, None, None


def collective_bytes(kernel, rows: int, dtype: torch.dtype) -> tuple[list, list]:
    """``(kind, bytes per rank)`` of the collectives one of this module's kernels issues,
    forward and backward, on ``rows`` rows (the reduced shape's size) of a ``dtype`` input
    (softmax: of its ``dtype`` argument where given)."""
    if kernel in (pick_of_shards, arg_of_shards, topk_of_shards):  # (value, index) pairs
        return [("all_gather", 2 * rows * 8)], []
    if kernel is extremum_of_shards:
        return [("all_reduce", rows * dtype.itemsize)], [("all_reduce", rows * dtype.itemsize)]
    if kernel is any_of_shards:  # a byte per row
        return [("all_reduce", rows)], []
    if kernel is cumsum_of_shards:
        return [("all_gather", rows * dtype.itemsize)], [("all_gather", rows * dtype.itemsize)]
    item = compute_dtype(dtype).itemsize
    return [("all_reduce", rows * item)] * 2, \
        [] if kernel is logsumexp_of_shards else [("all_reduce", rows * item)]


def _local_extreme(x: torch.Tensor, dims: list[int], largest: bool) -> torch.Tensor:
    """This rank's max (min) over ``dims``, kept as size 1; ``-inf`` (``inf``) where it
    holds none of them (an uneven split)."""
    if all(x.shape[d] for d in dims):
        return x.amax(dims, keepdim=True) if largest else x.amin(dims, keepdim=True)
    shape = [1 if d in dims else s for d, s in enumerate(x.shape)]
    if not x.is_floating_point():
        return x.new_full(shape, torch.iinfo(x.dtype).min if largest else
                          torch.iinfo(x.dtype).max)
    return x.new_full(shape, -torch.inf if largest else torch.inf)


def _log_sum_exp(a: torch.Tensor, dims: list[int], group: str) -> torch.Tensor:
    """The whole rows' log-sum-exp of ``a`` (kept as size 1): 2 all-reduces."""
    shift = _all_reduce(_local_extreme(a, dims, True), group, "max")
    shift = shift.masked_fill(shift.isinf(), 0)  # rows of +-inf: as torch's logsumexp
    return _all_reduce((a - shift).exp().sum(dims, keepdim=True), group).log() + shift


def _unsqueezed(grad: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    if not keepdim:
        for d in dims:
            grad = grad.unsqueeze(d)
    return grad


class _LogSumExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dims, keepdim, group):
        a = x.to(compute_dtype(x.dtype))
        lse = _log_sum_exp(a, dims, group)
        ctx.save_for_backward(x, lse)
        ctx.dims, ctx.keepdim = dims, keepdim
        out = lse if keepdim else lse.squeeze(dims)
        return out.to(x.dtype) if x.is_floating_point() else out  # integers: as torch

    @staticmethod
    def backward(ctx, grad):
        x, lse = ctx.saved_tensors
        grad = _unsqueezed(grad, ctx.dims, ctx.keepdim).to(lse.dtype)
        return (grad * (x.to(lse.dtype) - lse).exp()).to(x.dtype), None, None, None


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, log, safe, dtype, group):
        x_dtype, out_dtype = x.dtype, dtype or x.dtype
        a = x.to(out_dtype).to(compute_dtype(out_dtype))
        lse = _log_sum_exp(a, [dim], group)
        out = a - lse if log else (a - lse).exp()
        if safe:  # rows all -inf: 0, not nan
            out = out.masked_fill(lse == -torch.inf, 0)
        out = out.to(out_dtype)
        ctx.save_for_backward(out)
        ctx.dim, ctx.log, ctx.group, ctx.x_dtype = dim, log, group, x_dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        out, = ctx.saved_tensors
        dtype = compute_dtype(out.dtype)
        o, g = out.to(dtype), grad.to(dtype)
        if ctx.log:  # g - softmax * sum(g)
            rows = _all_reduce(g.sum(ctx.dim, keepdim=True), ctx.group)
            gx = g - o.exp() * rows
        else:  # softmax * (g - sum(g * softmax))
            rows = _all_reduce((g * o).sum(ctx.dim, keepdim=True), ctx.group)
            gx = o * (g - rows)
        return gx.to(ctx.x_dtype), None, None, None, None, None


class _Extremum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dims, keepdim, largest, group):
        out = _all_reduce(_local_extreme(x, dims, largest), group, "max" if largest else "min")
        ctx.save_for_backward(x, out)
        ctx.dims, ctx.keepdim, ctx.group = dims, keepdim, group
        return out if keepdim else out.squeeze(dims)

    @staticmethod
    def backward(ctx, grad):
        x, out = ctx.saved_tensors
        ties = x == out
        count = _all_reduce(ties.sum(ctx.dims, keepdim=True).to(x.dtype), ctx.group)
        grad = _unsqueezed(grad, ctx.dims, ctx.keepdim)
        return grad / count * ties, None, None, None, None


class _TopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k, dim, largest, offset, size, world, group):
        mine = min(k, x.shape[dim])
        values, index = x.topk(mine, dim, largest)
        if mine < k:  # short of candidates: ones that sort after every element
            shape = list(values.shape)
            shape[dim] = k - mine
            if x.is_floating_point():
                last = -torch.inf if largest else torch.inf
            else:
                last = torch.iinfo(x.dtype).min if largest else torch.iinfo(x.dtype).max
            values = torch.cat([values, values.new_full(shape, last)], dim)
            index = torch.cat([index, index.new_full(shape, size - offset)], dim)  # after all
        wide = torch.float64 if x.is_floating_point() else torch.long  # holds both exactly
        pair = torch.stack([values.to(wide), (index + offset).to(wide)])
        pairs = _all_gather(pair, 0, world, group).unflatten(0, (world, 2))
        values, index = (torch.cat(pairs[:, i].unbind(0), dim) for i in (0, 1))
        by_index = index.argsort(stable=True, dim=dim)  # ties: the lowest index first
        values, index = values.gather(dim, by_index), index.gather(dim, by_index)
        top = values.argsort(stable=True, dim=dim, descending=largest).narrow(dim, 0, k)
        values, index = values.gather(dim, top).to(x.dtype), index.gather(dim, top).long()
        ctx.save_for_backward(index)
        ctx.dim, ctx.offset, ctx.shape = dim, offset, x.shape
        ctx.mark_non_differentiable(index)
        return values, index

    @staticmethod
    def backward(ctx, grad, _):  # the rank holding each pick takes its gradient
        index, = ctx.saved_tensors
        local = index - ctx.offset
        held = (local >= 0) & (local < ctx.shape[ctx.dim])
        out = grad.new_zeros(ctx.shape)
        if ctx.shape[ctx.dim]:
            out.scatter_add_(ctx.dim, local.clamp(0, ctx.shape[ctx.dim] - 1),
                             grad.where(held, 0))  # another rank's pick adds nothing, nan too
        return out, None, None, None, None, None, None, None


class _Pick(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, keepdim, largest, offset, rank, world, group):
        if x.shape[dim]:
            values, index = x.max(dim, keepdim=True) if largest else x.min(dim, keepdim=True)
        else:  # an empty part of an uneven split: a candidate no other beats
            values = _local_extreme(x, [dim], largest)
            index = torch.zeros(values.shape, dtype=torch.long, device=x.device)
        wide = torch.float64 if x.is_floating_point() else torch.long  # holds both exactly
        pair = torch.stack([values.to(wide), (index + offset).to(wide)])
        pairs = _all_gather(pair, 0, world, group).unflatten(0, (world, 2))
        best, holder = pairs[:, 0].max(0) if largest else pairs[:, 0].min(0)
        index = pairs[:, 1].gather(0, holder.unsqueeze(0)).squeeze(0).long()
        ctx.save_for_backward(index, holder == rank)
        ctx.dim, ctx.keepdim, ctx.offset, ctx.shape = dim, keepdim, offset, x.shape
        values = best.to(x.dtype)
        if not keepdim:
            values, index = values.squeeze(dim), index.squeeze(dim)
        ctx.mark_non_differentiable(index)
        return values, index

    @staticmethod
    def backward(ctx, grad, _):
        index, mine = ctx.saved_tensors
        grad = _unsqueezed(grad, [ctx.dim], ctx.keepdim)
        local = (index - ctx.offset).clamp(0, max(ctx.shape[ctx.dim] - 1, 0))
        out = grad.new_zeros(ctx.shape)
        if ctx.shape[ctx.dim]:
            out.scatter_(ctx.dim, local, grad.where(mine, 0))  # not nan * 0 elsewhere
        return out, None, None, None, None, None, None, None
