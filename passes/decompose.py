"""Decomposition passes: an op torch composes of other ops, where fxtp states no rule for it,
becomes the ops it is composed of; an op with a kernel of its own but no rule, reached by a
sharded or partial value, becomes the ops of torch's decomposition of it
(:func:`decompose_sharded_unruled`); a norm over dims that arrive sharded becomes the
reductions it is made of (:func:`decompose_sharded_norms`).

``torch.export``'s training IR keeps the ops model code calls, the
``CompositeImplicitAutograd`` ones included (``view_as``, ``reshape_as``, ``expand_as``,
``chunk`` forms, ...). Rules are stated for the common ones; any other is replaced in place
by the ATen ops its implicit kernel runs (traced by ``make_fx`` on the node's own fake
values), whose rules then place it. The new nodes keep the replaced node's metadata
(module stack, stack trace, stamps' regions) and carry their own ``meta['val']``.
"""
from __future__ import annotations

import contextlib
import functools
import math
import operator

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate
from torch.fx.experimental.proxy_tensor import make_fx

from ..kernels.torch_compat import OpOverload, decomposition_table, has_kernel_for, pytree
from .context import PassContext, relayout
from .graph import AUTOCAST, DECOMPOSED, op_arg, placement_of
from .placement import is_blocked, is_grouped, is_sharded
from .rules import rule_for

aten = torch.ops.aten


