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
====================  ==========================  ==============================

Collectives are the ``torch.ops._c10d_functional`` ops followed by ``wait_tensor``, which
inductor lowers natively. Groups are passed by name so graphs stay printable.
"""
from __future__ import annotations

import torch

_c10d = torch.ops._c10d_functional


def _all_reduce(x: torch.Tensor, group: str, op: str = "sum") -> torch.Tensor:
    return _c10d.wait_tensor(_c10d.all_reduce(x.contiguous(), op, group))


def _all_gather(x: torch.Tensor, dim: int, world: int, group: str) -> torch.Tensor:
    x = x.movedim(dim, 0).contiguous()
    out = _c10d.wait_tensor(_c10d.all_gather_into_tensor(x, world, group))
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, world: int, group: str) -> torch.Tensor:
    x = x.movedim(dim, 0).contiguous()
    out = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(x, "sum", world, group))
    return out.movedim(0, dim)


def _chunk(x: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    return x.chunk(world, dim)[rank].contiguous()


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, world, group):
        ctx.args = (dim, world, group)
        return _reduce_scatter(x, dim, world, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, *ctx.args), None, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, rank, world, group, partial_grad):
        ctx.args = (dim, rank, world, group, partial_grad)
        return _all_gather(x, dim, world, group)

    @staticmethod
    def backward(ctx, grad):
        dim, rank, world, group, partial_grad = ctx.args
        if partial_grad:
            grad = _reduce_scatter(grad, dim, world, group)
        else:
            grad = _chunk(grad, dim, rank, world)
        return grad, None, None, None, None, None


class _Shard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, rank, world, group):
        ctx.args = (dim, world, group)
        return _chunk(x, dim, rank, world)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, *ctx.args), None, None, None, None


class _GradSync(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """Sum a Partial tensor over ``group``; the gradient passes through unchanged."""
    return _AllReduce.apply(x, group)


def reduce_scatter(x: torch.Tensor, dim: int, world: int, group: str) -> torch.Tensor:
    """Sum a Partial tensor and keep this rank's chunk along ``dim``."""
    return _ReduceScatter.apply(x, dim, world, group)


def all_gather(x: torch.Tensor, dim: int, rank: int, world: int, group: str,
               partial_grad: bool = False) -> torch.Tensor:
    """Concatenate every rank's shard along ``dim``. With ``partial_grad`` the incoming
    gradient is a per-rank partial sum and is reduce-scattered; otherwise it is replicated
    and this rank's chunk is taken."""
    return _AllGather.apply(x, dim, rank, world, group, partial_grad)


def shard(x: torch.Tensor, dim: int, rank: int, world: int, group: str) -> torch.Tensor:
    """Keep this rank's chunk of a replicated tensor (no forward communication)."""
    return _Shard.apply(x, dim, rank, world, group)


def grad_sync(x: torch.Tensor, group: str) -> torch.Tensor:
    """Identity forward; all-reduce the partial gradient backward (Megatron's ``f``)."""
    return _GradSync.apply(x, group)


COLLECTIVES = (all_reduce, reduce_scatter, all_gather, shard, grad_sync)
