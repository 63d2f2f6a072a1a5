"""Indexing and scatter: ``index``, ``index_put``, ``index_select``, the ``index_*``
updates, ``gather`` / ``scatter``, ``select`` and ``embedding``."""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from ..dimspec import DimSpec, fixed_label, parse
from ..effects import written_through
from ..graph import is_tensor_node, op_arg, tensor_inputs, val
from ...kernels.local_ops import (gather_of_shard, index_select_of_shard, select_of_shard,
                                  vocab_parallel_embedding)
from ..placement import P, R, UnitShard, is_blocked, shardings_over
from .base import (Rule, broadcast_labels, dim_labels, fixed_dim_spec, input_ndims, ndim_of,
                   same_size, shard_start)

aten = torch.ops.aten


def _embedding_spec(node):
    """A vocab-sharded table gives Partial rows (see :func:`_vocab_parallel`)."""
    return parse("v+ d, ... -> ... d", input_ndims(node), partial="product", partial_args=(0,))


def _vocab_parallel(node, inputs, output, group):
    if not (isinstance(inputs[0], (Shard, UnitShard)) and inputs[0].dim == 0):
        return node.target, node.args, node.kwargs
    weight, indices = node.args[:2]
    offset = shard_start(inputs[0], val(weight), group)
    return vocab_parallel_embedding, (weight, indices, offset,
                                      op_arg(node, 2, "padding_idx", -1)), {}


def _index_layout(self_labels, indices):
    """Labels of ``self[indices]`` (advanced indexing; ``indices`` has ``None`` for dims
    taken whole): the index tensors' broadcast dims (never sharded) replace the indexed
    dims, in place when those are adjacent, else in front."""
    pos = [i for i, ix in enumerate(indices) if ix is not None]
    index_rank = max(ndim_of(ix) for ix in indices if ix is not None)
    index_dims = tuple(fixed_label() for _ in range(index_rank))
    kept = [lab for i, lab in enumerate(self_labels) if i not in pos]
    if pos == list(range(pos[0], pos[-1] + 1)):
        return tuple(kept[:pos[0]]) + index_dims + tuple(kept[pos[0]:])
    return index_dims + tuple(kept)


def _index_spec(node):
    """``x[indices]`` (``aten.index.Tensor``): dims not indexed shard; linear in ``x``."""
    n = ndim_of(node.args[0])
    indices = list(node.args[1])
    if any(ix is not None and val(ix).dtype == torch.bool for ix in indices):
        labels = tuple(fixed_label() for _ in range(n))
        return DimSpec((labels,) + tuple(_fixed(ix) for ix in indices if ix is not None),
                       (tuple(fixed_label() for _ in range(ndim_of(node))),))
    labels = dim_labels(n)
    out = _index_layout(labels, indices)
    return DimSpec((labels,) + tuple(_fixed(ix) for ix in indices if ix is not None), (out,),
                   "product", (0,))


def _fixed(node) -> tuple:
    return tuple(fixed_label() for _ in range(ndim_of(node)))


def _index_put_spec(node):
    """``x[indices] = values`` (``index_put`` / ``index_put_``): dims not indexed shard
    with the matching dims of ``values`` (broadcast size-1 dims fixed). Jointly linear in
    ``x`` and ``values``. Indexed dims of ``x`` never shard (the indices are global), but
    for one boolean mask over ``x``'s leading dims and a single value (``h[h > t] = t``):
    a masked fill, sharded as ``x`` is with the mask alike."""
    n = ndim_of(node.args[0])
    indices = list(node.args[1])
    values = val(node.args[2])
    if len(indices) == 1 and indices[0] is not None and val(indices[0]).dtype == torch.bool \
            and values.numel() == 1:  # x[mask] = v: a masked fill, elementwise
        labels = dim_labels(n)
        return DimSpec((labels, labels[:ndim_of(indices[0])], (fixed_label(),) * values.dim()),
                       (labels,), "sum", (0, 2))
    labels = tuple(fixed_label() if j < len(indices) and indices[j] is not None else f"d{j}"
                   for j in range(n))
    if any(ix is not None and val(ix).dtype == torch.bool for ix in indices):
        labels = tuple(fixed_label() for _ in range(n))
        target = labels
    else:
        target = _index_layout(labels, indices)
    values_labels = broadcast_labels(values.shape, list(target))
    ins = (labels,) + tuple(_fixed(ix) for ix in indices if ix is not None) + (values_labels,)
    return DimSpec(ins, (labels,), "sum", (0, len(ins) - 1))


def _index_select_spec(node):
    """``index_select(x, dim, index)``: ``dim`` never shards; linear in ``x``."""
    n = ndim_of(node.args[0])
    d = node.args[1] % n if n else 0
    labels = tuple(f"d{j}!" if j == d else f"d{j}" for j in range(n))
    return DimSpec((labels, _fixed(node.args[2])), (labels,), "product", (0,))


