"""Hand-written Megatron-style tensor parallelism of :class:`fxtp.examples.llama.Llama`, the way
gpt-fast's ``tp.py`` does it: each rank keeps its slices of the weights, attention uses the
local head counts, and hooks put the collectives where Megatron puts them (an all-reduce
after ``wo`` and ``w2``, its conjugate on the layer inputs, a vocab-parallel embedding, an
all-gather of the logits). It is the practical limit fxtp's generated program is measured
against: nothing in it is generic. :func:`handwritten_sp` adds Megatron's sequence
parallelism (norms and residuals on a sequence shard, an all-gather of the sequence before
each block and a reduce-scatter after it).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxtp.examples.llama import Llama

_c10d = torch.ops._c10d_functional


def _all_reduce(x, group):
    return _c10d.wait_tensor(_c10d.all_reduce(x.contiguous(), "sum", group))


def _all_gather(x, dim, world, group):
    """The ranks' ``x`` concatenated along ``dim`` (a view, contiguous only for dim 0)."""
    out = _c10d.wait_tensor(_c10d.all_gather_into_tensor(
        x.movedim(dim, 0).contiguous(), world, group))
    return out.movedim(0, dim)


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
        return _all_gather(x, -1, world, group).contiguous()

    @staticmethod
    def backward(ctx, grad):
        rank, world = ctx.args
        return grad.chunk(world, -1)[rank].contiguous(), None, None, None


def _keep(linear: nn.Linear, dim: int, rank: int, world: int) -> None:
    linear.weight = nn.Parameter(linear.weight.detach().chunk(world, dim)[rank].clone())


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the table; ``reduce`` sums the ranks' partial lookups."""

    def __init__(self, embedding: nn.Embedding, rank: int, world: int, reduce):
        super().__init__()
        rows = embedding.num_embeddings // world
        self.offset, self.rows, self.reduce = rank * rows, rows, reduce
        rows_taken = embedding.weight.detach()[self.offset:self.offset + rows]
        self.weight = nn.Parameter(rows_taken.clone())

    def forward(self, tokens):
        outside = (tokens < self.offset) | (tokens >= self.offset + self.rows)
        out = F.embedding((tokens - self.offset).masked_fill(outside, 0), self.weight)
        return self.reduce(out.masked_fill(outside.unsqueeze(-1), 0))


def _keep_shards(model: Llama, rank: int, world: int, reduce_lookup) -> None:
    """Every weight TP shards cut to this rank's slice (the head's by class), attention at
    local head counts, the embedding's lookup summed across ranks by ``reduce_lookup``."""
    for layer in model.layers:
        attention, ffn = layer.attention, layer.feed_forward
        for linear in (attention.wq, attention.wk, attention.wv, ffn.w1, ffn.w3):
            _keep(linear, 0, rank, world)
        for linear in (attention.wo, ffn.w2):
            _keep(linear, 1, rank, world)
        attention.n_heads //= world
        attention.n_kv_heads //= world
    model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, rank, world,
                                                  reduce_lookup)
    _keep(model.output, 0, rank, world)


def handwritten_tp(model: Llama, rank: int, world: int, group: str) -> Llama:
    """Turn ``model`` (a single-device copy, modified in place) into this rank's part."""
    _keep_shards(model, rank, world, lambda out: _ReduceFromTP.apply(out, group))
    for layer in model.layers:
        for block, out in ((layer.attention, layer.attention.wo),
                           (layer.feed_forward, layer.feed_forward.w2)):
            block.register_forward_pre_hook(
                lambda _m, args: (_CopyToTP.apply(args[0], group), *args[1:]))
            out.register_forward_hook(lambda _m, _i, y: _ReduceFromTP.apply(y, group))
    model.output.register_forward_pre_hook(lambda _m, args: (_CopyToTP.apply(args[0], group),))
    model.output.register_forward_hook(
        lambda _m, _i, out: _GatherLastDim.apply(out, rank, world, group))
    return model


def _sequence_all_gather(x, world, group):
    return _all_gather(x, 1, world, group)


def _sequence_reduce_scatter(x, world, group):
    out = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(
        x.movedim(1, 0).contiguous(), "sum", world, group))
    return out.movedim(0, 1)


class _SequenceCollective(torch.autograd.Function):
    """``forward(x)`` forward, ``backward(grad)`` backward: Megatron-SP's ``g`` (all-gather
    the sequence, reduce-scatter its gradient) and ``g-bar`` (the other way round)."""

    @staticmethod
    def forward(ctx, x, forward, backward, world, group):
        ctx.backward_op, ctx.args = backward, (world, group)
        return forward(x, world, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_op(grad, *ctx.args), None, None, None, None


def _gather_sequence(x, world, group):
    return _SequenceCollective.apply(x, _sequence_all_gather, _sequence_reduce_scatter,
                                     world, group)


def _scatter_sequence(x, world, group):
    return _SequenceCollective.apply(x, _sequence_reduce_scatter, _sequence_all_gather,
                                     world, group)


def handwritten_sp(model: Llama, rank: int, world: int, group: str) -> Llama:
    """:func:`handwritten_tp` with Megatron's sequence parallelism (``model`` is modified in
    place): the embedding reduce-scatters its partial lookups by sequence, each norm runs on
    this rank's sequence shard (its weight's gradient all-reduced, as Megatron's
    ``allreduce_layernorm_grads`` does), attention and FFN all-gather the sequence in and
    reduce-scatter it out, the head all-gathers the sequence and then its logits."""
    def sequence_sharded_norm(norm):
        def forward(x):
            return norm._norm(x.float()).type_as(x) * _CopyToTP.apply(norm.weight, group)
        norm.forward = forward

    def gather_sequence_in(_module, args):
        return (_gather_sequence(args[0], world, group), *args[1:])

    def scatter_sequence_out(_module, _args, out):
        return _scatter_sequence(out, world, group)

    _keep_shards(model, rank, world, lambda out: _scatter_sequence(out, world, group))
    for layer in model.layers:
        for block, out in ((layer.attention, layer.attention.wo),
                           (layer.feed_forward, layer.feed_forward.w2)):
            block.register_forward_pre_hook(gather_sequence_in)
            out.register_forward_hook(scatter_sequence_out)
        sequence_sharded_norm(layer.attention_norm)
        sequence_sharded_norm(layer.ffn_norm)
    sequence_sharded_norm(model.norm)
    model.output.register_forward_pre_hook(gather_sequence_in)
    model.output.register_forward_hook(
        lambda _m, _i, out: _GatherLastDim.apply(out, rank, world, group))
    return model
