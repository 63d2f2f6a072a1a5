"""Reduce a partial value where it is smallest.

Propagation places one op at a time, so a ``Partial`` value passes through every op that
can carry it and is reduced only where a reader needs it whole or sharded. When the
chain of ops it passed through grew it, reducing it earlier, at a smaller value, and
letting the rest of the chain compute on that value's shards is cheaper. PEFT's DoRA on a
row-parallel layer builds its adapter's weight ``lora_B @ lora_A`` from an identity
matrix: the (in, r) product with the input-sharded ``lora_A`` is partial, grows to
(in, out) through ``lora_B`` and was reduce-scattered there; reduced at (in, r), by
rows, ``lora_B`` and the transpose give the weight's own input-feature shards.

:func:`reduce_early` rewrites placements only (``meta[INPUTS]`` of the chain's readers
and ``meta[PLACEMENT]`` of the values after the new reduction point): the rewrite pass
then inserts the collective there. A chain is a run of ops each reading exactly one
partial value, read by nothing else; the other inputs of its ops are taken as they are
placed, or sliced locally.
"""
from __future__ import annotations

from typing import Optional

import torch.fx as fx
from torch.distributed.tensor import Partial, Shard

from .graph import FALLBACK, INPUTS, PINNED, PLACEMENT, STAMP, layout, placement_of, \
    stamp_edge, tensor_inputs, val
from .placement import LOCAL_COPY_COST, P, R, numel_hint, transition_cost
from .effects import writes_first_input
from .rules import rule_for


def reduce_early(gm: fx.GraphModule, world: int) -> None:
    """Move each reduction of a partial value to the smallest value of its chain whose
    reduction, with the chain's ops then computing on what it gives, ends in the
    placement the reader needs, where that costs fewer bytes."""
    for reader in list(gm.graph.nodes):
        needs = reader.meta.get(INPUTS) if reader.op == "call_function" else None
        for x, need in zip(tensor_inputs(reader), needs or ()):
            if need is None or isinstance(need, Partial) or \
                    not isinstance(placement_of(x), Partial) or len(x.users) != 1:
                continue
            best_cost, best = transition_cost(P, need, val(x), world), None
            chain = _chain(x)
            for i, early in enumerate(chain[:-1]):
                if numel_hint(val(early)) >= numel_hint(val(x)):
                    continue
                for dst in _reductions(early, world):
                    cost = transition_cost(P, dst, val(early), world)
                    placed = _replay(chain[i + 1:], early, dst, world) \
                        if cost < best_cost else None
                    if placed is not None and placed[-1][2] == need:
                        best_cost, best = cost, placed
            for node, ins, out in best or ():
                node.meta[INPUTS], node.meta[PLACEMENT] = ins, out


def _chain(x: fx.Node) -> list[fx.Node]:
    """The partial values ``x`` was computed from, oldest first, ending with ``x``: each
    the one partial input of the next, read by nothing else."""
    chain = [x]
    while True:
        node = chain[0]
        if not _replayable(node):
            return chain
        inputs = tensor_inputs(node)
        partial = [a for a, p in zip(inputs, node.meta.get(INPUTS) or ())
                   if isinstance(p, Partial)]
        if len(partial) != 1 or inputs.count(partial[0]) != 1 or \
                not isinstance(placement_of(partial[0]), Partial) or \
                len(partial[0].users) != 1:
            return chain
        chain.insert(0, partial[0])


def _replayable(node: fx.Node) -> bool:
    """An op propagation may place again: one tensor output, a rule, nothing pinned."""
    return node.op == "call_function" and node.target not in (layout, stamp_edge) and \
        rule_for(node.target) is not None and not writes_first_input(node.target) and \
        not ({STAMP, FALLBACK, PINNED} & node.meta.keys()) and \
        not isinstance(val(node), (tuple, list))


def _reductions(node: fx.Node, world: int) -> list:
    """What a partial ``node`` may be reduced to: replicated, or sharded on a dim."""
    shape = val(node).shape
    return [R] + [Shard(d) for d, size in enumerate(shape)
                  if isinstance(size, int) and size % world == 0 and size >= world]


def _replay(chain: list[fx.Node], early: fx.Node, dst, world: int) -> Optional[list]:
    """``[(node, input placements, placement), ...]`` for the ops of ``chain`` computing
    on ``early`` placed ``dst``, each taking its other inputs with no collective, or
    ``None``."""
    placed, now = [], {early: dst}
    for node in chain:
        inputs = tensor_inputs(node)
        actual = [now.get(a, placement_of(a)) for a in inputs]
        best = None
        for ins, outs in rule_for(node.target).strategies(node, world, actual):
            if len(outs) != 1 or any(a in now and i not in (None, now[a])
                                         for a, i in zip(inputs, ins)):
                continue
            cost = sum(transition_cost(a, i, val(x), world)
                       for x, a, i in zip(inputs, actual, ins) if i is not None)
            if cost <= LOCAL_COPY_COST * len(inputs) and (best is None or cost < best[0]):
                best = (cost, ins, outs[0])
        if best is None:
            return None
        now[node] = best[2]
        placed.append((node, best[1], best[2]))
    return placed