def _index_update_spec(partial: str):
    """``index_copy / index_add / index_fill(x, dim, index, [source])``: ``dim`` never
    shards; the other dims shard with the source's. ``partial="sum"``: jointly linear in
    ``x`` and the source."""
    def spec(node):
        n = ndim_of(node.args[0])
        d = node.args[1] % n if n else 0
        labels = tuple(f"d{j}!" if j == d else f"d{j}" for j in range(n))
        ins = [labels, _fixed(node.args[2])]
        ins += [labels if ndim_of(t) == n else _fixed(t) for t in tensor_inputs(node)[2:]]
        return DimSpec(tuple(ins), (labels,), partial, (0, 2) if partial == "sum" else None)
    return Rule(spec)


def _gather_scatter_spec(linear: str, source: bool):
    """``gather(x, dim, index)`` / ``scatter*(x, dim, index, src)``: ``dim`` never shards;
    another dim shards where ``x``, ``index`` (and ``src``) have the same size on it (the
    index addresses the leading part of a dim it is shorter on: ``x`` must stay whole)."""
    def spec(node):
        x = val(node.args[0])
        index = val(node.args[2])
        n = x.dim()
        d = node.args[1] % n if n else 0
        shapes = [x.shape, index.shape]
        if source and is_tensor_node(node.args[3]):
            shapes.append(val(node.args[3]).shape)
        shard = {j for j in range(n) if j != d and all(same_size(s[j], x.shape[j]) for s in shapes)}
        ins = [tuple(f"d{j}" if j in shard else fixed_label() for j in range(n))
               for _ in shapes]
        x_labels = ins[0]
        out = ins[1] if node.target is aten.gather.default else x_labels
        args = {"product": (0,), "sum": (0, 2)}.get(linear)
        return DimSpec(tuple(ins), (out,), linear, args)
    return Rule(spec)


def _picked_from_shards(node: fx.Node, world: int, actual=()):
    """``gather``, ``select`` (a static index) or ``index_select`` along a dim ``x``
    arrives sharded on, the index whole: each rank picks the elements it holds, a
    ``Partial`` result (per-token log-probabilities of the targets from vocab-sharded
    logits, as RL and preference-tuning code computes them; the first token of a
    sequence-sharded output, as BERT's pooler reads it)."""
    x = val(node.args[0])
    d = node.args[1] % x.dim() if x.dim() else 0
    if not x.dim() or not isinstance(x.shape[d], int) or \
            node.target is aten.select.int and not isinstance(node.args[2], int):
        return  # each rank's offset into the dim, and the index, are numbers
    if written_through(node):  # select's view: zeros on the other ranks alias nothing,
        return                  # and a partial sum written into it would land as it is
    rest = (R,) * (len(tensor_inputs(node)) - 1)
    for p in shardings_over({d}, x.shape, world, actual[0] if actual else None):
        if not is_blocked(p):  # one offset per rank
            yield (p, *rest), (P,)


def _pick_of_shard(node, inputs, output, group):
    x = node.args[0]
    d = node.args[1] % val(x).dim() if val(x).dim() else 0
    if not (isinstance(inputs[0], (Shard, UnitShard)) and not is_blocked(inputs[0]) and
            inputs[0].dim == d):
        return node.target, node.args, node.kwargs
    start = shard_start(inputs[0], val(x), group)
    if node.target is aten.select.int:
        return select_of_shard, (x, d, node.args[2] % val(x).shape[d], start), {}
    pick = gather_of_shard if node.target is aten.gather.default else index_select_of_shard
    return pick, (x, d, node.args[2], start), {}


RULES: dict = {
    # indexing and scatter
    aten.index.Tensor: Rule(_index_spec),
    aten.index_put.default: Rule(_index_put_spec),
    aten.index_put_.default: Rule(_index_put_spec),
    aten.index_select.default: Rule(_index_select_spec, extra=_picked_from_shards,
                                    local_op=_pick_of_shard),
    aten.index_copy.default: _index_update_spec("sum"),
    aten.index_copy_.default: _index_update_spec("sum"),
    aten.index_add.default: _index_update_spec("sum"),
    aten.index_add_.default: _index_update_spec("sum"),
    aten.index_fill.int_Scalar: _index_update_spec("none"),
    aten.index_fill_.int_Scalar: _index_update_spec("none"),
    aten.gather.default: replace(_gather_scatter_spec("product", source=False),
                                 extra=_picked_from_shards, local_op=_pick_of_shard),
    aten.scatter.src: _gather_scatter_spec("sum", source=True),
    aten.scatter_.src: _gather_scatter_spec("sum", source=True),
    aten.scatter.value: _gather_scatter_spec("none", source=False),
    aten.scatter_.value: _gather_scatter_spec("none", source=False),
    aten.scatter_add.default: _gather_scatter_spec("sum", source=True),
    aten.scatter_add_.default: _gather_scatter_spec("sum", source=True),
    aten.select.int: replace(fixed_dim_spec(1, drop=True), extra=_picked_from_shards,
                             local_op=_pick_of_shard),
    aten.embedding.default: Rule(_embedding_spec, local_op=_vocab_parallel, strided=False),
}
