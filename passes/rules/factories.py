"""Factories: ops making a fresh tensor from sizes (``new_zeros``, ``zeros``, ``full``,
``empty``, ...), in any placement."""
from __future__ import annotations

import torch

from ..dimspec import DimSpec
from ..graph import tensor_inputs
from .base import Rule, ndim_of

aten = torch.ops.aten


def _factory(node):
    """Factories (``new_zeros``, ``zeros``): read only their input's metadata, if any, and
    fill the output uniformly (or leave it uninitialized), so it may be made in any
    placement; with no input to follow, Replicate unless a written value's placement is
    pinned on it (:mod:`fxtp.passes.buffers`)."""
    return DimSpec((None,) * len(tensor_inputs(node)),
                   (tuple(f"f{i}" for i in range(ndim_of(node))),))


FACTORIES = {aten.new_zeros.default: 1, aten.new_ones.default: 1, aten.new_empty.default: 1,
             aten.new_full.default: 1, aten.zeros.default: 0, aten.ones.default: 0,
             aten.empty.memory_format: 0, aten.full.default: 0}
"""Ops making a fresh tensor from sizes alone (reading at most another tensor's metadata),
which may be made in any placement -> the position of their size argument."""
RULES: dict = {op: Rule(_factory, shape_arg=i) for op, i in FACTORIES.items()}


ZERO_FILLED = frozenset({aten.zeros.default, aten.new_zeros.default, aten.zeros_like.default})
"""Ops making zeros from sizes (or a replicated tensor's): zeros on every rank are also a
``Partial`` sum, which partial values can be added into without reducing them first
(:mod:`fxtp.passes.unpin` pins them so, ``meta[PINNED]``)."""
