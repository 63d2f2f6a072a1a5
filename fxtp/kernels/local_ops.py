"""Local computations that replace an op when its inputs are sharded in a way the op itself
cannot compute on directly."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def vocab_parallel_embedding(weight: torch.Tensor, indices: torch.Tensor, offset: int,
                             padding_idx: int = -1) -> torch.Tensor:
    """Look up ``indices`` in this rank's rows ``[offset, offset + len(weight))`` of a
    vocab-sharded embedding; rows held elsewhere contribute zeros (and no gradient).

    Backward keeps only ``indices`` (which the caller holds anyway) and recomputes which
    tokens are this rank's, so the lookup saves no mask and no local indices: less than
    the embedding it replaces."""
    return _VocabParallelEmbedding.apply(weight, indices, offset, padding_idx)


class _VocabParallelEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, indices, offset, padding_idx):
        local, outside, local_padding = _local_rows(indices, offset, weight.shape[0],
                                                    padding_idx)
        ctx.save_for_backward(indices)
        ctx.offset, ctx.rows, ctx.padding_idx = offset, weight.shape[0], padding_idx
        # out of place: torch 2.11's dynamo, tracing this Function, gets the weight's
        # gradient wrong when the output is also one of its intermediates (2.13 does not)
        return F.embedding(local, weight, padding_idx=local_padding).masked_fill(
            outside.unsqueeze(-1), 0)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        indices, = ctx.saved_tensors
        local, outside, local_padding = _local_rows(indices, ctx.offset, ctx.rows,
                                                    ctx.padding_idx)
        grad = grad.masked_fill(outside.unsqueeze(-1), 0)
        weight_grad = torch.ops.aten.embedding_dense_backward(
            grad, local, ctx.rows, -1 if local_padding is None else local_padding, False)
        return weight_grad, None, None, None


def _local_rows(indices, offset: int, rows: int, padding_idx: int):
    """This rank's row of each index (0 where another rank holds it), which indices another
    rank holds, and the padding row if this rank holds it."""
    outside = (indices < offset) | (indices >= offset + rows)
    local = (indices - offset).masked_fill_(outside, 0)
    local_padding = padding_idx - offset if 0 <= padding_idx - offset < rows else None
    return local, outside, local_padding


def gather_of_shard(x: torch.Tensor, dim: int, index: torch.Tensor, offset: int
                    ) -> torch.Tensor:
    """This rank's Partial contribution to ``torch.gather(whole, dim, index)``, where ``x``
    holds the whole tensor's elements ``[offset, offset + len)`` along ``dim`` and ``index``
    is global: each element picked from this rank's part, 0 where another rank holds it
    (one rank picks each element). Per-token log-probabilities of the targets
    (``log_softmax(logits).gather(-1, targets)``) so never gather the vocabulary."""
    size = x.shape[dim]
    if size == 0:  # an empty part of an uneven split holds nothing
        return _zeros_from(x, dim, index.shape)
    local = index - offset
    inside = (local >= 0) & (local < size)
    return torch.where(inside, x.gather(dim, local.clamp(0, size - 1)), 0)


def select_of_shard(x: torch.Tensor, dim: int, index: int, offset: int) -> torch.Tensor:
    """This rank's Partial contribution to ``whole.select(dim, index)`` (``index`` global
    and non-negative), where ``x`` holds the whole tensor's elements ``[offset, offset +
    len)`` along ``dim``: the slice on the rank holding it, 0 on the others (BERT's pooler
    reading the first token of a sequence-sharded output)."""
    if offset <= index < offset + x.shape[dim]:
        return x.select(dim, index - offset)
    return _zeros_from(x, dim, x.shape[:dim] + x.shape[dim + 1:])


def index_select_of_shard(x: torch.Tensor, dim: int, index: torch.Tensor, offset: int
                          ) -> torch.Tensor:
    """This rank's Partial contribution to ``torch.index_select(whole, dim, index)``, ``x``
    holding the elements ``[offset, offset + len)`` along ``dim`` and ``index`` global: the
    slices this rank holds, 0 for the others."""
    size = x.shape[dim]
    shape = list(x.shape)
    shape[dim] = index.numel()
    if size == 0:  # an empty part of an uneven split holds nothing
        return _zeros_from(x, dim, shape)
    local = index.reshape(-1) - offset
    inside = [1] * x.dim()
    inside[dim] = -1
    return torch.where(((local >= 0) & (local < size)).view(inside),
                       x.index_select(dim, local.clamp(0, size - 1)), 0)


def _zeros_from(x: torch.Tensor, dim: int, shape) -> torch.Tensor:
    """Zeros of ``shape`` that autograd reaches ``x`` from (a zero gradient): a rank that
    picks nothing still runs the backward of what computed ``x``, whose collectives the
    other ranks wait for."""
    first = x.narrow(dim, 0, min(x.shape[dim], 1)).sum().to(x.dtype)  # nothing if empty
    return x.new_zeros(shape) + _reached_zero(first)


def _reached_zero(t: torch.Tensor) -> torch.Tensor:
    """0 in ``t``'s shape, computed from ``t`` (whatever it holds, nan included): autograd
    still reaches ``t`` from it."""
    return torch.where(t.new_zeros((), dtype=torch.bool), t, 0)


def kept_target_weights(target: torch.Tensor, weight, ignore_index: int,
                        dtype: torch.dtype) -> torch.Tensor:
    """Each token's share of a mean loss's denominator: its target's class weight (1
    without ``weight``), 0 where the target is ``ignore_index``."""
    kept = target != ignore_index
    return kept.to(dtype) if weight is None else \
        torch.where(kept, weight[target.where(kept, 0)], 0)


def nll_loss_of_shard(x: torch.Tensor, target: torch.Tensor, weight, reduction: int,
                      ignore_index: int, offset: int) -> torch.Tensor:
    """This rank's Partial contribution to ``F.nll_loss(whole, target, weight, ...)``
    (``reduction`` as aten's enum: 0 none, 1 mean, 2 sum) where ``x`` holds classes
    ``[offset, offset + len)`` of the log-probabilities (class dim 1, or 0 for one token)
    and ``target``, ``weight`` are whole: each token's term is taken on the rank holding
    its target; the mean's denominator, the kept targets' total weight, on every rank."""
    class_dim = 1 if x.dim() > 1 else 0
    kept = target != ignore_index
    safe = target.where(kept, offset)  # an ignored target picks nothing
    picked = gather_of_shard(x, class_dim, safe.unsqueeze(class_dim), offset).squeeze(class_dim)
    w = kept_target_weights(target, weight, ignore_index, x.dtype)
    terms = torch.where(kept, -picked * w, 0)
    if reduction == 0:
        return terms
    return terms.sum() if reduction == 2 else terms.sum() / w.sum()


def sharded_dropout(x: torch.Tensor, p: float, train: bool, dim: int, pieces: list,
                    size: int) -> torch.Tensor:
    """Dropout of this rank's shard of a tensor (its ``pieces``, ``(start, length)`` of the
    elements along ``dim`` of ``size``: one for a ``Shard``, one per block for a blocked
    dim): the mask of the whole tensor is drawn, exactly as single-device dropout draws it,
    and this rank's part is applied. Each shard thus gets its own part of the mask, the
    result equals the single-device one for the same seed, and every rank's generator stays
    in step (so dropout on replicated values still draws the same mask on every rank)."""
    if not train or p == 0 or x.numel() == 0:
        return x
    shape = list(x.shape)
    shape[dim] = size
    noise = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p)
    noise = torch.cat([noise.narrow(dim, start, length) for start, length in pieces], dim) \
        if len(pieces) > 1 else noise.narrow(dim, *pieces[0])
    noise = noise.clone(memory_format=torch.contiguous_format)
    return x * noise.div_(1 - p)


def mean_of_shard(x: torch.Tensor, length: int, size: int, dim=None, keepdim: bool = False,
                  dtype=None) -> torch.Tensor:
    """This rank's Partial contribution to a mean over dims one of which is sharded, this
    rank holding ``length`` of its ``size`` elements: the shard's mean times
    ``length / size`` (``1 / world`` for equal shards)."""
    mean = torch.mean(x, dtype=dtype) if dim is None else torch.mean(x, dim, keepdim,
                                                                     dtype=dtype)
    if not length:  # an empty shard: 0 (its mean is nan), still reached by autograd
        return _reached_zero(mean)
    return mean * length / size


def add_replicated_once(a: torch.Tensor, b: torch.Tensor, alpha, subtract: bool,
                        replicated: int, keep: bool, inplace: bool) -> torch.Tensor:
    """``a + alpha * b`` (``-`` with ``subtract``; into ``a`` with ``inplace``) where operand
    ``replicated`` (0: ``a``, 1: ``b``) is replicated and the other is this rank's part of
    a partial sum: the replicated one is added on one rank (``keep``) only, so the parts
    still sum to the result (a rowwise layer's bias, a residual added to the sum of a
    parallel block's attention and MLP). Its gradient is the partial sum's, which is
    replicated: whole on every rank, with nothing to sum in backward."""
    if replicated == 0:
        a = _ReplicatedOnce.apply(a, keep)
    else:
        b = _ReplicatedOnce.apply(b, keep)
    alpha = -alpha if subtract else alpha
    return a.add_(b, alpha=alpha) if inplace else torch.add(a, b, alpha=alpha)


class _ReplicatedOnce(torch.autograd.Function):
    """``x`` on the keeping rank, an expanded zero (no memory) on the others; backward
    passes the gradient on as it is, on every rank."""

    @staticmethod
    def forward(ctx, x, keep):
        return x.view_as(x) if keep else x.new_zeros(()).expand(x.shape)

    @staticmethod
    def backward(ctx, grad):
        return grad, None
