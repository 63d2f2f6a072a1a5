"""Attention: ``scaled_dot_product_attention`` and the fused kernels it dispatches to
(grouped KV heads included), and flex attention."""
from __future__ import annotations

import copy
import operator

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from ..dimspec import DimSpec, fixed_label
from ..graph import output_vals, tensor_inputs, val
from ..placement import R, UnitShard, is_whole
from .base import Rule, broadcast_labels, is_one, same_size

aten = torch.ops.aten


def _sdpa_spec(node):
    """Batch and head dims shard; query/key length and head dim do not (GQA: key/value may
    have fewer heads; they shard on the same head label; one key/value head broadcast to
    every query head, as in multi-query attention, stays whole). Serves
    ``scaled_dot_product_attention`` and the fused kernels it dispatches to (CPU flash,
    flash, efficient, cuDNN, math): tensor inputs after q, k, v are masks or biases
    broadcast to (..., s, t); outputs are the attention output, the log-sum-exp (..., s),
    attention weights (..., s, t), and bookkeeping values (RNG state, sequence lengths)
    that stay replicated."""
    q, k, v, *masks = (val(a) for a in tensor_inputs(node))
    n = q.dim()
    batch = [f"d{j}" for j in range(n - 2)]
    specs = [tuple(batch + ["s!", "e!"]), broadcast_labels(k.shape, batch + ["t!", "e!"]),
             broadcast_labels(v.shape, batch + ["t!", "f!"])]
    for mask in masks:
        specs.append(broadcast_labels(mask.shape, batch + ["s!", "t!"]))
    out, *extra = output_vals(node)
    outs = [tuple(batch + ["s!", "f!"])]
    for x in extra:  # log-sum-exp (..., s), attention weights (..., s, t), bookkeeping
        if not isinstance(x, torch.Tensor):
            outs.append(None)
        elif x.dim() in (n - 1, n) and \
                all(same_size(a, b) for a, b in zip(x.shape, out.shape[:-2])):
            outs.append(tuple(batch + ["s!", "t!"][: x.dim() - len(batch)]))
        else:
            outs.append(tuple(fixed_label() for _ in x.shape))
    return DimSpec(tuple(specs), tuple(outs))


def _grouped_kv_heads(node, world, actual=()):
    """Grouped-query attention (``enable_gqa``) whose key and value heads arrive dealt to
    groups of ranks (``UnitShard(d, kv)`` with fewer heads than ranks, one whole head in
    multi-query attention: as the units pass deals their projections), beside query heads
    sharded: each rank's query heads all read the KV head its group holds, so each rank
    attends with its own heads. A mask shards with the query heads where it has a dim of
    them, else stays whole."""
    if not node.kwargs.get("enable_gqa", False) or len(actual) < 3:
        return
    q, k, v, *masks = (val(a) for a in tensor_inputs(node))
    heads = q.dim() - 3
    if heads < 0:
        return
    h, kv = q.shape[heads], k.shape[heads]
    dealt = [a for a in actual[1:3] if a == UnitShard(heads, kv) or is_whole(a) and kv == 1]
    if len(dealt) != 2 or not isinstance(h, int) or kv >= world or world % kv or h % world \
            or h % kv:
        return
    placed = []
    for mask in masks:
        d = mask.dim() - (q.dim() - heads)  # the mask dim aligned with the heads, if any
        size = mask.shape[d] if d >= 0 else 1
        if size not in (1, h):
            return
        placed.append(Shard(d) if size == h and h > 1 else R)
    yield (Shard(heads), *dealt, *placed), (Shard(heads),)


def _flex_spec(node):
    """``flex_attention(q, k, v, score_mod, block_mask, scale, options, score_buffers,
    mask_buffers)``: batch and head dims shard, as for SDPA; the block mask's tensors
    (batch, heads or 1, blocks...) shard with them where their size matches; buffers the
    score and mask functions read stay replicated. Outputs: the attention output and the
    per-row log-sum-exp and max (batch, heads, s)."""
    q = val(node.args[0])
    b, h = q.shape[0], q.shape[1]
    buffers = {a for group in node.args[7:9] for a in (group or ())}
    specs = [("b", "h", "s!", "e!"), ("b", "h", "t!", "e!"), ("b", "h", "t!", "f!")]
    for a in tensor_inputs(node)[3:]:
        x = val(a)
        if x.dim() < 2 or a in buffers:
            specs.append(tuple(fixed_label() for _ in x.shape))
            continue
        specs.append(("b" if same_size(x.shape[0], b) and not is_one(b) else fixed_label(),
                      "h" if same_size(x.shape[1], h) and not is_one(h) else fixed_label()) +
                     tuple(fixed_label() for _ in x.shape[2:]))
    outs = [("b", "h", "s!", "f!")] + [("b", "h", "s!")[:x.dim()] if isinstance(x, torch.Tensor)
                                       else None for x in output_vals(node)[1:]]
    return DimSpec(tuple(specs), tuple(outs))


def _flex_global_heads(node, inputs, output, group):
    """Head-sharded flex attention: the score and mask functions see global head indices
    (this rank's first head is ``rank * heads / world``), as on a single device. Each
    shifted function is a new submodule; the traced ones are left as they are."""
    if not (isinstance(inputs[0], Shard) and inputs[0].dim == 1):
        return node.target, node.args, node.kwargs
    offset = group.rank * (val(node.args[0]).shape[1] // group.world)
    if offset == 0:
        return node.target, node.args, node.kwargs
    args = list(node.args)
    block_mask = list(args[4])
    args[3] = _heads_shifted(node, args[3], 2, offset)
    block_mask[-1] = _heads_shifted(node, block_mask[-1], 1, offset)
    args[4] = tuple(block_mask)
    return node.target, tuple(args), node.kwargs


def _heads_shifted(node: fx.Node, function, index: int, offset: int):
    """A ``get_attr`` of a copy of the traced ``function`` whose head index (placeholder
    ``index``) is shifted by ``offset``."""
    if not (isinstance(function, fx.Node) and function.op == "get_attr"):
        return function
    gm = node.graph.owning_module
    name = f"{function.target}_heads_from_{offset}"
    if not hasattr(gm, name):
        original = getattr(gm, function.target)
        shifted = fx.GraphModule(original, copy.deepcopy(original.graph))
        head = [n for n in shifted.graph.nodes if n.op == "placeholder"][index]
        with shifted.graph.inserting_after(head):
            global_head = shifted.graph.call_function(operator.add, (head, offset))
        head.replace_all_uses_with(global_head, delete_user_cb=lambda u: u is not global_head)
        shifted.recompile()
        gm.add_submodule(name, shifted)
    with node.graph.inserting_before(node):
        attr = node.graph.get_attr(name)
    attr.meta.update(function.meta)
    return attr


RULES: dict = {
    aten.scaled_dot_product_attention.default: Rule(_sdpa_spec, extra=_grouped_kv_heads),
    aten._scaled_dot_product_flash_attention_for_cpu.default: Rule(_sdpa_spec),
    aten._scaled_dot_product_flash_attention.default: Rule(_sdpa_spec),
    aten._scaled_dot_product_efficient_attention.default: Rule(_sdpa_spec),
    aten._scaled_dot_product_cudnn_attention.default: Rule(_sdpa_spec),
    aten._scaled_dot_product_attention_math.default: Rule(_sdpa_spec),
    torch.ops.higher_order.flex_attention: Rule(_flex_spec, local_op=_flex_global_heads,
                                                strided=False, units=False),
}
