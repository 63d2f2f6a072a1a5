"""Sharding propagation: give every node a placement, in topological order.

For each op the rule registry yields candidate strategies (input placements -> output
placements); the one that needs the fewest bytes of redistribution from the inputs' actual
placements wins. A partial value that grew through the ops carrying it is then reduced where
it was smallest (:func:`~fxtp.passes.reduce_early.reduce_early`). Then, from the outputs
back, a replicated value all of whose readers take
the same shard of it is made as that shard where no collective is needed for it, backward
included (:func:`_shard_at_source`): a parameter no style shards may so be held sharded.
Results: ``meta[PLACEMENT]`` (what the node produces) and ``meta[INPUTS]`` (what it needs of
each tensor input; ``None`` = as is). Fallbacks: an op without a rule
that receives a non-replicated input gathers everything to Replicate, and an op whose rule
has no strategy keeping a sharded input sharded (a head count that does not divide by the
world size) gathers that input. Each is reported by a message naming op, module and sizes,
returned and kept in ``meta[FALLBACK]``, or in strict mode raised as a
:class:`ShardingError`. An in-place op's written input keeps its placement (gathering it
would write a copy), unless no other value can see the write (a temporary only that op
reads); where that is impossible, it is gathered like any input, and
:mod:`~fxtp.passes.aliases` then makes the written value whole where it is made.
Propagation may run again after seeds change; each run starts over. A partial value entering a
block others are
stamped from (:class:`~fxtp.passes.graph.Stamp`) is reduced there, so that the blocks
stamped from it can take their inputs as it does.
"""
from __future__ import annotations

import collections
import math

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import Partial, Shard

from .aliases import observed
from .context import PassContext
from .dimspec import indivisible
from .effects import writes_first_input, written_args, written_inputs
from .errors import ShardingError
from .graph import (FALLBACK, FALLBACKS, INPUTS, PINNED, PLACEMENT, STAMP, attr, branches,
                    layout, module_fqn, output_vals, placement_of, tensor_inputs, tied_attrs, val)
from .placement import (R, describe, is_blocked, is_narrowing, is_replicate, is_sharded,
                        transition_cost, with_dim)
from .reduce_early import reduce_early
from .rules import FACTORIES, PASSTHROUGH, ZERO_FILLED, rule_for


def propagate(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Annotate every node of ``gm`` with its placement (``PLACEMENT``) and the placements it
    needs of its inputs (``INPUTS``), from the seeds; the fallbacks go in
    ``gm.meta[FALLBACKS]`` (under ``ctx.strict`` the first raises)."""
    gm.meta[FALLBACKS] = _propagate(gm, ctx.world, ctx.strict)
    return gm


def _propagate(gm: fx.GraphModule, world: int, strict: bool) -> list[str]:
    """Annotate ``gm`` in place; return the fallback messages."""
    fallbacks = []
    entering = {edge for n in gm.graph.nodes if STAMP in n.meta for edge in n.meta[STAMP].inputs}
    for node in gm.graph.nodes:
        node.meta.pop(FALLBACK, None)
        if node.op == "output":
            node.meta[INPUTS] = tuple(R if isinstance(placement_of(a), Partial) else None
                                      for a in tensor_inputs(node))
        elif node.op == "call_function":
            if node.target is torch.ops.higher_order.cond:
                fallbacks += _propagate_cond(gm, node, world, strict)
                continue
            message = _propagate_call(node, world)
            if node in entering and isinstance(placement_of(node), Partial):
                node.meta[INPUTS], node.meta[PLACEMENT] = (R,), R  # the stamped blocks' too
            if message:
                if strict:
                    raise ShardingError(message + " (strict=True). Add a rule to "
                                        "fxtp.passes.rules.RULES, or plan sizes and layouts so "
                                        "the op's inputs arrive as its rule can take them.")
                node.meta[FALLBACK] = message
                fallbacks.append(message)
    reduce_early(gm, world)
    _shard_at_source(gm, world)
    return fallbacks


def _shard_at_source(gm: fx.GraphModule, world: int) -> None:
    """Make a replicated value that every reader takes as the same shard as that shard,
    where its sources can make it without communicating, backward included: a broadcast
    expanded straight to this rank's part (its input's gradient, a partial sum, is
    all-reduced at the unexpanded size), or ops back to parameters read nowhere else, which
    are then held as that shard (their gradients need no collective). Sharding after the op
    would all-gather the whole gradient of the value in backward. The values making one are
    taken only if each of their readers is made so too or takes that shard; values whose
    sources meet (one relative position bias every layer adds to its head-sharded scores)
    are made together."""
    names = collections.Counter(id(t) for _, t in gm.named_parameters(remove_duplicate=False))
    shared = tied_attrs(gm) | {n for n in gm.graph.nodes  # read twice, or tied to a name
                               if n.op == "get_attr" and names[id(attr(gm, n.target))] > 1}
    seeds = {n: w for n in gm.graph.nodes if (w := _shard_wanted(n)) is not None}
    alone = {s: _region(gm, {s: w}, world, shared) for s, w in seeds.items()}
    for group in _meeting({s: r for s, r in alone.items() if r is not None}):
        tried = [group] + ([[s] for s in group] if len(group) > 1 else [])
        for seeds_tried in tried:
            plan = _region(gm, {s: seeds[s] for s in seeds_tried}, world, shared)
            if plan is not None and _closed(plan):
                for source, (needs, made) in plan.items():
                    if needs is not None:
                        source.meta[INPUTS] = needs
                    source.meta[PLACEMENT] = made
                break


def _shard_wanted(node: fx.Node):
    """The one shard every reader of replicated ``node`` needs, if there is one and no
    reader writes into it: ``Shard`` or blocked (``_StridedShard``, ``BlockShard``), each
    rank's pieces its own, not dealt in units (a unit several ranks hold has gradients that
    are not each rank's own)."""
    if node.meta.get(PLACEMENT) != R or not node.users:
        return None
    wanted = set()
    for user in node.users:
        needs = user.meta.get(INPUTS) or ()
        inputs = tensor_inputs(user)
        if user.op != "call_function" or len(needs) != len(inputs) or STAMP in user.meta or \
                any(inputs[i] is node for i in written_inputs(user)):
            return None
        wanted |= {p for a, p in zip(inputs, needs) if a is node}
    want = next(iter(wanted)) if len(wanted) == 1 else None
    return want if type(want) is Shard or is_blocked(want) else None


