"""Module-tree pass: the per-rank program keeps the model's modules as submodules.

Tracing flattens the model into one graph. :func:`outline_modules` moves the nodes each
named module's call computed (``nn_module_stack``; collectives the rewrite put in it, whose
scope is the node they serve) back into a ``GraphModule`` registered at the module's FQN,
called by its parent's graph, holding its own parameters and buffers under their original
names. So ``gm.layers[0]`` is a module whose ``forward`` runs inside the parent's:
``fully_shard``, ``checkpoint_wrapper``, hooks and ``torch.compile`` work on it as on the
original model. Containers the model never calls (``nn.ModuleList`` / ``ModuleDict``) are
rebuilt as such; other modules that are not outlined hold only tensors.

Outlined modules generate their code when first called (``torch.fx``'s lazy graph
modules), so the passes after this one edit them without regenerating it each time;
:func:`generate_code` generates it once they are done.

A module is outlined when it is named, called exactly once, and its nodes can be one call
(no path leaves them and comes back); otherwise its nodes stay in its parent's graph and
its FQN is returned as not outlined. A tensor is read by the graph of the module holding
it, or passed in as an argument where another module reads it (a tied weight).

A block whose call is one stamp node (:class:`~fxtp.passes.graph.Stamp`) is called as
its reference's module is, and :func:`stamp_modules` (once the reference's module is
final) makes it a copy of that module: the same class, graph and code, the block's own
tensors, hooks of its own.
"""
from __future__ import annotations

import operator
import types
from typing import AbstractSet, Iterable, Optional

import torch.fx as fx
import torch.nn as nn

from ..kernels.torch_compat import LazyGraphModule, WrappedHook
from .context import PassContext
from .effects import made_of_held_tensors
from .errors import StampMismatch
from .graph import (COLLECTIVE, INLINED, MADE_BY, STAMP, Stamp, attr, placement_of, recompile_alone,
                    stamp_edge)
from .posing import COPIED, copy_plain_state, posing_class
from .recompute import call_submodule, run_checkpointed


def called_modules(graph: fx.Graph) -> dict[str, int]:
    """FQN -> the number of distinct calls the graph's nodes were traced in."""
    keys: dict[str, set] = {}
    for node in graph.nodes:
        for key, (path, _) in (node.meta.get("nn_module_stack") or {}).items():
            if path:
                keys.setdefault(path, set()).add(key)
    return {path: len(k) for path, k in keys.items()}


def scope_of(node: fx.Node, outlined: AbstractSet[str]) -> str:
    """The outermost of ``outlined`` the node was traced in (``""``: the root)."""
    return next((path for path in _paths(node) if path in outlined), "")


