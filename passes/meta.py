"""The ``node.meta`` keys fxtp's passes write, and small readers for them."""
from __future__ import annotations

import torch.fx as fx

PLACEMENT = "fxtp_placement"          # the value's placement (a tuple for multi-output ops)
INPUTS = "fxtp_input_placements"      # placements the node needs for its tensor inputs
BOUNDARY = "fxtp_boundary"            # "fqn input 0" on module-boundary layout nodes
COLLECTIVE = "fxtp_collective"        # kind of collective a rewrite node issues
FALLBACK = "fxtp_fallback"            # why an op was gathered to Replicate


def module_fqns(node: fx.Node) -> list[str]:
    """FQNs of the modules a node was traced in, outermost first (root excluded)."""
    stack = node.meta.get("nn_module_stack") or {}
    return [path for path, _ in stack.values() if path]


def module_fqn(node: fx.Node) -> str:
    fqns = module_fqns(node)
    return fqns[-1] if fqns else ""


def inside(node: fx.Node, fqn: str) -> bool:
    return fqn == "" or fqn in module_fqns(node)
