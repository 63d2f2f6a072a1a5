"""Rewrite pass: make every placement change explicit as a differentiable collective.

Where a node needs an input in another placement than the input has, the collectives of
:func:`fxtp.passes.placement.transition_steps` are inserted (one per value and target placement,
shared by all consumers). Boundary :func:`~fxtp.passes.seed.layout` markers are then removed.

Backward: a replicated value consumed by ops that also touch sharded or partial values
receives per-rank partial gradients from them. All those consumers are fed through one
``grad_sync`` (identity forward, all-reduce backward), so a replicated activation read by
several colwise linears costs one backward all-reduce; an ``all_gather`` whose consumers
are all such ops reduce-scatters its gradient instead. A replicated view, or product of
parameters and values synced anyway, whose readers all give partial gradients passes them
on unsummed, to be summed with its inputs' (a LoRA adapter's ``lora_A``).
"""
from __future__ import annotations

import inspect
import operator

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import Partial, Replicate

from ..kernels import collectives
from .aliases import written_groups
from .context import PassContext
from .effects import made_of_held_tensors, writes_first_input
from .errors import StampMismatch
from .gradients import gradient_carriers
from .graph import (COLLECTIVE, INPUTS, PLACEMENT, STAMP, attr, branches, layout,
                    placement_of, stack_upto, stamp_edge, tensor_inputs, val)
from .placement import (UnitShard, blocks, describe, is_replicate, is_sharded,
                        local_range, numel_hint, transition_steps)
from .rules import is_tagged_pointwise, replicated_into_partial

aten = torch.ops.aten


def rewrite(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Insert the collectives every node's needed input placements call for, on
    ``ctx.group``, then the gradient syncs of replicated values given partial gradients.
    ``ctx.scope(node)``: the FQN of the outermost module the program keeps as a submodule
    around ``node`` (:mod:`fxtp.passes.modules`); parameters' gradient syncs are bucketed
    per scope, at its start, so each such module reads only its own parameters. Edits
    ``gm.graph`` (and recompiles the ``torch.cond`` branches it edits); recompiling ``gm``
    is left to the caller, which edits it further."""
    graph, group, rank, world = gm.graph, ctx.group_name, ctx.rank, ctx.world
    made: dict[tuple[fx.Node, str], fx.Node] = {}

    def redistribute(src: fx.Node, dst, before: fx.Node) -> fx.Node:
        key = (src, describe(dst))
        if dst is None or placement_of(src) == dst:
            return src
        if key not in made:
            out = src
            for kind, sharding in transition_steps(placement_of(src), dst, val(src), world):
                out = _collective(graph, kind, sharding, out, before, group, rank, world)
            made[key] = out
        return made[key]

    for node in list(graph.nodes):
        needed = node.meta.get(INPUTS)
        if needed is None:
            continue
        inputs = iter(zip(tensor_inputs(node), needed))
        if STAMP in node.meta:
            _check_stamp(node, needed)

        def swap(arg):
            if arg is not None and hasattr(val(arg), "shape"):
                src, dst = next(inputs)
                return redistribute(src, dst, node)
            return arg
        node.args, node.kwargs = fx.node.map_arg((node.args, node.kwargs), swap)
        for stale in written_groups(node):  # later readers redistribute what it writes
            for key in [k for k in made if k[0] in stale]:
                del made[key]
    for node in list(graph.nodes):
        if node.target is layout:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
        for branch in branches(gm, node):  # torch.cond: each branch is rewritten alike
            rewrite(branch, ctx.but(scope=None))
            branch.recompile()
    _sync_partial_grads(graph, group, ctx.scope or (lambda node: ""))
    graph.lint()
    return gm


def _check_stamp(node: fx.Node, needed) -> None:
    """A stamped block runs its reference's program, which takes its inputs as they are,
    or reduced to that where they arrive partial (a sum a parallel block leaves partial)."""
    for i, (src, dst) in enumerate(zip(tensor_inputs(node), needed)):
        if placement_of(src) != dst and not (isinstance(placement_of(src), Partial) and
                                             not isinstance(dst, Partial)):
            raise StampMismatch(
                f"input {i} of the block stamped as node '{node.name}' arrives "
                f"{describe(placement_of(src))}, where its reference "
                f"'{node.meta[STAMP].reference}' took {describe(dst)}")


_KINDS = {"all_reduce": collectives.all_reduce, "reduce_scatter": collectives.reduce_scatter,
          "all_gather": collectives.all_gather, "shard": collectives.shard}


def _collective(graph, kind, sharding, src, before, group, rank, world) -> fx.Node:
    """``sharding``: the placement the collective gathers from or produces. Arguments are
    passed by name (``x`` positionally), so later passes read them by name. ``narrow`` is
    a local slice (autograd's backward pads it with zeros: a partial gradient)."""
    if kind == "narrow":
        return _narrow(graph, src, sharding, before, rank, world)
    fn = _KINDS[kind]
    given = {"dim": sharding and sharding.dim, "rank": rank, "world": world, "group": group,
             "blocks": blocks(sharding)}
    if isinstance(sharding, UnitShard):
        fn = collectives.all_gather_units
        given.update(units=sharding.units, size=val(src).shape[sharding.dim])
    params = inspect.signature(fn).parameters
    with graph.inserting_before(before):
        node = graph.call_function(fn, (src,), {k: v for k, v in given.items() if k in params})
    node.meta.update(val=val(src), nn_module_stack=dict(before.meta.get("nn_module_stack", {})))
    node.meta[PLACEMENT] = sharding if kind in ("reduce_scatter", "shard") else Replicate()
    node.meta[COLLECTIVE] = kind
    return node


def _narrow(graph, src, dst, before, rank, world) -> fx.Node:
    """This rank's ``dst`` elements out of its ``src`` ones (:func:`is_narrowing`)."""
    size = val(src).shape[dst.dim]
    start, length = local_range(dst, size, rank, world)
    have = placement_of(src)
    if is_sharded(have):
        start -= local_range(have, size, rank, world)[0]
    with graph.inserting_before(before):
        node = graph.call_function(aten.slice.Tensor, (src, dst.dim, start, start + length))
    node.meta.update(val=val(src), nn_module_stack=dict(before.meta.get("nn_module_stack", {})))
    node.meta[PLACEMENT] = dst
    node.meta[INPUTS] = (None,)  # local bounds already: localization leaves it as is
    return node


_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
          aten.transpose.int, aten.permute.default, aten.t.default, aten.unsqueeze.default,
          aten.squeeze.dim, aten.flatten.using_ints, aten.alias.default, aten.clone.default,
          aten.contiguous.default, aten.expand.default}


_PRODUCTS = {aten.linear.default, aten.mm.default, aten.matmul.default}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int,
           aten.chunk.default}


