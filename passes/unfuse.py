"""Unfuse pass: compute a fused projection part by part where its parts cannot be sharded
together.

A colwise projection whose output is split into parts (``q, k, v = qkv(x).split(...)``,
``gate, up = w13(x).chunk(2, -1)``) is served blocked by :mod:`fxtp.passes.strided` when
every part divides by the world size. Where one does not (fewer KV heads than ranks, an
MLP width that does not divide), propagation gathers the fused output at the split. Such a
projection is rewritten here as one ``linear`` per part, on row slices of the fused weight
(and bias), each slice laid out as a colwise projection's weight. Every part then places as
a separate projection does: KV heads dealt to the groups of ranks whose query heads use
them and uneven widths dealt as ``torch.chunk`` deals them (:mod:`fxtp.passes.units`).

The fused parameter stays whole on every rank (vLLM holds a grouped KV head on each rank of
its group so too): parameter memory is traded for the gather of every activation. A sharded
slice's gradient is gathered, a grouped one's summed over the ranks, as those layouts do for
any parameter. A rewrite is kept only if the program then falls back less; otherwise the
graph is put back exactly as it was.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate

from .context import PassContext
from .graph import (BOUNDARY, FALLBACK, FALLBACKS, INPUTS, PLACEMENT, RELAID, layout,
                    module_fqn, placement_of, tied_attrs, val)
from .placement import dealt_shard, is_replicate, is_sharded
from .snapshot import Snapshot

aten = torch.ops.aten
_SPLITS = {aten.split_with_sizes.default, aten.split.Tensor, aten.chunk.default}


def unfuse_splits(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Compute every fused projection whose split is gathered (at the split or further on)
    part by part, and place the program again (``ctx.place``). Keep that if it falls back
    less; else put the graph and ``gm.meta[FALLBACKS]`` back exactly as they were.
    ``gm.meta[RELAID]``: whether it was kept."""
    graph, tied, world = gm.graph, tied_attrs(gm), ctx.world
    found = [(split, fused) for split in graph.nodes
             if (fused := _fused_projection(split, tied, world)) is not None]
    gm.meta[RELAID] = False
    if not found:
        return gm
    before, fallbacks = Snapshot(graph), sum(FALLBACK in n.meta for n in graph.nodes)
    prior = gm.meta.get(FALLBACKS)
    for split, fused in found:
        _unfuse(graph, split, *fused, world)
    graph.lint()
    kept = len(ctx.place(gm, ctx).meta[FALLBACKS]) < fallbacks
    if not kept:
        before.restore()
        gm.meta[FALLBACKS] = prior
    gm.meta[RELAID] = kept
    return gm


def _fused_projection(split: fx.Node, tied: set, world: int):
    """``(linear, markers)`` for a split of the output of a ``linear`` on its features,
    read through module-output layout markers only, that gathers it or whose parts are
    gathered further on, when the weight and bias are parameters read only there and every
    part has at least ``world`` features; else ``None``."""
    if split.op != "call_function" or split.target not in _SPLITS or \
            any(u.target is not operator.getitem for u in split.users):
        return None
    fused, needed = split.args[0], (split.meta.get(INPUTS) or (None,))[0]
    have = placement_of(fused)
    dim = _split_dim(split)
    if not is_sharded(have) or have.dim != dim or \
            not (is_replicate(needed) or _falls_back_after(split)):
        return None
    markers, node = [], fused
    while node.op == "call_function" and node.target is layout:
        if len(node.users) != 1:
            return None
        markers.append(node)
        node = node.args[0]
    if node.target is not aten.linear.default or len(node.users) != 1 or \
            dim != val(node).dim() - 1 or any(p.shape[dim] < world for p in val(split)):
        return None
    params = [p for p in node.args[1:3] if p is not None]
    if any(p.op != "get_attr" or len(p.users) != 1 or p in tied for p in params):
        return None
    return node, markers


def _falls_back_after(split: fx.Node) -> bool:
    """Whether an op of the split's module that reads its parts (directly or not) gathers
    an input for want of a rule (heads that do not divide by the world size)."""
    scope, seen, todo = module_fqn(split), set(), list(split.users)
    while todo:
        node = todo.pop()
        if node in seen or not module_fqn(node).startswith(scope):
            continue
        if FALLBACK in node.meta:
            return True
        seen.add(node)
        todo.extend(node.users)
    return False


def _split_dim(split: fx.Node) -> int:
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    return dim % val(split.args[0]).dim()


def _unfuse(graph: fx.Graph, split: fx.Node, linear: fx.Node, markers: list, world: int):
    """``linear(x, w, b)`` split into parts -> ``linear(x, w_i, b_i)`` per part, ``w_i`` and
    ``b_i`` this part's rows of the whole parameters, each laid out sharded on its rows."""
    sizes = [part.shape[-1] for part in val(split)]
    x, params = linear.args[0], [p for p in linear.args[1:3] if p is not None]
    pieces = []
    with graph.inserting_before(linear):
        for param in params:
            param.meta[PLACEMENT] = Replicate()
            cut = _node(graph, linear, aten.split_with_sizes.default, (param, sizes),
                        list(val(param).split(sizes)))
            rows = [_node(graph, linear, operator.getitem, (cut, i), v)
                    for i, v in enumerate(val(cut))]
            pieces.append([_sharded(graph, linear, row, f"part {i} of {param.target}", world)
                           for i, row in enumerate(rows)])
        parts = [_node(graph, linear, aten.linear.default, (x, *own), val(split)[i])
                 for i, own in enumerate(zip(*pieces))]
    for user in list(split.users):
        user.replace_all_uses_with(parts[user.args[1]])
        graph.erase_node(user)
    for node in [split, *markers, linear]:
        graph.erase_node(node)


def _node(graph: fx.Graph, like: fx.Node, target, args, value) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta.update(val=value, nn_module_stack=dict(like.meta.get("nn_module_stack", {})))
    for key in ("stack_trace", "source_fn_stack"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
    return node


def _sharded(graph: fx.Graph, like: fx.Node, rows: fx.Node, what: str, world: int):
    """``rows`` laid out sharded on dim 0 (dealt as ``torch.chunk`` deals them where they
    do not divide by the world size)."""
    placement = dealt_shard(0, val(rows).shape[0], world)
    marker = _node(graph, like, layout, (rows, placement), val(rows))
    marker.meta[BOUNDARY], marker.meta[PLACEMENT] = what, placement
    return marker