def outline_modules(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Outline each module of ``ctx.outline`` (and every called module above one) in
    ``gm``, in place; ``ctx.model`` gives the classes of the rebuilt containers.
    ``ctx.stamped``: block FQN -> reference FQN of the blocks whose call is a stamp node
    (:class:`Stamp`): each is called as its reference's module is, and holds its own
    tensors until :func:`stamp_modules` makes it a copy of that module. The FQNs left
    inline are ``gm.meta[INLINED]``."""
    fqns, model, stamped = ctx.outline, ctx.model, ctx.stamped
    _drop_stamp_edges(gm.graph)
    calls = called_modules(gm.graph)
    copied = tuple(f + "." for f in stamped)  # their modules are the references' copies
    wanted = {f for f in fqns if f and not f.startswith(copied)}
    wanted |= {a for f in wanted for a in _ancestors(f) if a in calls}
    skipped = sorted(f for f in wanted if calls.get(f) != 1)
    for fqn, reference in stamped.items():  # a block called twice has no module to copy
        if calls.get(fqn) != 1 or calls.get(reference) != 1:
            raise StampMismatch(f"block '{fqn}' is stamped from '{reference}', and one of "
                                f"them is called more than once (a recurrent block)")
    outlined = {f for f in wanted if calls.get(f) == 1}
    tensors = dict(gm.named_parameters(remove_duplicate=False))
    tensors.update(gm.named_buffers(remove_duplicate=False))
    persistent = set(model.state_dict(keep_vars=True))
    names: dict[int, list[str]] = {}
    for name, t in tensors.items():
        names.setdefault(id(t), []).append(name)
    children: dict[str, set[str]] = {}  # FQN ("": the root) -> the outlined just below it
    for f in outlined:
        children.setdefault(_nearest(f, outlined), set()).add(f)
    skipped += _outline(gm, "", children, names, model, stamped, {}, _stamps(gm.graph.nodes))
    for module in gm.modules():  # the stamps are called: no placeholder stands for more
        if isinstance(module, fx.GraphModule):
            for node in module.graph.find_nodes(op="placeholder"):
                node.meta.pop(MADE_BY, None)
    skipped += [fqn + f[len(ref):] for fqn, ref in stamped.items() for f in list(skipped)
                if f.startswith(ref + ".")]
    _place_tensors(gm, tensors, outlined - set(skipped), persistent)
    _rebuild_containers(gm, model)
    _follow_order(gm, model)
    gm.graph.lint()
    recompile_alone(gm)
    gm.meta[INLINED] = sorted(skipped)
    return gm


def generate_code(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Generate the code of every outlined module below ``gm`` whose graph changed since
    (each once: a parent's recompile only marks its children), then let every generated
    ``forward`` that can run in one globals dict: dynamo guards the names each distinct
    globals dict lends a traced call apart, so a program of many modules would pay guards
    per module that a model's own code (one module's globals) pays once."""
    for module in gm.modules():
        if isinstance(module, LazyGraphModule):
            module.real_recompile()
    shared: dict = {}
    for module in gm.modules():
        forward = type(module).__dict__.get("forward")
        if isinstance(module, fx.GraphModule) and isinstance(forward, types.FunctionType) \
                and forward.__globals__ is not shared:
            names = {k: v for k, v in forward.__globals__.items() if k != forward.__name__}
            if all(shared.get(k, v) is v for k, v in names.items()):  # no name taken otherwise
                shared.update(names)
                type(module).forward = _in_globals(forward, shared)
    return gm


def _in_globals(function: types.FunctionType, globals_: dict) -> types.FunctionType:
    """``function`` running in ``globals_``."""
    moved = types.FunctionType(function.__code__, globals_, function.__name__,
                               function.__defaults__, function.__closure__)
    moved.__kwdefaults__, moved.__qualname__ = function.__kwdefaults__, function.__qualname__
    moved.__dict__.update(function.__dict__)
    return moved


def _ancestors(fqn: str) -> list[str]:
    parts = fqn.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _nearest(fqn: str, outlined: AbstractSet[str]) -> str:
    """The deepest of ``outlined`` above ``fqn`` (``""``: the root)."""
    return next((a for a in reversed(_ancestors(fqn)) if a in outlined), "")


def _paths(node: fx.Node) -> list[str]:
    return [path for path, _ in (node.meta.get("nn_module_stack") or {}).values() if path]


def _outline(gm: fx.GraphModule, base: str, tree: dict[str, set[str]], names: dict, model,
             stamped: dict[str, str], done: dict, records: list) -> list[str]:
    """Outline ``tree[base]`` (the modules to outline just below ``base``, ``gm``'s FQN)
    in ``gm``, then theirs in each; returns the FQNs left inline. ``done``: FQN -> the
    values an outlined module reads and returns, in its call's order; ``records``: every
    :class:`Stamp`, kept naming the values as calls replace them."""
    def left_inline(child):
        return [child] + [f for c in tree.get(child, ()) for f in left_inline(c)]
    children = tree.get(base, set())
    owner = _owners(gm.graph, children)
    parts: dict[str, list[fx.Node]] = {}  # in the order of their first nodes
    for node in gm.graph.nodes:
        if owner.get(node) is not None:
            parts.setdefault(owner[node], []).append(node)
    skipped: list[str] = []
    for child in sorted(children - parts.keys()):  # no nodes of its own
        skipped += left_inline(child)
    for child, part in parts.items():
        part.sort()  # in the graph's order (an extraction may have moved nodes after it)
        if child in stamped:
            _call_stamp(gm.graph, part, child, done.get(stamped[child]),
                        child[len(base) + 1:] if base else child, records, done)
            continue
        if not _convex(part):
            skipped += left_inline(child)
            continue
        sub = _extract(gm, part, base, child, names, model.get_submodule(child), done,
                       records)
        skipped += _outline(sub, child, tree, names, model, stamped, done, records)
    if children:
        gm.graph.lint()
        recompile_alone(gm)
    return skipped


def _owners(graph: fx.Graph, children: set) -> dict[fx.Node, Optional[str]]:
    """Which child each node goes to (``None``: it stays). A traced node goes to the child
    in its module stack. A collective goes to the child that computed its input and reads
    its result, if one does both (so a block receives its input as the plan lays it out:
    the embedding's reduce-scatter stays outside the first block). A node without a traced
    module stack (a pass made it: a size computation, a guard) or reading a tensor goes
    where all its users go."""
    def child_of(node):
        return next((p for p in _paths(node) if p in children), None)
    owner: dict[fx.Node, Optional[str]] = {}
    for node in reversed(graph.nodes):
        if node.op in ("placeholder", "output"):
            owner[node] = None
        elif _traced_op(node):
            owner[node] = child_of(node)
        else:
            places = {owner.get(u) for u in node.users}
            if COLLECTIVE in node.meta:
                places |= {child_of(a) for a in node.all_input_nodes if _traced_op(a)}
            owner[node] = places.pop() if len(places) == 1 else None
    return owner


def _convex(part: list[fx.Node]) -> bool:
    """No value leaves ``part`` and flows back into it. Such a path runs between the
    part's first and last nodes, so only the nodes in between are looked at."""
    inside = set(part)
    first, last = min(part), max(part)
    tainted: set[fx.Node] = set()
    node = first
    while node is not last:
        node = node.next
        reached = [a for a in node.all_input_nodes if a in inside or a in tainted]
        if node in inside:
            if any(a in tainted for a in reached):
                return False
        elif reached:
            tainted.add(node)
    return True


def _extract(gm: fx.GraphModule, part: list, base: str, fqn: str, names: dict,
             original: nn.Module, done: dict, records: list) -> fx.GraphModule:
    """Move ``part`` into a new submodule at ``fqn`` (relative to ``base``) and call it:
    a graph module posing as ``original`` (the model's module there)."""
    graph, inside = gm.graph, set(part)
    prefix = fqn + "."
    inputs = list(dict.fromkeys(a for n in part for a in n.all_input_nodes if a not in inside))
    outputs = [n for n in part if any(u not in inside for u in n.users)]
    held = {n: _local_name(gm, n.target, base, prefix, names)
            for n in part if n.op == "get_attr"}
    passed = [n for n, target in held.items() if target is None]  # read here, held above
    inputs += passed
    inside -= set(passed)
    body, env, attrs = fx.Graph(), {}, {}
    for a in inputs:
        env[a] = body.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for a in inputs:  # a collective of other inputs: a stamp inside may need it made anew
        if COLLECTIVE in a.meta and a.op == "call_function" and a.all_input_nodes and \
                all(i in env for i in a.all_input_nodes):
            env[a].meta[MADE_BY] = (a.target, *fx.node.map_arg((a.args, a.kwargs),
                                                               env.__getitem__))
    for n in part:
        if n in env:
            continue
        env[n] = body.node_copy(n, env.__getitem__)  # names kept: reports name nodes
        if n.op == "get_attr":
            attrs[held[n]] = attr(gm, n.target)
            env[n].target = held[n]
    body.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[o] for o in outputs))
    # the stamps called in the block, and those of a reference in it wherever they are
    # called, read and give ``body``'s values
    _rename(_stamps(part), env)
    _rename([r for r in records if r.reference.startswith(prefix)], env)
    cls = type(original)  # code: see generate_code
    sub = (posing_class(cls) or LazyGraphModule)(attrs, body, class_name=cls.__name__)
    relative = fqn[len(base) + 1:] if base else fqn
    try:  # the holder it replaces: its tensors move along
        held = gm.get_submodule(relative)
    except AttributeError:
        held = nn.Module()
    for name, t in held.named_parameters(remove_duplicate=False):
        hold(sub, name, t, True)
    for owner, module in held.named_modules(remove_duplicate=False):
        for name, t in module._buffers.items():
            hold(sub, f"{owner}.{name}" if owner else name, t,
                  name not in module._non_persistent_buffers_set)
    copy_plain_state(sub, original)
    gm.add_submodule(relative, sub)
    results = _call(graph, [n for n in part if n in inside], inputs, outputs, relative,
                    records)
    _rename_done(done, dict(zip(outputs, results)))
    done[fqn] = (inputs, results)
    return sub


