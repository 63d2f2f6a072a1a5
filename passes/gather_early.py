"""Gather a sharded value where it is smallest.

Propagation places one op at a time, taking for each the layout that costs least where it
is, and a slice of a replicated value costs nothing. So a small sharded value meeting a
large replicated one makes the result sharded, and a reader that needs it whole gathers
the large value later. DiT's adaptive layer norm planned ``ColwiseParallel()`` gives
per-sample shift, scale and gate vectors sharded by feature: the modulated activations
and then the residual stream ran sharded, and each block's projections gathered their
inputs. Computed whole from the small vectors, gathered where they are made, the block
sends those vectors only. This is the dual of :mod:`~fxtp.passes.reduce_early`, which
reduces a partial value where it is smallest.

:func:`gather_early` labels each value either "as placed" or "whole" (computed by its op
from whole inputs). A value kept as placed costs one gather, shared by its readers, if a
reader needs it whole, that reader being made whole included. The labels sending the
fewest bytes forward are a minimum s-t cut: each term is a gather's cost or a constraint
on two labels. Only values that may be recomputed change their label: ops with a rule and
a replicated strategy, deterministic, not writing in place, not plan layouts, block
boundaries or pinned values, not returned as placed, sharing no memory with a value
written in place (a view made whole would be a copy, blind to the writes), and reading no
parameter whole or planned (computed whole, its gradient would be summed from partial
sums: in an fp64 model Hugging Face's RMSNorm casts to fp32 and back before scaling by its
weight, and gathering before that cast sends less forward but all-reduces backward where
a reduce-scatter served). A parameter no style places, which propagation held as the
shard its readers took, may be held whole again at no cost: DiT's unplanned patch
embedding, sharded to feed a sharded residual stream, is whole again once the stream is.
A gather costs its bytes and a collective's start, as the trial weighs it.

It rewrites placements only (``meta[PLACEMENT]``, ``meta[INPUTS]``); the rewrite pass
inserts the gathers. The result is kept only if the program then sends strictly less,
forward and backward (:func:`~fxtp.passes.program_cost.kept_if_cheaper`), with no more
fallbacks: a reader that gathered a sharded value for want of a strategy no longer does
when the value arrives whole.
"""
from __future__ import annotations

import collections
import math
import operator

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import Partial

from .aliases import written_groups
from .context import PassContext
from .effects import written_args
from .graph import (FALLBACK, INPUTS, PINNED, PLACEMENT, RELAID, STAMP, UNPLANNED, attr,
                    branches, layout, placement_of, stamp_edge, tensor_inputs, val)
from .placement import R, is_narrowing, is_replicate, transition_cost
from .program_cost import STARTUP_BYTES, kept_if_cheaper
from .rules import rule_for


