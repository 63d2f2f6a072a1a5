"""Unused values: ATen ops whose results nothing reads, left by tracing (a value the model
computes for a path it does not take: Mamba's ``D.float()`` for its one-token step), are
dropped before placement, so their inputs are placed for the values that are read and no
collective is spent on them. Ops with effects stay: in-place and ``out=`` ops, random ones
(the generator's state moves as on a single device), and the values at a module's call
boundary, which the plan's styles are seeded on."""
from __future__ import annotations

from typing import Iterable

import torch.fx as fx

from ..kernels.torch_compat import OpOverload
from .graph import STAMP


def drop_unused(graph: fx.Graph, kept: Iterable[fx.Node] = ()) -> int:
    """Erase the pure ATen calls of ``graph`` nothing reads (and those only they read),
    except ``kept``; return how many."""
    kept = set(kept)
    dropped = 0
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and not node.users and node not in kept and \
                isinstance(node.target, OpOverload) and STAMP not in node.meta \
                and not node.is_impure():
            graph.erase_node(node)
            dropped += 1
    return dropped
