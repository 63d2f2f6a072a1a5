"""Root outputs that come back sharded although no plan laid them out.

An output comes back as this rank's shard where it is sharded at the root. That is what a
plan asks for when a planned module's output layout (a loss-parallel head's ``Shard(-1)``,
``SequenceParallel``'s ``Shard(1)``) or a root input layout makes it so, or when a planned
layout reading the same value has it split where it is made. Where the shards come from a
parameter's layout instead, through no planned layout, the plan never asked for them: a
head tied to a vocab-sharded embedding (torchtune's ``TiedLinear``, for whose model the
plan's ``output`` key names no module) returns this rank's part of the logits where the
single-device model returns all of them. Such outputs are reported with a warning that
names where their shards come from and how to get the whole value.
"""
from __future__ import annotations

import torch.fx as fx

from ..passes.graph import INPUTS, calls_of, layout, placement_of, tensor_inputs
from ..passes.placement import describe, is_sharded


def unplanned_sharded_outputs(gm: fx.GraphModule, calls: dict, shardings: dict) -> list[str]:
    """A message per root output of placed ``gm`` left sharded by no layout of the plan
    (``calls``: FQN -> :class:`~fxtp.passes.graph.ModuleCall`; ``shardings``: the planned
    modules)."""
    if "" in shardings:  # the root's own style lays its outputs out
        return []
    planned = {n for fqn in shardings for call in calls_of(calls, fqn)
               for n in call.outputs if n is not None}
    output = next(iter(reversed(gm.graph.nodes)))
    messages = []
    for i, node in enumerate(output.args[0]):
        placement = placement_of(node) if isinstance(node, fx.Node) else None
        if not is_sharded(placement):
            continue
        source = _source(node, planned)
        if source is not None:
            shape = tuple(node.meta["val"].shape)
            messages.append(
                f"output {i} (global shape {shape}) comes back as this rank's "
                f"{describe(placement)} part, not whole as the single-device model returns "
                f"it: no planned module's output layout asks for that; its shards come from "
                f"{source}. To return it whole, plan the module computing it with "
                f"output_layouts=Replicate() (for a head tied to the embedding, which has no "
                f"module of its own: {{'': PrepareModuleOutput(output_layouts="
                f"{_torch_name(placement)}, desired_output_layouts=Replicate())}}); "
                f"fxtp.cross_entropy takes class-sharded logits as they are")
    return messages


def _source(node: fx.Node, planned: set) -> str | None:
    """The parameter whose layout shards ``node``, back along its sharded inputs through
    no planned layout; ``None`` where a planned output layout, a layout mark, a root input
    or an op that splits a whole value (as a planned layout downstream reads it) is met
    first."""
    seen = set()
    while node not in planned and node.op in ("call_function", "get_attr") and \
            node.target is not layout and node not in seen:
        seen.add(node)
        if node.op == "get_attr":
            return f"the layout of parameter '{node.target}'"
        wanted = node.meta.get(INPUTS) or ()
        sharded = [a for k, a in enumerate(tensor_inputs(node))
                   if is_sharded(wanted[k] if k < len(wanted) and wanted[k] is not None
                                 else placement_of(a))]
        if not sharded:
            return None
        node = sharded[0]
    return None


def _torch_name(placement) -> str:
    return f"Shard({placement.dim})" if hasattr(placement, "dim") else describe(placement)