def _region(gm, seeds: dict, world: int, shared: set) -> dict | None:
    """``{value: (its input placements, None for a parameter; its placement)}``: how each
    of ``seeds`` (value -> the ``Shard`` wanted of it) and the values it is made from are
    placed to make it with no collective, or ``None``. ``shared``: parameters' nodes that
    must stay whole."""
    plan: dict[fx.Node, tuple] = {}
    todo = list(seeds.items())
    while todo:
        node, want = todo.pop()
        if node in plan:
            if plan[node][1] != want:
                return None
            continue
        made = _made_as(gm, node, want, world, shared)
        if made is None:
            return None
        plan[node] = (made[0], want)
        todo += made[1]
    return plan


def _made_as(gm, node: fx.Node, want, world: int, shared: set) -> tuple | None:
    """``(input placements, [(input, the shard it must be made as), ...])``: the strategy
    making ``node`` as ``want`` that needs the fewest of its replicated inputs made as
    shards (the others taken as they are), or ``None``; a parameter: ``(None, [])``."""
    if node.op == "get_attr":
        return (None, []) if node not in shared and \
            isinstance(attr(gm, node.target), nn.Parameter) else None
    rule = rule_for(node.target) if node.op == "call_function" else None
    if rule is None or {STAMP, FALLBACK, PINNED} & node.meta.keys() or \
            written_args(node.target):
        return None
    inputs = tensor_inputs(node)
    actual = [placement_of(a) for a in inputs]
    best = None
    for ins, out in _strategies_making(rule, node, want, world, actual):
        deeper = []
        for x, a, c, i in zip(inputs, actual, node.meta[INPUTS], ins):
            if i == c or i == (a if c is None else c):
                continue  # taken as chosen
            if a != R or not (type(i) is Shard or is_blocked(i)):
                deeper = None
                break
            deeper.append((x, i))
        if deeper is not None and (best is None or len(deeper) < len(best[1])):
            best = (tuple(ins), deeper)
    return best


def _strategies_making(rule, node: fx.Node, want, world: int, actual: list):
    """The strategies of ``node`` giving ``want``: those its inputs' placements now offer,
    and, with a replicated first input, those offered were it a shard of any dim (plain,
    or cut in ``want``'s blocks), taking it as that shard (a blocked layout, or a ``repeat``
    tiling shards, follows its input's)."""
    yield from ((ins, out) for ins, out in rule.strategies(node, world, actual)
                if tuple(out) == (want,))
    if not actual or actual[0] != R:
        return
    for d in range(val(tensor_inputs(node)[0]).dim()):
        for first in {Shard(d), with_dim(want, d)}:
            yield from ((ins, out) for ins, out in rule.strategies(node, world,
                                                                   [first, *actual[1:]])
                        if tuple(out) == (want,) and ins[0] == first)