def _call_stamp(graph: fx.Graph, part: list, fqn: str, reference, target: str,
                records: list, done: dict) -> None:
    """Replace a stamped block's call (``part``: its stamp node and the stamp's outputs) by
    a call of its module at ``target``, passing and taking what its reference's module
    (``reference``: the values it reads and returns) does, in that order."""
    stamp = next(n for n in part if STAMP in n.meta)
    given: Stamp = stamp.meta[STAMP]
    outputs = {n.args[1]: n for n in part if n is not stamp and n.args[0] is stamp}
    if reference is None or len(part) != 1 + len(outputs):
        raise StampMismatch(f"block '{fqn}' is stamped from '{given.reference}', which "
                            f"{'has nodes of its own' if reference else 'was left inline'}")
    for i, out in list(outputs.items()):  # a block's output nothing reads (attention
        if not out.users:  # weights), which its reference's module need not return
            graph.erase_node(out)
            del outputs[i]
    reads, gives = reference
    args = [_passed(r, given, stamp) for r in reads]
    after = {i: _collectives_between(gives, given.outputs[i]) for i in outputs}
    if any(a is None for a in args) or any(made is None for made in after.values()):
        raise StampMismatch(f"block '{fqn}' is stamped from '{given.reference}', whose "
                            f"module reads or returns other values than the block's")
    try:
        graph.owning_module.get_submodule(target)
    except AttributeError:  # a block holding no tensors has no holder: stamp_modules copies
        graph.owning_module.add_submodule(target, nn.Module())  # its reference into this
    with graph.inserting_before(stamp):
        call = _call_module(graph, target, tuple(args))
        results = [call] if len(gives) == 1 else \
            [graph.call_function(operator.getitem, (call, i)) for i in range(len(gives))]
        given_as = dict(zip(gives, results))
        _made_again(graph, {n for made in after.values() for n in made}, given_as)
    call.meta = {"val": tuple(g.meta.get("val") for g in gives),
                 "nn_module_stack": dict(stamp.meta.get("nn_module_stack", {}))}
    renamed = {}
    for i, out in outputs.items():
        renamed[out] = given_as[given.outputs[i]]
        renamed[out].meta.update(out.meta)
        out.replace_all_uses_with(renamed[out])
        graph.erase_node(out)
    graph.erase_node(stamp)
    _rename(records, renamed)
    _rename_done(done, renamed)