def gather_early(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Compute whole the values whose inputs are cheaper to gather than they are, where the
    program then sends less; ``gm.meta[RELAID]``: whether placements changed."""
    gm.meta[RELAID] = False
    if any(branches(gm, node) for node in gm.graph.nodes):
        return gm  # the rewrite edits torch.cond branches in place: no trial run
    whole = _cut(gm, ctx.world)
    if whole:
        def make_whole() -> list:
            _make_whole(gm, whole)
            return [n.meta[FALLBACK] for n in gm.graph.nodes if FALLBACK in n.meta]
        gm.meta[RELAID] = kept_if_cheaper(gm, ctx.world, make_whole)
    return gm


def _placed_whole(node: fx.Node) -> bool:
    placement = placement_of(node)
    if isinstance(placement, tuple):
        return all(p is None or is_replicate(p) for p in placement)
    return placement is None or is_replicate(placement)


def _needs(reader: fx.Node, node: fx.Node) -> list:
    """What ``reader`` takes ``node`` as, once per time it reads it (``None``: as placed)."""
    needs = reader.meta.get(INPUTS) or ()
    return [need for x, need in zip(tensor_inputs(reader), needs) if x is node]


def _held_sharded(node: fx.Node) -> bool:
    """A parameter no style places (seed marks only parameters) that propagation holds as
    the shard its readers took: held whole again, it needs no collective."""
    return node.meta.get(UNPLANNED, False) and not _placed_whole(node)


def _recomputable(gm: fx.GraphModule, node: fx.Node, world: int) -> bool:
    """An op this pass may compute whole from whole inputs, or a parameter it may hold
    whole."""
    if _held_sharded(node):
        return True
    if node.op != "call_function" or node.target in (layout, stamp_edge, operator.getitem) \
            or {STAMP, PINNED, FALLBACK} & node.meta.keys():
        return False
    rule = rule_for(node.target)
    tags = getattr(node.target, "tags", ())
    if rule is None or torch.Tag.nondeterministic_seeded in tags or written_args(node.target):
        return False
    inputs = tensor_inputs(node)
    if not inputs or any(a.op == "get_attr" and isinstance(attr(gm, a.target), nn.Parameter)
                         and not _held_sharded(a) for a in inputs):
        return False  # whole, it would change how the parameter's gradient is reduced
    return any(all(o is None or is_replicate(o) for o in outs) and
               all(i is None or is_replicate(i) for i in ins)
               for ins, outs in rule.strategies(node, world, [R] * len(inputs)))


def _cut(gm: fx.GraphModule, world: int) -> set:
    """The values (and tuple-valued ops) to compute whole: a minimum cut of the forward's
    gather bytes, with the fewest values changed among the cuts of that cost."""
    nodes = [n for n in gm.graph.nodes if not _placed_whole(n)]
    # the node whose label a value shares: a tuple's items share the tuple op's
    label = {n: n.args[0] if n.target is operator.getitem else n for n in nodes}
    written = {n for node in gm.graph.nodes for group in written_groups(node) for n in group}
    free = {n for n in nodes if label[n] is n and n not in written and
            _recomputable(gm, n, world)}  # a copy would not see the writes a view sees
    for node in nodes:  # returned as placed, read as placed by what keeps its copy, or
        for reader in node.users:  # read as a partial sum
            keeps = reader.op == "output" or reader.target is stamp_edge
            for need in _needs(reader, node):
                taken = placement_of(node) if need is None else need
                if keeps and need is None or isinstance(taken, Partial):
                    free.discard(label[node])
    flow = _Flow()
    for node in nodes:
        x = ("x", label[node]) if label[node] in free else None
        if isinstance(val(node), torch.Tensor):
            y = ("y", node)  # a gather: its bytes and a collective's start, as the trial
            cost = transition_cost(placement_of(node), R, val(node), world) + STARTUP_BYTES
            flow.add(x or flow.SOURCE, y, cost)
            for reader in node.users:
                for need in _needs(reader, node):
                    if need is not None and need != placement_of(node) and \
                            not is_narrowing(placement_of(node), need, val(node), world):
                        flow.add(y, flow.SINK, math.inf)  # gathered now
                    elif reader in free:
                        flow.add(y, ("x", reader), math.inf)  # whole, it reads it whole
        if x is not None and node.op == "call_function":
            for a in tensor_inputs(node):
                if not _placed_whole(a):
                    flow.add(("y", a), x, math.inf)
    whole = flow.sink_side()
    return {node for node in nodes if ("x", label[node]) in whole}


def _make_whole(gm: fx.GraphModule, whole: set) -> None:
    """Place each node of ``whole`` replicated, computed from replicated inputs, and have
    its other readers take it as before (a shard: a local slice)."""
    old = {n: placement_of(n) for n in whole}
    for node in whole:
        placement = placement_of(node)
        node.meta[PLACEMENT] = tuple(R for _ in placement) if isinstance(placement, tuple) \
            else R
    for node in whole:
        if node.op == "call_function" and node.target is not operator.getitem:
            node.meta[INPUTS] = tuple(None if _placed_whole(a) else R
                                      for a in tensor_inputs(node))
    readers = dict.fromkeys(r for n in whole for r in n.users if r not in whole)
    for reader in readers:
        needs = list(reader.meta.get(INPUTS) or ())
        for i, x in enumerate(tensor_inputs(reader)):
            if x in old and i < len(needs):
                needs[i] = old[x] if needs[i] is None else \
                    None if is_replicate(needs[i]) else needs[i]
        reader.meta[INPUTS] = tuple(needs)
        if FALLBACK in reader.meta and all(
                _placed_whole(x) or need is None or not is_replicate(need)
                for x, need in zip(tensor_inputs(reader), needs)):
            del reader.meta[FALLBACK]


class _Flow:
    """A flow network for a minimum s-t cut (augmenting paths, breadth first)."""

    SOURCE, SINK = ("source",), ("sink",)

    def __init__(self):
        self.capacity: dict = collections.defaultdict(dict)

    def add(self, u, v, capacity: float) -> None:
        if capacity > 0 and u != v:
            self.capacity[u][v] = self.capacity[u].get(v, 0.0) + capacity
            self.capacity[v].setdefault(u, 0.0)

    def sink_side(self) -> set:
        """The nodes on the sink's side of a minimum cut: those that can still reach the
        sink once no augmenting path is left (the smallest such side)."""
        residual = self.capacity
        while True:
            parent = {self.SOURCE: None}
            queue = collections.deque([self.SOURCE])
            while queue and self.SINK not in parent:
                u = queue.popleft()
                for v, c in residual[u].items():
                    if c > 0 and v not in parent:
                        parent[v] = u
                        queue.append(v)
            if self.SINK not in parent:
                break
            path, v = [], self.SINK
            while parent[v] is not None:
                path.append((parent[v], v))
                v = parent[v]
            pushed = min(residual[u][v] for u, v in path)
            if pushed == math.inf:
                return set()  # no finite cut: leave every value as placed
            for u, v in path:
                residual[u][v] -= pushed
                residual[v][u] += pushed
        reaches = {self.SINK}
        queue = collections.deque([self.SINK])
        while queue:
            v = queue.popleft()
            for u in residual[v]:
                if u not in reaches and residual[u][v] > 0:
                    reaches.add(u)
                    queue.append(u)
        return reaches
