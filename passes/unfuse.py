"""Unfuse pass: compute a fused projection part by part where its parts cannot be sharded
together.

A colwise projection whose output is split into parts (``q, k, v = qkv(x).split(...)``,
``gate, up = w13(x).chunk(2, -1)``), or viewed by heads and sliced into runs of heads
(Falcon-7B's multi-query ``qkv.view(b, t, heads + 2, d)[..., :-2, :]``, ``[..., [-2], :]``,
``[..., [-1], :]``, or ``.split([heads, 1, 1], dim=-2)``), is served blocked by
:mod:`fxtp.passes.strided` when every part divides by the world size. Where one does not
(fewer KV heads than ranks, an MLP width that does not divide), propagation gathers the
fused output where it is split. Such a projection (``linear(x, w, b)``, or ``x @ w.T``) is
rewritten here as one ``linear`` per part, on row slices of the fused weight (and bias),
each slice laid out as a colwise projection's weight. Every part then places as a separate
projection does: KV heads dealt to the groups of ranks whose query heads use them, one head
that every query head reads whole on every rank, and uneven widths dealt as ``torch.chunk``
deals them (:mod:`fxtp.passes.units`).

The fused parameter stays whole on every rank (vLLM holds a grouped KV head on each rank of
its group so too): parameter memory is traded for the gather of every activation. A sharded
slice's gradient is gathered, a grouped or whole one's summed over the ranks, as those
layouts do for any parameter. A rewrite is kept only if the program then falls back less;
otherwise the graph is put back exactly as it was.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .context import PassContext
from .gather_early import gather_early
from .graph import (BOUNDARY, FALLBACK, FALLBACKS, INPUTS, PLACEMENT, RELAID, attr,
                    hold_whole, layout, module_fqn, op_arg, placement_of, tied_attrs,
                    transposed_matrix, val)
from .placement import dealt_shard, is_replicate, is_sharded
from .program_cost import program_cost
from .snapshot import Snapshot
from .unpin import unpin_layouts

aten = torch.ops.aten
_SPLITS = {aten.split_with_sizes.default, aten.split.Tensor, aten.chunk.default}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def unfuse_splits(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Compute every fused projection whose parts are gathered (where it is split or
    further on) part by part, and place the program again (``ctx.place``). Keep that if it
    falls back less, and if the program as it was, after the other trials (its layouts
    let go, its gathers moved early), falls back no less or sends more
    (:func:`~fxtp.passes.program_cost.program_cost`: at StarCoder's widths, gathering k
    and v sends far less than gathering the whole q rows' gradient); else put the graph
    and ``gm.meta[FALLBACKS]`` back exactly as they were. ``gm.meta[RELAID]``: whether it
    was kept."""
    graph, tied, world = gm.graph, tied_attrs(gm), ctx.world
    found = [(node, parts, fused) for node in graph.nodes
             if (parts := _split_parts(node) or _head_parts(node, gm)) is not None
             and (fused := _projection(_under_unsqueeze(node.args[0]),
                                       [size for _, size in parts], tied, world)) is not None]
    gm.meta[RELAID] = False
    fallbacks = sum(FALLBACK in n.meta for n in graph.nodes)
    if not found or not fallbacks:  # kept only where it falls back less
        return gm
    before = Snapshot(graph)
    prior = gm.meta.get(FALLBACKS)
    settled = program_cost(gather_early(unpin_layouts(gm, ctx), ctx), world)[::-1]
    before.restore()
    gm.meta[FALLBACKS] = prior
    for node, parts, fused in found:
        _unfuse(graph, node, parts, *fused, world)
    graph.lint()
    unfused = len(ctx.place(gm, ctx).meta[FALLBACKS])
    kept = unfused < fallbacks and (unfused, program_cost(gm, world)[0]) <= settled
    if not kept:
        before.restore()
        gm.meta[FALLBACKS] = prior
    gm.meta[RELAID] = kept
    return gm


def _under_unsqueeze(node: fx.Node) -> fx.Node:
    """What ``node`` unsqueezes on a dim before its last, read there only (GPT-BigCode's
    ``c_attn(x).unsqueeze(1).split(...)``); else ``node``."""
    if node.op == "call_function" and node.target is aten.unsqueeze.default and \
            len(node.users) == 1 and node.args[1] % val(node).dim() < val(node).dim() - 1:
        return node.args[0]
    return node


