"""Unused values: ATen ops whose results nothing reads, left by tracing (a value the model
computes for a path it does not take: Mamba's ``D.float()`` for its one-token step), are
dropped before placement, so their inputs are placed for the values that are read and no
collective is spent on them. Ops with effects stay: in-place and ``out=`` ops, random ones
(the generator's state moves as on a single device), and the values at a module's call
boundary, which the plan's styles are seeded on."""
from __future__ import annotations

import torch.fx as fx

from ..kernels.torch_compat import OpOverload
from .context import PassContext
from .graph import STAMP


def drop_unused(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Erase the pure ATen calls of ``gm`` nothing reads (and those only they read), except
    ``ctx.kept``; recompile ``gm`` if any was."""
    graph, kept = gm.graph, ctx.kept
    dropped = 0
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and not node.users and node not in kept and \
                isinstance(node.target, OpOverload) and STAMP not in node.meta \
                and not node.is_impure():
            graph.erase_node(node)
            dropped += 1
    if dropped:
        gm.recompile()
    return gm
