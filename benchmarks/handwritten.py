"""Hand-written Megatron-style tensor parallelism of :class:`fxtp.llama.Llama`, the way
gpt-fast's ``tp.py`` does it: each rank keeps its slices of the weights, attention uses the
local head counts, and hooks put the collectives where Megatron puts them (an all-reduce
after ``wo`` and ``w2``, its conjugate on the layer inputs, a vocab-parallel embedding, an
all-gather of the logits). It is the practical limit fxtp's generated program is measured
against: nothing in it is generic.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxtp.llama import Llama

_c10d = torch.ops._c10d_functional


def _all_reduce(x, group):
    return _c10d.wait_tensor(_c10d.all_reduce(x.contiguous(), "sum", group))


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's ``g``: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _CopyToTP(torch.autograd.Function):
    """Megatron's ``f``: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rank, world, group):
        ctx.args = rank, world
        out = _c10d.wait_tensor(_c10d.all_gather_into_tensor(
            x.movedim(-1, 0).contiguous(), world, group))
        return out.movedim(0, -1).contiguous()

    @staticmethod
    def backward(ctx, grad):
        rank, world = ctx.args
        return grad.chunk(world, -1)[rank].contiguous(), None, None, None


def _keep(linear: nn.Linear, dim: int, rank: int, world: int) -> None:
    linear.weight = nn.Parameter(linear.weight.detach().chunk(world, dim)[rank].clone())


class VocabParallelEmbedding(nn.Module):
    def __init__(self, embedding: nn.Embedding, rank: int, world: int, group: str):
        super().__init__()
        rows = embedding.num_embeddings // world
        self.offset, self.rows, self.group = rank * rows, rows, group
        self.weight = nn.Parameter(embedding.weight.detach()[self.offset:self.offset + rows].clone())

    def forward(self, tokens):
        outside = (tokens < self.offset) | (tokens >= self.offset + self.rows)
        out = F.embedding((tokens - self.offset).masked_fill(outside, 0), self.weight)
        return _ReduceFromTP.apply(out.masked_fill(outside.unsqueeze(-1), 0), self.group)


def handwritten_tp(model: Llama, rank: int, world: int, group: str) -> Llama:
    """Turn ``model`` (a single-device copy, modified in place) into this rank's part."""
    for layer in model.layers:
        attention, ffn = layer.attention, layer.feed_forward
        for linear in (attention.wq, attention.wk, attention.wv, ffn.w1, ffn.w3):
            _keep(linear, 0, rank, world)
        for linear in (attention.wo, ffn.w2):
            _keep(linear, 1, rank, world)
            linear.register_forward_hook(lambda _m, _i, out: _ReduceFromTP.apply(out, group))
        attention.n_heads //= world
        attention.n_kv_heads //= world
        for block in (attention, ffn):
            block.register_forward_pre_hook(
                lambda _m, args: (_CopyToTP.apply(args[0], group), *args[1:]))
    model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, rank, world, group)
    _keep(model.output, 0, rank, world)
    model.output.register_forward_pre_hook(lambda _m, args: (_CopyToTP.apply(args[0], group),))
    model.output.register_forward_hook(
        lambda _m, _i, out: _GatherLastDim.apply(out, rank, world, group))
    return model
