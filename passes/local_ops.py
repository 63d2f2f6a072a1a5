"""Local computations that replace an op when its inputs are sharded in a way the op itself
cannot compute on directly."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def vocab_parallel_embedding(weight: torch.Tensor, indices: torch.Tensor, offset: int,
                             padding_idx: int = -1) -> torch.Tensor:
    """Look up ``indices`` in this rank's rows ``[offset, offset + len(weight))`` of a
    vocab-sharded embedding; rows held elsewhere contribute zeros (and no gradient)."""
    rows = weight.shape[0]
    outside = (indices < offset) | (indices >= offset + rows)
    local = (indices - offset).masked_fill(outside, 0)
    local_padding = padding_idx - offset if 0 <= padding_idx - offset < rows else None
    out = F.embedding(local, weight, padding_idx=local_padding)
    return out.masked_fill(outside.unsqueeze(-1), 0)


def sharded_dropout(x: torch.Tensor, p: float, train: bool, dim: int, start: int,
                    size: int) -> torch.Tensor:
    """Dropout of this rank's shard (elements ``[start, start + len)`` along ``dim``, of
    ``size``) of a tensor: the mask of the whole tensor is drawn, exactly as single-device
    dropout draws it, and this rank's part is applied. Each shard thus gets its own part of
    the mask, the result equals the single-device one for the same seed, and every rank's
    generator stays in step (so dropout on replicated values still draws the same mask on
    every rank)."""
    if not train or p == 0 or x.numel() == 0:
        return x
    shape = list(x.shape)
    shape[dim] = size
    noise = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p)
    noise = noise.narrow(dim, start, x.shape[dim]).clone(memory_format=torch.contiguous_format)
    return x * noise.div_(1 - p)


def mean_of_shard(x: torch.Tensor, length: int, size: int, dim=None, keepdim: bool = False,
                  dtype=None) -> torch.Tensor:
    """This rank's Partial contribution to a mean over dims one of which is sharded, this
    rank holding ``length`` of its ``size`` elements: the shard's mean times
    ``length / size`` (``1 / world`` for equal shards)."""
    mean = torch.mean(x, dtype=dtype) if dim is None else torch.mean(x, dim, keepdim,
                                                                     dtype=dtype)
    return mean * length / size if length else torch.zeros_like(mean)  # an empty shard
