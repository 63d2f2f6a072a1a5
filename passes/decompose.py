"""Decomposition passes: an op torch composes of other ops, where fxtp states no rule for it,
becomes the ops it is composed of; a norm over dims that arrive sharded becomes the
reductions it is made of (:func:`decompose_sharded_norms`).

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

from .graph import placement_of
from .placement import is_sharded
from .rules import rule_for

aten = torch.ops.aten


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


def decompose_sharded_norms(gm: fx.GraphModule, world: int) -> bool:
    """Replace each ``layer_norm`` / ``rms_norm`` whose input arrives sharded on a
    normalized dim (a q / k norm over all heads, read on a colwise projection's head shards:
    ESM-C's, OLMo-core's) by its mean, centring and scaling ops, whose rules sum the ranks'
    partial sums (one all-reduce per mean, each way) instead of gathering the input. Run
    between propagations: ``True`` where the graph changed."""
    changed = False
    for node in list(gm.graph.nodes):
        norm = _NORMS.get(node.target)
        if norm is None or not isinstance(node.args[0], fx.Node):
            continue
        p, rank = placement_of(node.args[0]), node.args[0].meta["val"].dim()
        if is_sharded(p) and getattr(p, "dim", -1) % rank >= rank - len(node.args[1]) and \
                _inline_decomposition(gm.graph, node, norm):
            gm.graph.erase_node(node)
            changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed


def _layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    """``layer_norm`` as reductions (in fp32 for 16-bit inputs, as its kernel computes)."""
    dims = list(range(-len(normalized_shape), 0))
    a = x.float() if x.element_size() < 4 and x.is_floating_point() else x
    centered = a - a.mean(dims, keepdim=True)
    out = centered * torch.rsqrt(centered.square().mean(dims, keepdim=True) + eps)
    out = out if weight is None else out * weight
    return (out if bias is None else out + bias).to(x.dtype)


def _rms_norm(x, normalized_shape, weight=None, eps=None):
    """``rms_norm`` as reductions (``eps`` defaulting to the input dtype's, as torch's)."""
    dims = list(range(-len(normalized_shape), 0))
    a = x.float() if x.element_size() < 4 and x.is_floating_point() else x
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    out = a * torch.rsqrt(a.square().mean(dims, keepdim=True) + eps)
    return (out if weight is None else out * weight).to(x.dtype)


_NORMS = {aten.layer_norm.default: _layer_norm, aten.rms_norm.default: _rms_norm}


def is_composite(target) -> bool:
    """An ATen op with a ``CompositeImplicitAutograd`` kernel: torch defines it by other
    ops."""
    return isinstance(target, torch._ops.OpOverload) and target.namespace == "aten" and \
        torch._C._dispatch_has_kernel_for_dispatch_key(target.name(),
                                                       "CompositeImplicitAutograd")


def _inline_decomposition(graph: fx.Graph, node: fx.Node, function=None) -> bool:
    """Insert ``node``'s decomposition (the ATen ops of ``function``, default its own
    target, on its arguments) before it and move its users onto the result; ``False`` (the
    graph unchanged) where it cannot be traced or would add constants."""
    function = function or node.target
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
        return function(*args, **kwargs)

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