def _passed(read: fx.Node, given: Stamp, stamp: fx.Node) -> Optional[fx.Node]:
    """What ``stamp`` passes where its reference's module reads ``read``: the stamp's own
    argument for one of the reference's inputs; where the caller made ``read`` of such
    inputs by collectives alone before the stamp's call, ``read`` itself if the stamp is
    given those inputs as they are (the same nodes: the shard of a mask the root computed),
    else a copy of those collectives made of the stamp's own arguments, put before its call
    (the gradient sync of a block's input that its projections read first). ``None``
    otherwise."""
    inputs, args = given.inputs, stamp.args[0]
    if read in inputs:
        return args[inputs.index(read)]
    made = _collectives_between(inputs, read)
    if made is None or not read < stamp:
        return None
    given_as = {i: a for i, a in zip(inputs, args)}
    sources = {n for m in made for n in _made_of(m) if n not in made}
    if all(given_as[n] is n for n in sources):
        return read
    if any(placement_of(given_as[n]) != placement_of(n) for n in sources):
        return None  # the collectives would see another layout than the reference's did
    with stamp.graph.inserting_before(stamp):
        _made_again(stamp.graph, made, given_as)
    return given_as[read]


def _collectives_between(ends: list, value: fx.Node) -> Optional[set[fx.Node]]:
    """The collectives (and pieces of their results) that make ``value`` of ``ends``, the
    values a reference's module reads or returns: what a caller made of them (a block's
    input gradient sync, a row-wise output's all-reduce where the caller adds the
    residual). Empty where ``value`` is one of ``ends``; ``None`` where it is made
    otherwise."""
    made, todo = set(), [value]
    while todo:
        node = todo.pop()
        if node in ends or node in made:
            continue
        found = _made_of(node)
        if found is None:
            return None
        made.add(node)
        todo += found
    return made


