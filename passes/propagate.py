"""Sharding propagation: give every node a placement, in topological order.

For each op the rule registry yields candidate strategies (input placements -> output
placements); the one that needs the fewest bytes of redistribution from the inputs' actual
placements wins. Results: ``meta[PLACEMENT]`` (what the node produces) and ``meta[INPUTS]``
(what it needs of each tensor input; ``None`` = as is). An op without a rule that receives
a non-replicated input falls back to gathering everything to Replicate: its message, naming
op and module, is returned (and kept in ``meta[FALLBACK]``), or in strict mode raised as a
:class:`ShardingError`. Propagation may run again after seeds change; each run starts over.
"""
from __future__ import annotations

import torch.fx as fx
from torch.distributed.tensor import Partial, Placement

from fxtp.errors import ShardingError

from .meta import FALLBACK, INPUTS, PLACEMENT, module_fqn
from .placement import R, describe, is_replicate, transition_cost
from .rules import PASSTHROUGH, RULES, output_vals, tensor_inputs, val
from .seed import layout


def propagate(gm: fx.GraphModule, world: int, strict: bool = False) -> list[str]:
    """Annotate ``gm`` in place; return the fallback messages."""
    fallbacks = []
    for node in gm.graph.nodes:
        node.meta.pop(FALLBACK, None)
        if node.op == "output":
            node.meta[INPUTS] = tuple(R if isinstance(placement_of(a), Partial) else None
                                      for a in tensor_inputs(node))
        elif node.op == "call_function":
            message = _propagate_call(node, world)
            if message:
                if strict:
                    raise ShardingError(message + " (strict=True). Add a rule to "
                                        "passes.rules.RULES or keep this op's inputs replicated.")
                node.meta[FALLBACK] = message
                fallbacks.append(message)
    return fallbacks


def placement_of(node) -> Placement | tuple | None:
    return node.meta.get(PLACEMENT) if isinstance(node, fx.Node) else None


def _propagate_call(node: fx.Node, world: int) -> str | None:
    inputs = tensor_inputs(node)
    actual = [placement_of(a) for a in inputs]
    if node.target is layout:
        node.meta[INPUTS] = (node.args[1],)
        node.meta[PLACEMENT] = node.args[1]
        return None
    if node.target in PASSTHROUGH:
        source = placement_of(node.args[0])
        node.meta[INPUTS] = (None,) * len(inputs)
        node.meta[PLACEMENT] = source[node.args[1]] if isinstance(source, tuple) else source
        return None
    outs = output_vals(node)
    tensor_outs = [v for v in outs if hasattr(v, "shape")]
    if not tensor_outs:
        node.meta[INPUTS] = (None,) * len(inputs)
        node.meta[PLACEMENT] = None
        return None
    rule = RULES.get(node.target)
    if rule is None:
        node.meta[INPUTS] = tuple(R for _ in inputs)
        node.meta[PLACEMENT] = _pack(node, (R,) * len(outs))
        if all(map(is_replicate, actual)):
            return None
        where = module_fqn(node) or "<root>"
        return (f"no sharding rule for {node.target} (node '{node.name}' in module "
                f"'{where}') with input placements {describe(tuple(actual))}; gathering its "
                f"inputs to Replicate")
    in_vals = [val(a) for a in inputs]
    best = None
    for ins, out in rule.strategies(node, world, actual):
        cost = sum(transition_cost(a, r, v, world) for a, r, v in zip(actual, ins, in_vals)
                   if r is not None)
        if best is None or cost < best[0]:
            best = (cost, ins, out)
    node.meta[INPUTS] = best[1]
    node.meta[PLACEMENT] = _pack(node, best[2])
    return None


def _pack(node, outs: tuple):
    return outs if isinstance(val(node), (tuple, list)) else outs[0]