def _contributes_partial_grad(user: fx.Node, carries: frozenset, seen=frozenset()) -> bool:
    """Does ``user`` hand a replicated input a per-rank partial gradient? Either it touches
    sharded or partial values, or it is a replicated view, product or elementwise op whose
    users all do (the gradient is then synchronized before it, on its inputs: see
    :func:`_forwards_partial`). ``carries``: the values that carry gradients; ``seen``:
    the nodes whose answer is being decided (none is decided twice on one path)."""
    if user.op != "call_function" or user.target is collectives.shard or STAMP in user.meta:
        return False  # a stamped block syncs its inputs' gradients inside, as its reference
    if replicated_into_partial(user.target, user.meta.get(INPUTS) or (),
                               (user.meta.get(PLACEMENT),)) is not None:
        return False  # added into a partial sum: the operand's gradient is whole
    placements = list(user.meta.get(INPUTS) or ()) + [user.meta.get(PLACEMENT)]
    flat = [p for q in placements for p in (q if isinstance(q, tuple) else (q,))]
    return any(p is not None and not is_replicate(p) for p in flat) or \
        _forwards_partial(user, carries, seen)


def _forwards_partial(node: fx.Node, carries: frozenset, seen=frozenset()) -> bool:
    """Is ``node``'s partial gradient better summed on its inputs? A backward is linear in
    the gradient, and a replicated node computes it alike on every rank, so summing before
    or after it is the same. Where it :func:`_hands_on` the gradient, no more bytes are
    summed. A product of replicated inputs (a LoRA adapter's r-wide ``lora_A`` feeding a
    colwise ``lora_B``) is better summed on its inputs where each one's gradient is
    :func:`_summed_anyway`: one all-reduce fewer."""
    if node in seen or not node.users:
        return False
    seen = seen | {node}
    if not all(_contributes_partial_grad(u, carries, seen) for u in node.users):
        return False
    if node.target is operator.getitem and not isinstance(val(node.args[0]), torch.Tensor):
        # a split's piece: the split's gradient is its pieces' together, which is no tensor
        # to sync, so a piece's partial gradient passes it only where every piece's does
        # (the pieces being decided on this path are taken to)
        if not all(p in seen or _contributes_partial_grad(p, carries, seen)
                   for p in node.args[0].users):
            return False
    return _hands_on(node, carries) or _shares_a_gather(node, carries) or \
        node.target in _PRODUCTS and all(
            is_replicate(placement_of(a)) and _summed_anyway(a, node, carries, seen)
            for a in tensor_inputs(node))


