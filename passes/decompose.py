"""Decomposition pass: an op torch composes of other ops, where fxtp states no rule for it,
becomes the ops it is composed of.

``torch.export``'s training IR keeps the ops model code calls, the
``CompositeImplicitAutograd`` ones included (``view_as``, ``reshape_as``, ``expand_as``,
``chunk`` forms, ...). Rules are stated for the common ones; any other is replaced in place
by the ATen ops its implicit kernel runs (traced by ``make_fx`` on the node's own fake
values), whose rules then place it. The new nodes keep the replaced node's metadata
(module stack, stack trace, stamps' regions) and carry their own ``meta['val']``.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx

from .rules import rule_for


def decompose_unruled(gm: fx.GraphModule) -> list[str]:
    """Replace, in ``gm`` and its graph submodules, every call of a composite ATen op that
    has no rule by its decomposition; return the ops replaced, by node name."""
    done = []
    for module in [m for m in gm.modules() if isinstance(m, fx.GraphModule)]:
        replaced = [n for n in list(module.graph.nodes) if n.op == "call_function" and
                    is_composite(n.target) and rule_for(n.target) is None and
                    _inline_decomposition(module.graph, n)]
        if replaced:
            done += [f"{n.name} ({n.target})" for n in replaced]
            for node in replaced:
                module.graph.erase_node(node)
            module.graph.lint()
            module.recompile()
    return done


def is_composite(target) -> bool:
    """An ATen op with a ``CompositeImplicitAutograd`` kernel: torch defines it by other
    ops."""
    return isinstance(target, torch._ops.OpOverload) and target.namespace == "aten" and \
        torch._C._dispatch_has_kernel_for_dispatch_key(target.name(),
                                                       "CompositeImplicitAutograd")


def _inline_decomposition(graph: fx.Graph, node: fx.Node) -> bool:
    """Insert ``node``'s decomposition before it and move its users onto the result;
    ``False`` (the graph unchanged) where it cannot be traced or would add constants."""
    leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
    where = [i for i, a in enumerate(leaves) if isinstance(a, fx.Node)]
    if any("val" not in leaves[i].meta for i in where) or "val" not in node.meta or \
            isinstance(node.meta["val"], (tuple, list)) and \
            not all(u.target is operator.getitem for u in node.users):
        return False

    def call(*values):
        filled = list(leaves)
        for i, v in zip(where, values):
            filled[i] = v
        args, kwargs = pytree.tree_unflatten(filled, spec)
        return node.target(*args, **kwargs)

    try:
        sub = make_fx(call, tracing_mode="real")(*[leaves[i].meta["val"] for i in where])
    except Exception:  # noqa: BLE001 - left as is: propagation reports it
        return False
    if any(n.op == "get_attr" for n in sub.graph.nodes):
        return False
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    env = {p: leaves[i] for p, i in zip(placeholders, where)}
    with graph.inserting_before(node):
        for n in sub.graph.nodes:
            if n.op == "call_function":
                env[n] = graph.node_copy(n, lambda a: env[a])
                env[n].meta = {**node.meta, "val": n.meta.get("val")}
    result = pytree.tree_map(lambda a: env[a] if isinstance(a, fx.Node) else a,
                             sub.graph.output_node().args[0])
    if isinstance(result, (tuple, list)):
        for user in list(node.users):  # getitem(node, i)
            user.replace_all_uses_with(result[user.args[1]])
            graph.erase_node(user)
    else:
        node.replace_all_uses_with(result)
    return True