def _made_again(graph: fx.Graph, made: set[fx.Node], given_as: dict) -> None:
    """Copy the collectives ``made`` (in the graph's order) at the graph's insertion point,
    each reading ``given_as[v]`` where it read ``v``; ``given_as`` then maps each to its
    copy. A placeholder standing for a collective (``MADE_BY``) is made as that call."""
    mapped = lambda n: given_as.get(n, n)  # noqa: E731
    for node in sorted(made):
        if MADE_BY in node.meta:
            target, args, kwargs = node.meta[MADE_BY]
            given_as[node] = graph.call_function(target,
                                                 *fx.node.map_arg((args, kwargs), mapped))
            given_as[node].meta = {k: v for k, v in node.meta.items() if k != MADE_BY}
        else:
            given_as[node] = graph.node_copy(node, mapped)


def _made_of(node: fx.Node) -> Optional[list[fx.Node]]:
    """The values a collective (or a piece of one's result) is made of, also where a
    placeholder stands for it (``MADE_BY``); ``None`` for any other node."""
    if MADE_BY in node.meta:
        found: list[fx.Node] = []
        fx.node.map_arg(node.meta[MADE_BY][1:], found.append)
        return found
    if COLLECTIVE not in node.meta and node.target is not operator.getitem or \
            not node.all_input_nodes:
        return None
    return node.all_input_nodes


def _traced_op(node: fx.Node) -> bool:
    """An op the model's code ran (not a tensor read, nor a collective a pass added)."""
    return node.op == "call_function" and bool(node.meta.get("nn_module_stack")) and \
        COLLECTIVE not in node.meta


def _call_module(graph: fx.Graph, target: str, args: tuple) -> fx.Node:
    """``graph.call_module(target, args)``, its node not named ``self``: a module named so
    (BERT's ``attention.self``) would shadow the ``self`` of the generated ``forward``."""
    return graph.create_node("call_module", target, args,
                             name="self_module" if target == "self" else None)


def _stamps(nodes: Iterable[fx.Node]) -> list[Stamp]:
    """The :class:`Stamp` records of ``nodes``, each once (the stamps of one reference
    share one)."""
    return list({id(n.meta[STAMP]): n.meta[STAMP] for n in nodes if STAMP in n.meta}.values())


def _rename(records: Iterable[Stamp], renamed: dict) -> None:
    """Make each :class:`Stamp` of ``records`` name ``renamed[v]`` where it named ``v``."""
    for stamp in records:
        stamp.inputs[:] = [renamed.get(x, x) for x in stamp.inputs]
        stamp.outputs[:] = [renamed.get(x, x) for x in stamp.outputs]


def _rename_done(done: dict, renamed: dict) -> None:
    """Make the values each outlined module of ``done`` reads and returns name
    ``renamed[v]`` where they named ``v``: a module outlined before the one whose call
    now gives ``v`` (its part began earlier: a tensor it reads) may read it."""
    for reads, gives in done.values():
        reads[:] = [renamed.get(x, x) for x in reads]
        gives[:] = [renamed.get(x, x) for x in gives]


