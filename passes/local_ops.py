"""Local computations that replace an op when its inputs are sharded in a way the op itself
cannot compute on directly. Each returns this rank's Partial contribution."""
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