def _closed(plan: dict) -> bool:
    """Whether every reader of every value in ``plan`` is in it, or already takes the
    value as the shard it is to be made as."""
    for node, (_, made) in plan.items():
        for user in node.users:
            needs = plan[user][0] if user in plan else user.meta.get(INPUTS)
            inputs = tensor_inputs(user)
            if needs is None or len(needs) != len(inputs) or \
                    any(x is node and n != made for x, n in zip(inputs, needs)):
                return False
    return True


def _meeting(regions: dict) -> list[list]:
    """The seeds of ``regions`` (seed -> its region) grouped where their regions share a
    value, in the seeds' order."""
    order = {s: i for i, s in enumerate(regions)}
    group_of: dict[fx.Node, fx.Node] = {}  # value -> the first seed of its group
    groups: dict[fx.Node, list] = {}
    for seed, region in regions.items():
        merged = [seed]
        for first in dict.fromkeys(group_of[n] for n in region if n in group_of):
            merged += groups.pop(first)
        merged.sort(key=order.__getitem__)
        first = merged[0]
        groups[first] = merged
        for s in merged:
            group_of.update(dict.fromkeys(regions[s], first))
    return list(groups.values())


def _made_as_pinned(target, pinned, actual: list) -> bool:
    """Is a fresh tensor made in its pinned placement, reading no input? Zeros from sizes
    (or a replicated tensor's) pinned ``Partial``: zeros on every rank are a partial sum. A
    factory pinned to any other single placement, a strided one included (MLA's query,
    written in two sharded parts)."""
    if isinstance(pinned, Partial):
        return target in ZERO_FILLED and all(map(is_replicate, actual))
    return pinned is not None and not isinstance(pinned, tuple) and target in FACTORIES


def _propagate_call(node: fx.Node, world: int) -> str | None:
    inputs = tensor_inputs(node)
    actual = [placement_of(a) for a in inputs]
    if node.target is layout:
        node.meta[INPUTS] = (node.args[1],)
        node.meta[PLACEMENT] = node.args[1]
        return None
    stamp = node.meta.get(STAMP)
    if stamp is not None:  # its block runs the reference's program: placed as it is there
        node.meta[INPUTS] = tuple(placement_of(a) for a in stamp.inputs)
        node.meta[PLACEMENT] = tuple(placement_of(o) for o in stamp.outputs)
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
    rule = rule_for(node.target)
    where = f"node '{node.name}' in module '{module_fqn(node) or '<root>'}'"
    writes = writes_first_input(node.target) and bool(inputs) and \
        inputs[0] is node.args[0] and observed(inputs[0])
    if rule is None:
        node.meta[INPUTS] = tuple(R for _ in inputs)
        node.meta[PLACEMENT] = _pack(node, (R,) * len(outs))
        if all(map(is_replicate, actual)):
            return None
        return (f"no sharding rule for {node.target} ({where}) with input placements "
                f"{describe(tuple(actual))}; gathering its inputs to Replicate" +
                ("; the value it writes in place is made whole where it is made" if writes
                 and not is_replicate(actual[0]) else ""))
    in_vals = [val(a) for a in inputs]
    best = None
    pinned = node.meta.get(PINNED)
    if _made_as_pinned(node.target, pinned, actual):
        node.meta[INPUTS] = (None,) * len(inputs)
        node.meta[PLACEMENT] = pinned
        return None
    if isinstance(pinned, Partial) and node.target in ZERO_FILLED:
        pinned = None  # zeros of a shard's shape: placed as the shard is
    kept = [i for i in written_inputs(node) if i > 0]  # state an op updates (BatchNorm's)
    for ins, out in rule.strategies(node, world, actual):
        if writes and ins[0] != actual[0] or any(ins[i] not in (None, actual[i]) for i in kept):
            continue  # an in-place op writes the caller's tensors, as they are placed
        if pinned is not None and \
                tuple(out) != (pinned if isinstance(pinned, tuple) else (pinned,)):
            continue
        cost = inputs_cost(actual, ins, in_vals, world)
        if cost < math.inf and (best is None or cost < best[0]):
            best = (cost, ins, out)
    if best is None and writes:  # gathered: passes/aliases.py makes the written value whole
        best = next(((0.0, ins, out) for ins, out in rule.strategies(node, world, actual)
                     if all(i is None or is_replicate(i) for i in ins)), None)
    if best is None:
        raise ShardingError(f"{node.target} ({where}): no strategy of its rule takes inputs "
                            f"{describe(tuple(actual))} by a redistribution fxtp makes")
    node.meta[INPUTS] = best[1]
    node.meta[PLACEMENT] = _pack(node, best[2])
    return _gathers(node, rule, actual, best[1], world, where)