def _hands_on(node: fx.Node, carries: frozenset) -> bool:
    """Does ``node``'s backward take its gradient to one input of no more bytes? A view; a
    split (``chunk``, ``unbind``) and the pieces taken from it (torchtune's chunked head);
    an elementwise op with one input carrying a gradient, of the output's dtype (DoRA's
    ``magnitude / norm`` and ``scale - 1``, read by two partial products, then take one
    sum, on the magnitude); a replicated dropout (one mask on every rank)."""
    if node.target in _VIEWS or node.target in _SPLITS or (
            node.target is operator.getitem and getattr(node.args[0], "target", None) in _SPLITS):
        return True  # a split's gradient is its pieces' put back together: no more bytes
    if not (is_tagged_pointwise(node.target) or node.target is aten.dropout.default) or \
            writes_first_input(node.target):
        return False
    graded = [a for a in tensor_inputs(node) if a in carries]
    return len(graded) == 1 and val(graded[0]).dtype == val(node).dtype


_GATHERS = {aten.index.Tensor, aten.index_select.default, aten.select.int, aten.slice.Tensor}
_SAME_SIZE_VIEWS = _VIEWS - {aten.expand.default}


def _shares_a_gather(node: fx.Node, carries: frozenset) -> bool:
    """Is ``node`` a gather (an index, a select, a slice) of a replicated value, or of a view
    of it of as many elements, that with the value's other such gathers takes at least as
    many elements as the value holds? Top-k routing takes each token k times: an MoE's
    experts each taking their tokens, ``x[token_idx]``, and their routing weights,
    ``probs.unsqueeze(-1)[token_idx, slot]``, or one gather of every token's k copies sorted
    by expert (torchtitan's); a recurrence takes each step's row (Mamba's scan,
    ``C[:, t]``). Its partial gradient is then better summed on the value, where the
    gathers' gradients are added up and other readers' partial gradients (a shared
    expert's) join them, than on each gather: no more bytes, and no more collectives."""
    if node.target not in _GATHERS:
        return False
    source = node.args[0]
    while source.target in _SAME_SIZE_VIEWS:
        source = source.args[0]
    gathers, todo = [], [source]
    while todo:
        for user in todo.pop().users:
            if user.target in _SAME_SIZE_VIEWS:
                todo.append(user)
            elif user.target in _GATHERS:
                gathers.append(user)
    return source in carries and is_replicate(placement_of(source)) and \
        sum(numel_hint(val(g)) for g in gathers) >= numel_hint(val(source))


def _summed_anyway(a: fx.Node, reader: fx.Node, carries: frozenset, seen) -> bool:
    """Is the gradient ``reader`` hands ``a`` summed with no collective of its own? ``a``
    is a parameter (its partial gradient joins the block's bucket), or another reader
    hands ``a`` a partial gradient (the colwise base layer's input, beside its adapter's
    ``lora_A``), or ``a``, read by ``reader`` alone, hands its gradient on to a value so
    summed (the adapter's dropout of that input)."""
    if a.op == "get_attr" or any(u is not reader and _contributes_partial_grad(u, carries, seen)
                                 for u in a.users):
        return True
    if set(a.users) != {reader} or not _hands_on(a, carries):
        return False
    whole = a.args[0] if a.target is operator.getitem else a  # a split's piece: its split
    graded = [x for x in tensor_inputs(whole) if x in carries]
    return len(graded) == 1 and is_replicate(placement_of(graded[0])) and \
        _summed_anyway(graded[0], whole, carries, seen | {a, whole})