def _split_parts(split: fx.Node):
    """``[(reader, features)]``, each part's reader (a ``getitem``) in the order of the
    features, for a split on the last dim that gathers its input or whose parts are
    gathered further on; else ``None``."""
    if split.op != "call_function" or split.target not in _SPLITS or \
            any(u.target is not operator.getitem for u in split.users) or \
            _split_dim(split) != val(split.args[0]).dim() - 1:
        return None
    needed = (split.meta.get(INPUTS) or (None,))[0]
    if not (is_replicate(needed) or _falls_back_after(split)):
        return None
    readers = {u.args[1]: u for u in split.users}
    return [(readers.get(i), part.shape[-1]) for i, part in enumerate(val(split))]


def _head_parts(view: fx.Node, gm: fx.GraphModule):
    """``[(reader, features)]`` in the order of the features, for a view of the last dim
    as ``(..., heads, head_dim)`` whose readers each take a run of heads, by a slice, an
    index by a constant run or a split's part, all of them once, and gather it for want of
    a rule (Falcon-7B's multi-query ``q, k, v = qkv[..., :-2, :], qkv[..., [-2], :],
    qkv[..., [-1], :]``); else ``None``."""
    if view.op != "call_function" or view.target not in _VIEWS or \
            not isinstance(view.args[0], fx.Node) or not view.users:
        return None
    shape, before = val(view).shape, val(view.args[0]).shape
    if len(shape) < 2 or len(shape) != len(before) + 1 or \
            not isinstance(shape[-2], int) or shape[:-2] != before[:-1]:
        return None
    heads, dim = shape[-2], len(shape) - 2
    found = [_runs_of_heads(reader, dim, heads, gm) for reader in view.users]
    if any(f is None for f in found):
        return None
    runs = sorted((run for f in found for run in f), key=lambda run: run[0])
    if [a for (a, _), _ in runs] != [0] + [b for (_, b), _ in runs[:-1]] or \
            runs[-1][0][1] != heads or not any(FALLBACK in reader.meta for reader in view.users):
        return None
    return [(reader, (b - a) * shape[-1]) for (a, b), reader in runs]


def _runs_of_heads(reader: fx.Node, dim: int, heads: int, gm: fx.GraphModule):
    """``[((start, stop), node)]``: the runs of heads ``reader`` takes of its input's
    ``dim`` and the node reading each, itself (a slice, an index), or a split's parts
    (``getitem`` s, every part read: Falcon's ``qkv.split([heads, 1, 1], dim=-2)``); else
    ``None``."""
    if reader.target in _SPLITS and reader.target is not aten.chunk.default and \
            _split_dim(reader) == dim and \
            all(u.target is operator.getitem for u in reader.users):
        parts = {u.args[1]: u for u in reader.users}
        sizes = [part.shape[dim] for part in val(reader)]
        if len(parts) != len(reader.users) or sorted(parts) != list(range(len(sizes))):
            return None
        return [((sum(sizes[:i]), sum(sizes[:i + 1])), parts[i]) for i in range(len(sizes))]
    run = _run_of_heads(reader, dim, heads, gm)
    return None if run is None else [(run, reader)]


def _run_of_heads(reader: fx.Node, dim: int, heads: int, gm: fx.GraphModule):
    """``(start, stop)``: the heads ``reader`` takes of its input's ``dim``, where that is
    a run (a slice of step 1, or an index by a constant tensor of consecutive heads)."""
    if reader.target is aten.slice.Tensor:
        d, start, stop, step = (op_arg(reader, 1, "dim", 0), op_arg(reader, 2, "start"),
                                op_arg(reader, 3, "end"), op_arg(reader, 4, "step", 1))
        if d % (dim + 2) != dim or step != 1 or not all(
                isinstance(x, (int, type(None))) for x in (start, stop)):
            return None
        start, stop, _ = slice(start, stop).indices(heads)
        return (start, stop) if start < stop else None
    if reader.target is aten.index.Tensor:
        index = reader.args[1]
        if len(index) != dim + 1 or any(i is not None for i in index[:-1]):
            return None
        held = index[-1]
        if isinstance(held, fx.Node) and held.target is aten.lift_fresh_copy.default:
            held = held.args[0]
        if not isinstance(held, fx.Node) or held.op != "get_attr":
            return None
        value = attr(gm, held.target)
        if value.is_meta or value.dim() != 1 or value.is_floating_point():
            return None
        taken = [i % heads for i in value.tolist()]
        if taken and taken == list(range(taken[0], taken[0] + len(taken))):
            return taken[0], taken[-1] + 1
    return None


def _projection(fused: fx.Node, sizes: list, tied: set, world: int):
    """``(linear, markers)`` where ``fused`` is the output of a linear (:func:`_operands`)
    sharded on its features, read through module-output layout markers only, its weight
    and bias parameters read only there, and every part (``sizes``: features) has at least
    ``world`` features; else ``None``."""
    have = placement_of(fused)
    if not is_sharded(have) or have.dim != val(fused).dim() - 1 or min(sizes) < world:
        return None
    markers, node = [], fused
    while node.op == "call_function" and node.target is layout:
        if len(node.users) != 1:
            return None
        markers.append(node)
        node = node.args[0]
    operands = _operands(node)
    if operands is None or len(node.users) != 1:
        return None
    _, params, _ = operands
    if any(p.op != "get_attr" or len(p.users) != 1 or p in tied for p in params):
        return None
    return node, markers


