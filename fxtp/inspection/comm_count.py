"""Count the collectives a region of code issues, by kind, with bytes per rank.

Works on anything that dispatches ``torch.ops._c10d_functional`` ops: fxtp's graphs in
eager mode, forward and backward alike::

    with fxtp.count_collectives() as fwd:
        loss = gm(x).sum()
    with fxtp.count_collectives() as bwd:
        loss.backward()
    fwd.counts  # {"all_reduce": 2}
"""
from __future__ import annotations

from collections import Counter

import torch

from ..kernels.collectives import KINDS
from ..kernels.torch_compat import TorchDispatchMode


class count_collectives(TorchDispatchMode):
    """``counts``: kind -> number of calls; ``bytes``: kind -> bytes of the local inputs."""

    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self.bytes: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.higher_order.cond:  # count inside the branch that runs
            pred, true_fn, false_fn, operands = args
            with self:
                return (true_fn if pred else false_fn)(*operands)
        kind = KINDS.get(func)
        if kind is not None:
            x = args[0]
            self.counts[kind] += 1
            self.bytes[kind] += x.numel() * x.element_size()
        return func(*args, **(kwargs or {}))