def _propagate_cond(gm: fx.GraphModule, node: fx.Node, world: int, strict: bool) -> list[str]:
    """``torch.cond(pred, true_fn, false_fn, operands)``: the predicate is replicated, each
    branch is propagated from the operands' placements (a Partial operand is reduced
    first), and the cond gives what the branches give. Where the branches disagree on an
    output, both give it replicated (a reported fallback)."""
    operands = node.args[3]
    needed = [_reduced(placement_of(o)) for o in operands]
    modules = branches(gm, node)
    for module in modules:
        for placeholder, p in zip([n for n in module.graph.nodes if n.op == "placeholder"],
                                  needed):
            placeholder.meta[PLACEMENT] = p
        _propagate(module, world, strict)
    fallbacks = []
    for i, (a, b) in enumerate(zip(*(_outputs(module) for module in modules))):
        if a != b:
            message = (f"torch.cond (node '{node.name}' in module "
                       f"'{module_fqn(node) or '<root>'}'): its branches give output {i} as "
                       f"{describe(a)} and {describe(b)}; both give it replicated")
            if strict:
                raise ShardingError(message + " (strict=True)")
            fallbacks.append(message)
            for module in modules:
                _replicate_output(module, i)
    for module in modules:  # again: the branches' fallbacks, with the markers in place
        fallbacks += _propagate(module, world, strict)
    outs = _outputs(modules[0])
    node.meta[INPUTS] = (R,) + tuple(needed)
    node.meta[PLACEMENT] = tuple(outs)
    return fallbacks


def _outputs(module: fx.GraphModule) -> list:
    """A branch's output placements (Partial outputs are reduced on the way out)."""
    out = next(reversed(module.graph.nodes))
    return [_reduced(placement_of(o)) for o in out.args[0]]


def _reduced(p):
    """The placement a value leaves with: a Partial value is reduced to Replicate."""
    return R if isinstance(p, Partial) else p


def _replicate_output(module: fx.GraphModule, i: int) -> None:
    out = next(reversed(module.graph.nodes))
    value = out.args[0][i]
    if placement_of(value) == R:
        return
    with module.graph.inserting_before(out):
        marker = module.graph.call_function(layout, (value, R))
    marker.meta.update(val=val(value))
    outs = list(out.args[0])
    outs[i] = marker
    out.args = (tuple(outs),)


def _gathers(node, rule, actual, needed, world, where) -> str | None:
    """A message for every sharded input the chosen strategy gathers (no strategy of the
    rule keeps it sharded: e.g. a head count that does not divide by the world size)."""
    reasons = []
    for i, (a, n) in enumerate(zip(actual, needed)):
        if not is_sharded(a) or n is None or n == a or \
                is_narrowing(a, n, val(tensor_inputs(node)[i]), world):
            continue
        sizes = indivisible(rule.spec(node), [getattr(val(x), "shape", None)
                                              for x in tensor_inputs(node)],
                            [getattr(v, "shape", None) for v in output_vals(node)], i, a.dim,
                            world)
        why = (f"{', '.join(sizes)} does not divide by the world size {world}" if sizes else
               "its result is written in place through a view that takes it "
               "redistributed, so it is made whole" if node.meta.get(PINNED) == R else
               "no strategy of its rule keeps that dim sharded")
        shape = tuple(val(tensor_inputs(node)[i]).shape)
        reasons.append(f"input {i} ({describe(a)}, shape {shape}) to {describe(n)}: {why}")
    if not reasons:
        return None
    return f"{node.target} ({where}) gathers " + "; ".join(reasons)


def _pack(node, outs: tuple):
    return outs if isinstance(val(node), (tuple, list)) else outs[0]


def inputs_cost(actual, needed, vals, world: int) -> float:
    """What turning inputs placed ``actual`` into ``needed`` (``None``: read as is) costs:
    bytes sent per rank plus a latency term per collective (:func:`transition_cost`)."""
    return sum(transition_cost(a, r, v, world) for a, r, v in zip(actual, needed, vals)
               if r is not None)
