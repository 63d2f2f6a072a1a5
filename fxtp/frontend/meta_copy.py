"""A copy of the user's model to read or trace without touching it or its weights."""
from __future__ import annotations

import copy
import itertools

import torch
import torch.nn as nn


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device (ties kept),
    everything else deep-copied."""
    memo = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) \
            else meta
    return copy.deepcopy(model, memo)
