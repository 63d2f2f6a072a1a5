"""Which values of a graph carry gradients in backward (a forward analysis shared by the
rewrite, the post-rewrite passes and :func:`fxtp.explain`)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

from .graph import READS, val

aten = torch.ops.aten

# ops whose output never carries its inputs' gradients
NO_GRAD = {aten.detach.default, aten.zeros_like.default, aten.ones_like.default,
           aten.full_like.default, aten.empty_like.default, aten.new_zeros.default,
           aten.new_ones.default, aten.new_empty.default, aten.new_full.default}


def gradient_carriers(graph: fx.Graph, is_root: Callable[[fx.Node, object], bool]
                      ) -> frozenset:
    """Nodes whose value carries a gradient: the placeholders, ``get_attr`` nodes and
    parameter reads (``READS``) for which ``is_root(node, value)`` holds, and floating
    values computed from them by ops other than :data:`NO_GRAD`."""
    found: set[fx.Node] = set()
    for node in graph.nodes:
        v = val(node)
        if node.op in ("placeholder", "get_attr") or READS in node.meta:
            carries = is_root(node, v)
        else:
            carries = node.op != "output" and node.target not in NO_GRAD and _floating(v) and \
                any(a in found for a in node.all_input_nodes)
        if carries:
            found.add(node)
    return frozenset(found)


def _floating(v) -> bool:
    """Could ``v`` hold a gradient? Tensors of floating or complex dtype; a node's tuple of
    outputs may; Python and symbolic numbers do not."""
    if isinstance(v, torch.Tensor):
        return v.dtype.is_floating_point or v.dtype.is_complex
    return not isinstance(v, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool))