def _sync_partial_grads(graph: fx.Graph, group: str, scope) -> None:
    params = {}  # replicated parameter (or value of parameters) -> users giving partial grads
    trainable = gradient_carriers(  # an input may be given requires_grad at run time
        graph, lambda n, v: n.op == "placeholder" or getattr(v, "requires_grad", False))
    needs_grad = gradient_carriers(  # and a frozen parameter may be unfrozen
        graph, lambda n, v: n in trainable or
        n.op == "get_attr" and isinstance(attr(graph.owning_module, n.target), nn.Parameter))
    from_params = computed_from_parameters(graph)
    summed = {}  # each value whose partial gradient is summed -> the users giving it, all
    for node in graph.nodes:  # decided on the graph as it is, before any sync is added
        v = val(node)
        if node in needs_grad and isinstance(v, torch.Tensor) and v.dtype.is_floating_point \
                and is_replicate(placement_of(node)) and not _forwards_partial(node, needs_grad):
            summed[node] = [u for u in node.users if _contributes_partial_grad(u, needs_grad)]
    for edge in [n for n, users in summed.items()
                 if n.target is stamp_edge and users and len(users) == len(n.users)]:
        value = edge.args[0]  # a value every block is given is synced once, in the root,
        # where it is a parameter, or the root syncs it for readers of its own (DiT's
        # condition, read by the blocks and the final layer)
        if value in from_params and value in trainable or summed.get(value):
            summed[value] = list(dict.fromkeys(
                summed.get(value, []) + [edge] + [u for u in value.users if STAMP in u.meta]))
            del summed[edge]
    for node, partial_users in summed.items():
        if not partial_users:
            continue
        if node in from_params and node in trainable:  # frozen ones: a sync each, which
            params[node] = partial_users                # runs only once they train again
            continue
        if node.target in (collectives.all_gather, collectives.all_gather_units) and \
                len(partial_users) == len(node.users):
            node.kwargs = {**node.kwargs, "partial_grad": True}
            continue
        with graph.inserting_after(node):
            sync = graph.call_function(collectives.grad_sync, (node, group))
        _annotate(sync, node, partial_users[0], "grad_sync")
        for user in partial_users:
            user.replace_input_with(node, sync)
    scoped: dict[str, dict] = {}
    for param, users in params.items():  # read in several blocks: synced in their caller
        where = {scope(user) for user in users}
        scoped.setdefault(where.pop() if len(where) == 1 else "", {})[param] = users
    in_scope: dict[str, list[fx.Node]] = {}  # each scope's computing nodes, in order
    for node in graph.nodes:
        if node.op not in ("placeholder", "get_attr"):
            in_scope.setdefault(scope(node), []).append(node)
    for where, members in scoped.items():
        _bucket_param_grad_syncs(graph, members, group, where,
                                 in_scope.get(where, ()) if where else graph.nodes)


def computed_from_parameters(graph: fx.Graph) -> set:
    """Parameters, and values computed from parameters alone by deterministic ops that
    write nothing (a norm weight cast to fp32, Gemma's ``1 + weight``), outside autocast
    and no-grad regions: they can be computed before everything else."""
    return made_of_held_tensors(graph.nodes)


def _bucket_param_grad_syncs(graph: fx.Graph, params: dict, group: str, where: str,
                             nodes) -> None:
    """One ``grad_sync_bucket`` for the replicated parameters (and values computed from
    parameters alone) read by sharded ops in scope ``where`` (sequence-parallel norm
    weights, rowwise biases added to sequence shards): they are computed at the scope's
    start (the first of ``nodes``, its computing nodes, that is not one of them), and their
    partial users read the bucket's outputs."""
    hoisted: set[fx.Node] = set()
    todo = list(params)
    while todo:
        node = todo.pop()
        if node not in hoisted:
            hoisted.add(node)
            todo += node.all_input_nodes
    first = next(n for n in nodes if n.op not in ("placeholder", "get_attr") and
                 n not in hoisted)
    stack = stack_upto(next(iter(params.values()))[0], where)
    for node in sorted(hoisted):  # in the graph's order
        first.prepend(node)
        if node.op == "call_function":
            node.meta["nn_module_stack"] = dict(stack)
    with graph.inserting_before(first):
        bucket = graph.call_function(collectives.grad_sync_bucket, (list(params), group))
        bucket.meta[COLLECTIVE] = "grad_sync_bucket"
        bucket.meta["nn_module_stack"] = dict(stack)
        for i, (param, users) in enumerate(params.items()):
            out = graph.call_function(operator.getitem, (bucket, i))
            _annotate(out, param, users[0], None)
            out.meta["nn_module_stack"] = dict(stack)
            for user in users:
                user.replace_input_with(param, out)


def _annotate(node, like, user, kind) -> None:
    """``node`` carries ``like``'s value and placement, in ``user``'s module scope."""
    node.meta.update(val=val(like), nn_module_stack=dict(user.meta.get("nn_module_stack", {})))
    node.meta[PLACEMENT] = placement_of(like)
    if kind:
        node.meta[COLLECTIVE] = kind
