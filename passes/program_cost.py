"""What a placed program sends: the cost model of the passes that try a placement and keep
it only if the program then sends less (:mod:`~fxtp.passes.unpin`,
:mod:`~fxtp.passes.gather_early`)."""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch.fx as fx

from .context import PassContext
from .errors import StampMismatch
from .gradients import gradient_carriers
from .graph import COLLECTIVE, FALLBACK, FALLBACKS, STAMP, call_args, module_fqn, val
from .placement import numel_hint
from .rewrite import rewrite
from .snapshot import Snapshot


def kept_if_cheaper(gm: fx.GraphModule, world: int, change: Callable[[], list]) -> bool:
    """Run ``change`` (it edits ``gm``'s placements and returns the fallbacks then left)
    and keep what it did if the program then sends strictly less, forward and backward,
    with no more fallbacks and the same nodes: those fallbacks are then
    ``gm.meta[FALLBACKS]``. Otherwise put the graph and ``gm.meta[FALLBACKS]`` back exactly
    as they were (:class:`~fxtp.passes.snapshot.Snapshot`). Returns whether it kept it."""
    cost, fallbacks = program_cost(gm, world)
    before, prior = Snapshot(gm.graph), gm.meta.get(FALLBACKS)
    found = change()
    now, now_fallbacks = program_cost(gm, world)
    if set(gm.graph.nodes) == set(before.nodes) and now < cost and now_fallbacks <= fallbacks:
        gm.meta[FALLBACKS] = found
        return True
    before.restore()
    gm.meta[FALLBACKS] = prior
    return False


def program_cost(gm: fx.GraphModule, world: int) -> tuple[float, int]:
    """What the program sends per rank, forward and backward (ring bytes and a fixed cost per
    collective), as the rewrite makes it of ``gm``'s placements (on a copy of the graph),
    and its fallbacks; ``inf`` where the rewrite refuses the placements (a stamped block
    placed unlike its reference)."""
    fallbacks = sum(FALLBACK in n.meta for n in gm.graph.nodes)
    original, graph, copies = gm.graph, fx.Graph(owning_module=gm), {}
    outputs, output = graph.graph_copy(original, copies, return_output_node=True)
    graph.output(outputs).meta.update(output.meta)
    gm._graph = graph  # the module's own attributes, its code not regenerated
    try:
        rewrite(gm, PassContext(world))
    except StampMismatch:
        return math.inf, fallbacks
    finally:
        gm._graph = original
    carries = gradient_carriers(graph, lambda n, v: n.op == "placeholder" or
                                getattr(v, "requires_grad", False))
    sent = {node: _sent(node, carries, world) for node in graph.nodes}
    total = sum(sent.values())
    stamps = [n.meta[STAMP] for n in graph.nodes if STAMP in n.meta]
    entering = {copies[edge] for stamp in stamps for edge in stamp.inputs}
    for reference in {stamp.reference for stamp in stamps}:  # a stamped block sends what
        inside = sum(c for n, c in sent.items()  # its reference sends past its entry
                     if f"{module_fqn(n)}.".startswith(f"{reference}.") and
                     not set(n.users) <= entering)
        total += inside * sum(stamp.reference == reference for stamp in stamps)
    return total, fallbacks


def _sent(node: fx.Node, carries: frozenset, world: int) -> float:
    """What rewrite node ``node`` sends per rank, forward and backward (its gradient is
    sent where its input carries one)."""
    kind = node.meta.get(COLLECTIVE)
    if kind == "grad_sync_bucket":
        flows = any(p in carries for p in node.args[0])
        return _ring("all_reduce", sum(_bytes(p) for p in node.args[0]), world) if flows else 0
    if kind not in CONJUGATES:
        return 0.0
    forward, backward = conjugates(node, carries)
    return (_ring(forward, _bytes(node.args[0]), world) if forward else 0.0) + \
        (_ring(backward, _bytes(node), world) if backward else 0.0)


def _bytes(node: fx.Node) -> int:
    """The bytes of ``node``'s whole (global) value."""
    return numel_hint(val(node)) * val(node).dtype.itemsize


STARTUP_BYTES = 1 << 18
"""A collective's fixed cost, in the bytes a ring sends in that time (tens of microseconds
on NVLink, more over gloo): a trial trading one collective for several small ones costs
more, not less."""


def _ring(kind: str, nbytes: float, world: int) -> float:
    """Bytes one rank sends in a ring ``kind`` of a tensor of ``nbytes`` whole, plus
    :data:`STARTUP_BYTES`."""
    share = (world - 1) / world * nbytes
    return (2 * share if kind == "all_reduce" else share) + STARTUP_BYTES


CONJUGATES = {
    "all_reduce": ("all_reduce", None),
    "reduce_scatter": ("reduce_scatter", "all_gather"),
    "all_gather": ("all_gather", "reduce_scatter"),  # when the gradient is partial
    "shard": (None, "all_gather"),
    "grad_sync": (None, "all_reduce"),
}
"""A rewrite node's ``meta[COLLECTIVE]`` -> its (forward, backward) collective: the forward
one sends the input's local tensor, the backward one the gradient, which has the output's
placement."""


def conjugates(node: fx.Node, carries) -> tuple[Optional[str], Optional[str]]:
    """The (forward, backward) collectives a rewrite node whose ``meta[COLLECTIVE]`` is in
    :data:`CONJUGATES` issues: the backward one only where its input (its first argument)
    is among ``carries`` (the values carrying a gradient), and none for an all-gather whose
    gradient is replicated (each rank takes its chunk)."""
    kind = node.meta[COLLECTIVE]
    forward, backward = CONJUGATES[kind]
    if node.args[0] not in carries or \
            kind == "all_gather" and not call_args(node)["partial_grad"]:
        backward = None
    return forward, backward