def _drop_stamp_edges(graph: fx.Graph) -> None:
    """Remove the :func:`stamp_edge` marks; each :class:`Stamp` then names the values its
    reference's program reads and gives."""
    resolved: dict[fx.Node, fx.Node] = {}
    for node in list(graph.nodes):
        if node.target is stamp_edge:
            resolved[node] = resolved.get(node.args[0], node.args[0])
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            continue
        stamp = node.meta.get(STAMP)
        if stamp is not None:
            stamp.inputs[:] = [resolved.get(n, n) for n in stamp.inputs]
            stamp.outputs[:] = [resolved.get(n, n) for n in stamp.outputs]


def stamp_modules(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Each stamped block (``ctx.stamped``: FQN -> reference FQN), a holder of its own
    tensors, becomes a copy of its reference's module: the same class, graph and generated
    code, holding the block's tensors (and their state-dict hooks) at the same paths, and
    the plain attributes of its own module in ``ctx.model``."""
    stamped, model = ctx.stamped, ctx.model
    for fqn, reference in stamped.items():
        owner, _, name = fqn.rpartition(".")
        parent = gm.get_submodule(owner)
        parent._modules[name] = _copy_module(gm.get_submodule(reference),
                                             parent._modules[name], fqn,
                                             model.get_submodule(fqn))
        parent._modules[name].meta[STAMP] = reference  # read by inline_program
    return gm


_HELD = ("_parameters", "_buffers", "_non_persistent_buffers_set", "_fxtp_plain",
         "_fxtp_buffers", "_fxtp_leaves")  # a module's own tensors and what fxtp keeps about them


def _copy_module(like: nn.Module, holder: nn.Module, fqn: str,
                 original: Optional[nn.Module]) -> nn.Module:
    """A module of ``like``'s class, graph and hooks (its own, those given the module
    called with the copy) holding ``holder``'s tensors, with ``original``'s plain
    attributes where ``like`` is a graph module."""
    copy = object.__new__(like.__class__)  # its class: GraphModule.__new__ makes a new one
    copied = set(like.__dict__.get(COPIED, ()))  # the reference's own; the block's below
    copy.__dict__.update({k: type(v)(v) if isinstance(v, (dict, set, list)) else v
                          for k, v in like.__dict__.items() if k not in copied})
    for key, hooks in copy.__dict__.items():
        if key.endswith("hooks") and isinstance(hooks, dict):
            hooks.update({k: WrappedHook(h.hook, copy) for k, h in hooks.items()
                          if isinstance(h, WrappedHook) and h.with_module and
                          h.module() is like})
    for key in _HELD:
        if key in holder.__dict__:
            copy.__dict__[key] = holder.__dict__[key]
        else:
            copy.__dict__.pop(key, None)
    for kind in ("_parameters", "_buffers"):
        held = {k for k, v in getattr(copy, kind, {}).items() if v is not None}
        liked = {k for k, v in getattr(like, kind, {}).items() if v is not None}
        if held != liked:
            raise StampMismatch(f"module '{fqn}' holds {sorted(held)} where the module it "
                                f"is stamped from holds {sorted(liked)}")
        if kind in copy.__dict__:
            copy.__dict__[kind].update({k: None for k in getattr(like, kind).keys() - held})
    if set(holder._modules) - set(like._modules):
        raise StampMismatch(f"module '{fqn}' holds modules the module it is stamped from "
                            f"lacks: {sorted(set(holder._modules) - set(like._modules))}")
    if isinstance(copy, fx.GraphModule) and original is not None:
        copy_plain_state(copy, original)
    children = original._modules if original is not None else {}
    copy._modules = {name: _copy_module(child, holder._modules.get(name) or nn.Module(),
                                        f"{fqn}.{name}", children.get(name))
                     for name, child in like._modules.items()}
    return copy


def _local_name(gm, target: str, base: str, prefix: str, names: dict) -> Optional[str]:
    """``target`` (relative to ``base``) as the new submodule names it: a tensor under the
    submodule's FQN ``prefix`` (by any of its names, for ties) or a non-tensor attribute
    (a torch.cond branch), else ``None``."""
    value = attr(gm, target)
    full = [n for n in names.get(id(value), [])] if hasattr(value, "shape") else None
    if full is None:
        return target
    inner = [n[len(prefix):] for n in full if n.startswith(prefix)]
    return inner[0] if inner else None


def _call(graph: fx.Graph, part: list, inputs: list, outputs: list, target: str,
          records: list) -> list[fx.Node]:
    """Replace ``part`` by one ``call_module``: placed where its first op computing on its
    inputs was (or, where that precedes its last input, the first of its nodes after that
    input), with the nodes before that which use its results moved after it. Reads of
    tensors, what is computed of them alone (a KV head's rows sliced) and collectives the
    rewrite added do not place the call: hoisted to the top of the graph, or gathering an
    input made before an autocast region, they would move the module's ops out of the
    region, or before a random draw they ran after. Nodes that read nothing of
    the part keep their place before the call: a state change the part's later nodes ran
    after (a ``vmap`` level left, an autocast region exited) still comes first. Returns the
    nodes that now give ``outputs``."""
    inside = set(part)
    last_input = max(inputs, default=None)
    movable = made_of_held_tensors(part, through_collectives=True)
    start = next((n for n in part if n not in movable and COLLECTIVE not in n.meta), part[0])
    if last_input is not None and last_input > start:
        start = next(n for n in part if n > last_input)
    where = graph.inserting_before(start)
    later: list[fx.Node] = []
    tainted = set(inside)
    node = part[0]
    while node is not start and node.next is not start:
        node = node.next
        if node not in inside and any(a in tainted for a in node.all_input_nodes):
            tainted.add(node)
            later.append(node)
    with where:
        call = _call_module(graph, target, tuple(inputs))
        call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
        results = [call] if len(outputs) == 1 else \
            [graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
    for out, result in zip(outputs, results):
        if result is not call:
            result.meta.update(out.meta)
        out.replace_all_uses_with(result)
    if len(outputs) == 1:
        call.meta = dict(outputs[0].meta)
    last = results[-1] if results else call  # a module whose results nothing reads
    for node in later:
        last.append(node)
        last = node
    for n in reversed(part):
        graph.erase_node(n)
    _rename(records, dict(zip(outputs, results)))
    return results


def _place_tensors(gm: fx.GraphModule, tensors: dict, outlined: set, persistent: set
                   ) -> None:
    """Every parameter and buffer under each of its names, held by the deepest outlined
    module above it (those the graphs do not read included: nothing is dropped)."""
    for name, t in tensors.items():
        holder = _nearest(name, outlined)
        module: nn.Module = gm.get_submodule(holder) if holder else gm
        hold(module, name[len(holder) + 1:] if holder else name, t, name in persistent)


def hold(module: nn.Module, path: str, t, persistent: bool) -> None:
    """Register ``t`` at ``path`` below ``module`` (holders made as needed), unless there:
    a parameter if it is one, else a buffer."""
    *parents, leaf = path.split(".")
    for part in parents:
        if part not in module._modules:
            module.add_module(part, nn.Module())
        module = module._modules[part]
    if leaf in module._buffers:
        (module._non_persistent_buffers_set.discard if persistent else
         module._non_persistent_buffers_set.add)(leaf)
    if leaf in module._parameters or leaf in module._buffers:
        return
    module.__dict__.pop(leaf, None)  # a GraphModule's plain attribute copy
    if isinstance(t, nn.Parameter):
        module.register_parameter(leaf, t)
    else:
        module.register_buffer(leaf, t, persistent=persistent)


def _rebuild_containers(gm: nn.Module, model: nn.Module, prefix: str = "") -> None:
    """Holders standing for the model's ``ModuleList`` / ``ModuleDict`` become one."""
    for name, child in list(gm._modules.items()):
        fqn = prefix + name
        try:
            original = model.get_submodule(fqn)
        except AttributeError:
            continue
        _rebuild_containers(child, model, fqn + ".")
        if type(child) is nn.Module and isinstance(original, (nn.ModuleList, nn.ModuleDict)):
            container = type(original)() if isinstance(original, nn.ModuleDict) else \
                nn.ModuleList()
            keys = list(child._modules)
            if isinstance(container, nn.ModuleList):
                if set(keys) != {str(i) for i in range(len(keys))}:
                    continue
                keys = [str(i) for i in range(len(keys))]
            for key in keys:
                container.add_module(key, child._modules[key])
            gm._modules[name] = container


def inline_program(gm: fx.GraphModule) -> fx.Graph:
    """One graph of the whole program: outlined modules and checkpointed regions inlined
    (the node objects of their graphs, so ``meta`` is the original's), ``get_attr``
    targets relative to ``gm``."""
    graph = fx.Graph()
    env: dict[fx.Node, object] = {}
    _inline(gm, "", graph, env, None)
    return graph


def _inline(gm: fx.GraphModule, prefix: str, graph: fx.Graph, env: dict, args,
            move: tuple = ()) -> object:
    """Copy ``gm``'s nodes into ``graph``, its placeholders bound to ``args`` (``None``: to
    new placeholders); returns what its output returns. ``move``: (reference FQN, FQN) of
    the stamped block being inlined, whose nodes' module stacks name its reference."""
    placeholders = iter(args or ())
    for node in gm.graph.nodes:
        if node.op == "placeholder" and args is not None:
            env[node] = next(placeholders)
        elif node.op == "output":
            if args is not None:
                return fx.node.map_arg(node.args[0], env.__getitem__)
            graph.node_copy(node, env.__getitem__)
        elif node.op == "call_module" and isinstance(gm.get_submodule(node.target),
                                                     fx.GraphModule):
            sub = gm.get_submodule(node.target)
            env[node] = _inline(sub, prefix + node.target + ".", graph, env,
                                fx.node.map_arg(node.args, env.__getitem__),
                                (sub.meta[STAMP], prefix + node.target) if STAMP in sub.meta
                                else move)
        elif node.target is run_checkpointed:
            region = attr(gm, node.args[0].target)
            env[node] = _inline(region, prefix, graph, env,
                                fx.node.map_arg(node.args[1:], env.__getitem__), move)
        elif node.op == "call_function" and node.target is operator.getitem and \
                isinstance(env.get(node.args[0]), tuple):
            env[node] = env[node.args[0]][node.args[1]]
        elif node.target is call_submodule:
            module, prefix_ = env[node.args[0]]
            env[node] = _inline(module, prefix_, graph, env,
                                fx.node.map_arg(node.args[1:], env.__getitem__), move)
        elif node.op == "get_attr" and isinstance(attr(gm, node.target), fx.GraphModule):
            env[node] = (attr(gm, node.target), prefix + node.target + ".")
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
            if node.op == "get_attr":
                env[node].target = prefix + node.target
            if move and "nn_module_stack" in node.meta:
                env[node].meta["nn_module_stack"] = moved_stack(node.meta["nn_module_stack"],
                                                                *move)
    return None


def moved_stack(stack: dict, reference: str, fqn: str) -> dict:
    """A module stack of ``reference``'s nodes as block ``fqn``'s copy of them has it."""
    def move(path):
        return fqn + path[len(reference):] if path == reference or \
            path.startswith(reference + ".") else path
    return {(key[:len(key) - len(path)] + move(path) if key.endswith(path) else key):
            (move(path), kind) for key, (path, kind) in stack.items()}


def _follow_order(gm: nn.Module, model: nn.Module) -> None:
    """Each module's tensors and children in the model's order (``state_dict()`` keys)."""
    for fqn, module in gm.named_modules():
        try:
            original = model.get_submodule(fqn)
        except AttributeError:
            continue
        for slots in ("_parameters", "_buffers", "_modules"):
            mine, order = getattr(module, slots), list(getattr(original, slots))
            ordered = sorted(mine, key=lambda k: order.index(k) if k in order else len(order))
            setattr(module, slots, {k: mine[k] for k in ordered})
