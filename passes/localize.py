"""Localize pass: turn the global program into this rank's program.

Global shape arguments (``view``, ``reshape``, ``expand``) become local shapes, ops whose
rule has a local form on their shards are swapped for it (a vocab-sharded embedding becomes
a masked lookup, a split of a strided input takes local sizes), reads of a sharded dim's
size (``sym_size``) are scaled back to the global size so shape arithmetic in user code
stays global, and parameters and buffers are replaced by copies of this rank's shards
(:func:`fxtp.passes.placement.local_part`; never the user's tensors; a meta model's fake
stand-ins by meta tensors of the local shape, for the caller to allocate).
``node.meta["val"]`` keeps the global shape.

``view`` becomes ``reshape``: the trace dropped ``.contiguous()`` calls that were no-ops on
the single-device strides (CPU attention returns a layout whose transpose is contiguous),
and local kernels, other devices and collectives may lay out their results differently.
``reshape`` is a view wherever ``view`` would have been one.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn as nn

from ..kernels.torch_compat import FakeTensor, OpOverload
from .context import PassContext
from .graph import INPUTS, PLACEMENT, branches
from .placement import is_sharded, local_part
from .rules import rule_for

aten = torch.ops.aten


def localize(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Make ``gm``'s shapes and tensors those of ``ctx.group``'s rank. ``ctx.copies``:
    tensors no node reads (a stamped block's, :class:`~fxtp.passes.graph.Stamp`) -> the
    tensor read in their place, whose placement they take. Edits ``gm.graph`` (and
    recompiles the ``torch.cond`` branches it edits); recompiling ``gm`` is left to the
    caller, which edits it further."""
    group, copies = ctx.group, ctx.copies
    rank, world = group.rank, group.world
    graph = gm.graph
    localized: set[str] = set()
    shards: dict[int, torch.Tensor] = {}  # id(global tensor) -> local tensor, keeps ties
    placed: dict[str, object] = {}  # get_attr target -> its placement
    for node in list(graph.nodes):
        for branch in branches(gm, node):  # torch.cond: each branch is localized alike
            localize(branch, ctx.but(copies={}))
            branch.recompile()
        if node.op == "call_function":
            rule = rule_for(node.target)
            if rule is not None:
                op = node.target
                node.target, node.args, node.kwargs = rule.localize(
                    node, node.meta[INPUTS], node.meta[PLACEMENT], group, graph)
                if node.target is not op and not isinstance(node.target, OpOverload):
                    _cast_inputs_as_traced(graph, node)
            if node.target is aten.view.default:
                node.target = aten.reshape.default
            elif node.target is aten.sym_size.int:
                _globalize_size(graph, node, world)
        elif node.op == "get_attr" and node.target not in localized:
            localized.add(node.target)
            placed[node.target] = node.meta.get(PLACEMENT)
            _localize_attr(gm, node.target, placed[node.target], rank, world, shards)
    for target, like in copies.items():
        _localize_attr(gm, target, placed[like], rank, world, shards)
    graph.lint()
    return gm


def _cast_inputs_as_traced(graph: fx.Graph, node: fx.Node) -> None:
    """A kernel standing for an op computes on its inputs as they come, while the op, as
    traced, gave another floating dtype: autocast computed it in fp32 (``cross_entropy``
    of bf16 logits) or in bf16, or its ``dtype`` argument or type promotion widened it.
    Each floating input of another dtype is cast to the traced one first, as autocast and
    promotion do, so the kernel computes and returns what the op did."""
    traced = node.meta.get("val")
    if not isinstance(traced, torch.Tensor) or not traced.is_floating_point():
        return
    def cast(arg):
        given = arg.meta.get("val") if isinstance(arg, fx.Node) else None
        if not isinstance(given, torch.Tensor) or not given.is_floating_point() or \
                given.dtype == traced.dtype:
            return arg
        with graph.inserting_before(node):
            made = graph.call_function(aten._to_copy.default, (arg,), {"dtype": traced.dtype})
        made.meta.update(node.meta, val=given.to(traced.dtype))
        made.meta[PLACEMENT] = arg.meta.get(PLACEMENT)
        made.meta[INPUTS] = (made.meta[PLACEMENT],)
        return made
    node.args, node.kwargs = fx.node.map_arg((node.args, node.kwargs), cast)


def _globalize_size(graph, node, world):
    source, dim = node.args
    placement = source.meta.get(PLACEMENT)
    if is_sharded(placement) and placement.dim == dim % source.meta["val"].dim():
        with graph.inserting_after(node):
            scaled = graph.call_function(operator.mul, (node, world))
        node.replace_all_uses_with(scaled, delete_user_cb=lambda u: u is not scaled)


@torch.no_grad()
def _localize_attr(gm, target: str, placement, rank: int, world: int, shards: dict):
    owner_name, _, name = target.rpartition(".")
    owner = gm.get_submodule(owner_name)
    value = getattr(owner, name)
    if not isinstance(value, torch.Tensor):  # a higher-order op's subgraph
        return
    local = shards.get(id(value))
    if local is None:
        whole = value
        if isinstance(value, FakeTensor):  # a meta model's stand-in: a meta one, of the
            whole = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                        device="meta")  # local shape, is as good and quick
        part = local_part(whole, placement, rank, world)  # a view: cut to size 1 on a dim,
        # it keeps the whole's stride there; a contiguous part gets a contiguous one's
        local = part.clone(memory_format=torch.contiguous_format if part.is_contiguous()
                           else torch.preserve_format)
        if isinstance(value, nn.Parameter):
            local = nn.Parameter(local, requires_grad=value.requires_grad)
        shards[id(value)] = local
    if isinstance(value, nn.Parameter):
        owner._parameters[name] = local
    elif name in owner._buffers:
        owner._buffers[name] = local
    else:
        setattr(owner, name, local)