def decompose_unruled(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Replace, in ``gm`` and its graph submodules, every call of a composite ATen op that
    has no rule by its decomposition; ``gm.meta[DECOMPOSED]``: the ops replaced, by node
    name."""
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
    gm.meta[DECOMPOSED] = done
    return gm


@relayout
def decompose_sharded_unruled(gm: fx.GraphModule, ctx: PassContext) -> bool:
    """Replace each call of an ATen op without a rule that a sharded or partial value
    reaches (``hardswish``, ``rsub.Tensor``, ``floor_divide``, ``mse_loss``,
    ``binary_cross_entropy_with_logits``, ``polar``, ...: kernels of their own, which
    torch tags no ``pointwise``) by torch's decomposition of it (``torch._decomp``), where
    every op of that decomposition has a rule; random ops are left as they are (a shard
    would draw other numbers). Their rules then place it instead of gathering its inputs.
    Run between propagations: ``True`` where the graph changed."""
    replaced = [n for n in list(gm.graph.nodes) if n.op == "call_function" and
                _decomposable(n.target) and rule_for(n.target) is None and
                any(not isinstance(placement_of(a), (Replicate, type(None)))
                    for a in n.all_input_nodes) and
                _inline_decomposition(gm.graph, n, _plain(decomposition_table[n.target]),
                                      accept=_all_ruled, table=_unruled_decompositions())]
    for node in replaced:
        gm.graph.erase_node(node)
    if replaced:
        gm.graph.lint()
        gm.recompile()
    return bool(replaced)


def _decomposable(target) -> bool:
    return isinstance(target, OpOverload) and target in decomposition_table and \
        torch.Tag.nondeterministic_seeded not in target.tags


def _plain(function):
    """``function`` returning a plain tuple where it returns a named one (torch's
    decompositions build ``return_types``, which a graph cannot hold)."""
    def call(*args, **kwargs):
        out = function(*args, **kwargs)
        return tuple(out) if isinstance(out, tuple) else out
    return call


@functools.cache
def _unruled_decompositions() -> dict:
    """torch's decompositions of the ops without a rule: applied inside a decomposition too
    (``binary_cross_entropy_with_logits`` calls ``log_sigmoid_forward``)."""
    return {op: fn for op, fn in decomposition_table.items()
            if _decomposable(op) and rule_for(op) is None}


def _all_ruled(sub: fx.GraphModule) -> bool:
    """Whether every op of a traced decomposition has a rule (random factories have none:
    ``bernoulli``'s ``rand`` keeps it whole)."""
    return all(n.target is operator.getitem or rule_for(n.target) is not None
               for n in sub.graph.nodes if n.op == "call_function")


@relayout
def decompose_sharded_norms(gm: fx.GraphModule, ctx: PassContext) -> bool:
    """Replace each ``rms_norm`` whose input arrives sharded on a normalized dim (a q / k
    norm over all heads, read on a colwise projection's head shards: OLMo-core's), each
    ``layer_norm`` whose input arrives so in blocks or to groups of ranks (even and unit
    shards are its rule's kernel's, :mod:`~fxtp.kernels.sharded_norm`), and each variance
    or standard deviation over a sharded dim (the same norm written by hand), by its
    means, centring and scaling ops, whose rules sum the ranks' partial sums (one
    all-reduce per mean, each way) instead of gathering the input. Run between
    propagations: ``True`` where the graph changed."""
    world = ctx.world
    changed = False
    for node in list(gm.graph.nodes):
        found = _NORMS.get(node.target)
        if found is None or not isinstance(node.args[0], fx.Node):
            continue
        function, reduced = found
        p, rank = placement_of(node.args[0]), node.args[0].meta["val"].dim()
        if node.target is aten.layer_norm.default and not (is_blocked(p) or
                                                           is_grouped(p, world)):
            continue  # its rule's kernel takes even and unit shards in one collective
        if is_sharded(p) and getattr(p, "dim", -1) % rank in reduced(node, rank) and \
                _inline_decomposition(gm.graph, node, function):
            gm.graph.erase_node(node)
            changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed


def _wide(x):
    """``x`` as the norm and moment kernels accumulate it: 16-bit floats in fp32."""
    return x.float() if x.is_floating_point() and x.element_size() < 4 else x


def _layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    """``layer_norm`` as reductions."""
    dims = list(range(-len(normalized_shape), 0))
    a = _wide(x)
    centered = a - a.mean(dims, keepdim=True)
    out = centered * torch.rsqrt(centered.square().mean(dims, keepdim=True) + eps)
    out = out if weight is None else out * weight
    return (out if bias is None else out + bias).to(x.dtype)


def _rms_norm(x, normalized_shape, weight=None, eps=None):
    """``rms_norm`` as reductions (``eps`` defaulting to the input dtype's, as torch's)."""
    dims = list(range(-len(normalized_shape), 0))
    a = _wide(x)
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    out = a * torch.rsqrt(a.square().mean(dims, keepdim=True) + eps)
    return (out if weight is None else out * weight).to(x.dtype)


def _moments(x, dim, unbiased, keepdim, correction):
    """``var`` / ``std`` / ``*_mean`` (both overloads: ``unbiased`` or ``correction``) as
    reductions: the centred squares' sum over the count less the correction, and the mean,
    as wide as the kernels accumulate (the callers round them to the input's dtype)."""
    dims = _reduced(dim, x.dim())
    count = math.prod(x.shape[d] for d in dims)
    correction = (1 if unbiased else 0) if correction is None else correction
    a = _wide(x)
    mean = a.mean(dims, keepdim=True)
    var = (a - mean).square().sum(dims, keepdim=keepdim) / (count - correction)
    return var, mean if keepdim else mean.squeeze(dims)


def _var(x, dim=None, unbiased=True, keepdim=False, *, correction=None):
    return _moments(x, dim, unbiased, keepdim, correction)[0].to(x.dtype)


def _std(x, dim=None, unbiased=True, keepdim=False, *, correction=None):
    return _moments(x, dim, unbiased, keepdim, correction)[0].sqrt().to(x.dtype)


def _var_mean(x, dim=None, *, correction=None, keepdim=False):
    var, mean = _moments(x, dim, True, keepdim, correction)
    return var.to(x.dtype), mean.to(x.dtype)


def _std_mean(x, dim=None, *, correction=None, keepdim=False):
    var, mean = _moments(x, dim, True, keepdim, correction)
    return var.sqrt().to(x.dtype), mean.to(x.dtype)


def _reduced(dim, rank: int) -> list[int]:
    """The dims a ``dim`` argument names (``None`` or ``[]``: all of them)."""
    dims = [dim] if isinstance(dim, int) else list(dim or [])
    return sorted({d % rank for d in dims}) if dims else list(range(rank))


def _trailing(node, rank):  # the normalized dims: as many trailing dims as the shape given
    return set(range(rank - len(node.args[1]), rank))


def _dim_argument(node, rank):
    return set(_reduced(op_arg(node, 1, "dim"), rank))


_NORMS = {  # op -> (its decomposition, the dims it reduces)
    aten.layer_norm.default: (_layer_norm, _trailing),
    aten.rms_norm.default: (_rms_norm, _trailing),
    aten.var.correction: (_var, _dim_argument),
    aten.var.dim: (_var, _dim_argument),
    aten.std.correction: (_std, _dim_argument),
    aten.std.dim: (_std, _dim_argument),
    aten.var_mean.correction: (_var_mean, _dim_argument),
    aten.std_mean.correction: (_std_mean, _dim_argument),
}


def is_composite(target) -> bool:
    """An ATen op with a ``CompositeImplicitAutograd`` kernel: torch defines it by other
    ops."""
    return isinstance(target, OpOverload) and target.namespace == "aten" and \
        has_kernel_for(target, "CompositeImplicitAutograd")


def _autocast_of(node: fx.Node):
    """The autocast region ``node`` runs in, entered (a decomposition traced in it records
    the casts autocast makes, so its ops give the dtypes the op gave), or no context."""
    state = node.meta.get(AUTOCAST)
    if state is None:
        return contextlib.nullcontext()
    device_type, dtype, enabled, cache_enabled = state
    return torch.autocast(device_type, dtype, enabled, cache_enabled)


def _inline_decomposition(graph: fx.Graph, node: fx.Node, function=None, accept=None,
                          table=None) -> bool:
    """Insert ``node``'s decomposition (the ATen ops of ``function``, default its own
    target, on its arguments; ops in ``table`` decomposed by it in turn) before it and move
    its users onto the result; ``False`` (the graph unchanged) where it cannot be traced,
    would add constants or ``accept`` (of the traced graph module) refuses it."""
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
        with _autocast_of(node):
            sub = make_fx(call, tracing_mode="real", decomposition_table=table)(
                *[leaves[i].meta["val"] for i in where])
    except Exception:  # noqa: BLE001 - left as is: propagation reports it
        return False
    sub.graph.eliminate_dead_code()
    if any(n.op == "get_attr" for n in sub.graph.nodes) or accept and not accept(sub):
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
    for n in reversed([env[n] for n in sub.graph.nodes if n.op == "call_function"]):
        if not n.users and not n.is_impure():  # computes an output nobody reads
            graph.erase_node(n)
    return True