def _operands(node: fx.Node):
    """``(x, [weight, bias?], between)`` of a linear: ``linear(x, w, b)``, or ``x @ w.T``
    with a 2-D ``w`` (Falcon's ``FalconLinear``; ``between``: the transpose); else
    ``None``."""
    if node.op != "call_function":
        return None
    if node.target is aten.linear.default:
        return node.args[0], [p for p in node.args[1:3] if p is not None], []
    w_t = node.args[1] if node.target is aten.matmul.default else None
    w = transposed_matrix(w_t)
    if w is not None and len(w_t.users) == 1 and val(w_t).dim() == 2:
        return node.args[0], [w], [w_t]
    return None


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


def _unfuse(graph: fx.Graph, reads: fx.Node, parts: list, linear: fx.Node, markers: list,
            world: int):
    """``linear(x, w, b)`` (or ``x @ w.T``) read by ``reads`` (a split, or a view of heads)
    in ``parts`` (``[(reader, features)]``) -> ``linear(x, w_i, b_i)`` per part, ``w_i``
    and ``b_i`` this part's rows of the whole parameters, each laid out sharded on its
    rows (whole where it is one head every query head reads); each reader then reads its
    part's, viewed as it read it."""
    sizes = [size for _, size in parts]
    x, params, between = _operands(linear)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    unsqueezed = reads.args[0] if _under_unsqueeze(reads.args[0]) is not reads.args[0] \
        else None
    split = [reader for reader, _ in parts if reader is not None and
             reader.target is operator.getitem and reader.args[0] is reads]
    by_heads = {reader for reader in split if _viewed_by_heads(reader)}
    whole = {i for i, (reader, _) in enumerate(parts)  # one head every rank's heads read
             if reader is not None and (
                 val(reader).shape[-2] == 1 if reader not in split else
                 by_heads and reader not in by_heads)}
    heads_split = {reader.args[0] for reader, _ in parts if reader is not None and
                   reader.target is operator.getitem and reader.args[0] is not reads}
    pieces = []
    why = (f"its fused parts ({', '.join(map(str, sizes))} features) cannot be sharded as "
           f"one weight at {world} ranks, so each is computed from its rows of the whole "
           f"weight (a projection per part would be held sharded)")
    with graph.inserting_before(linear):
        for param in params:
            hold_whole(param, why)
            cut = _node(graph, linear, aten.split_with_sizes.default, (param, sizes),
                        list(val(param).split(sizes)))
            rows = [_node(graph, linear, operator.getitem, (cut, i), v)
                    for i, v in enumerate(val(cut))]
            pieces.append([row if i in whole else
                           _sharded(graph, linear, row, f"part {i} of {param.target}", world)
                           for i, row in enumerate(rows)])
        fused = val(linear)
        linears = [_node(graph, linear, aten.linear.default, (x, *own),
                         fused.narrow(-1, offset, size).contiguous())
                   for own, offset, size in zip(zip(*pieces), offsets, sizes)]
    for (reader, _), part in zip(parts, linears):
        if reader is None:
            continue
        if unsqueezed is not None:  # the part, unsqueezed as the fused output was
            with graph.inserting_before(reader):
                part = _node(graph, reader, aten.unsqueeze.default,
                             (part, unsqueezed.args[1]), val(part).unsqueeze(unsqueezed.args[1]))
        if reader not in split:  # a run of heads: the part, viewed so
            shape = list(reads.args[1])
            shape[-2] = val(reader).shape[-2]
            with graph.inserting_before(reader):
                part = _node(graph, reader, aten.reshape.default, (part, shape),
                             val(part).view(val(reader).shape))
        reader.replace_all_uses_with(part)
        index = reader.args[1][-1] if reader.target is aten.index.Tensor else None
        graph.erase_node(reader)
        if isinstance(index, fx.Node) and not index.users:
            graph.erase_node(index)
    for node in [*heads_split, reads, *([unsqueezed] if unsqueezed is not None else []),
                 *markers, linear, *between]:
        graph.erase_node(node)


def _viewed_by_heads(part: fx.Node) -> bool:
    """Whether a view reads ``part`` with its last dim split (into heads)."""
    return any(u.target in _VIEWS and val(u).shape[-1] != val(part).shape[-1]
               for u in part.users)


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
