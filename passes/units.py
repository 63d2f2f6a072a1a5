"""Units pass: deal attention heads whole when their count does not divide by the world size.

A colwise projection shards its output features into equal chunks. When the features are
then viewed as ``(heads, head_dim)`` and the head count does not divide by the world size,
the chunks split heads, so propagation gathers the projection at the view. Two cases are
served without a gather by dealing whole heads, a :class:`~fxtp.passes.placement.UnitShard`
of the head count:

* more heads than ranks (6 heads at 4 ranks, any count at 3): ``torch.chunk``'s deal, 2,
  2, 2 and 0 heads; the projection's parameters are stored so.
* fewer heads than ranks, dividing the world size (2 KV heads at 4 ranks, as Megatron and
  vLLM run grouped-query attention; 1 in multi-query attention): each head is computed by
  the group of ranks whose query heads use it. Those parameters stay whole on every rank and each
  rank slices its
  head's rows before the projection, so it computes exactly that head; their gradients
  are partial (each rank's query heads' share) and join the replicated parameters'
  all-reduce. Attention then slices each rank's query heads' copies out of its head.

:func:`deal_sources` re-seeds, after a propagation, the parameters and colwise layouts
behind every such gathered view (walking back as :mod:`fxtp.passes.strided` does);
:func:`deal_consumers` then makes the rowwise layouts and weights that take the attention
output (``o_proj``'s input features) follow the same deal. Each returns whether anything
changed (propagation must then run again). Tied parameters are left as they are.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from .context import PassContext, relayout
from .dimspec import label_base
from .graph import (BOUNDARY, INPUTS, PLACEMENT, hold_whole, layout, placement_of,
                    tensor_inputs, tied_attrs, transposed_matrix, val)
from .placement import UnitShard, is_replicate
from .rules import rule_for
from .strided import carried_from_params

aten = torch.ops.aten


@relayout
def deal_sources(gm: fx.GraphModule, ctx: PassContext) -> bool:
    world = ctx.world
    tied = tied_attrs(gm)
    changed = False
    for node in list(gm.graph.nodes):
        want = _gathered_heads(node, world) or _single_head(node)
        if want is None:
            continue
        carriers: dict[fx.Node, int] = {}
        source, dim = _under_splitting_views(node.args[0], want.dim, want.units)
        if not carried_from_params(source, dim, carriers) or tied & set(carriers):
            continue
        for carrier, dim in carriers.items():
            placement = UnitShard(dim if want.units > 1 else 0, want.units)
            if carrier.op != "get_attr":
                if carrier.target is layout:
                    carrier.args = (carrier.args[0], placement)
            elif want.units < world:
                _slice_before_use(gm.graph, carrier, placement,
                                  f"its {want.units} heads are fewer than the {world} ranks: "
                                  f"each rank computes the head its query heads read, from "
                                  f"its rows of the whole weight")
            else:
                carrier.meta[PLACEMENT] = placement
        changed = True
    return changed


@relayout
def deal_consumers(gm: fx.GraphModule, ctx: PassContext) -> bool:
    world = ctx.world
    changed = False
    tied = tied_attrs(gm)
    for marker in list(gm.graph.nodes):
        if marker.target is not layout:
            continue
        arriving, wanted = placement_of(marker.args[0]), marker.args[1]
        if not (isinstance(arriving, UnitShard) and arriving.units >= world and
                isinstance(wanted, (Shard, UnitShard)) and wanted.dim == arriving.dim and
                wanted != arriving):
            continue
        weights = [_partner(user, marker, arriving.dim) for user in marker.users]
        if not weights or None in weights or tied & {w for w, _ in weights}:
            continue
        marker.args = (marker.args[0], arriving)
        for weight, dim in weights:
            weight.meta[PLACEMENT] = UnitShard(dim, arriving.units)
        changed = True
    return changed


def _gathered_heads(node: fx.Node, world: int):
    """``UnitShard(d, heads)`` for a view of an input sharded on dim ``d`` that propagation
    gathers because the dim's leading output dim (the head count) does not divide by the
    world size, when whole heads can be dealt; else ``None``."""
    found = _sharded_view(node)
    if found is None or not is_replicate(node.meta.get(INPUTS, (None,))[0]):
        return None
    have, out = found
    size, heads = val(node.args[0]).shape[have.dim], val(node).shape[out]
    if not isinstance(size, int) or not isinstance(heads, int) or heads == size or \
            heads % world == 0 or size % heads or (heads < world and world % heads):
        return None
    return UnitShard(have.dim, heads)


def _under_splitting_views(node: fx.Node, dim: int, units: int):
    """``(source, its dim)``: walking back from ``node``'s ``dim`` over views read once
    whose output dim ``dim`` is the leading factor of a sharded input dim (Falcon's
    ``qkv.view(b, t, -1, d)`` before its ``view(b, t, kv, -1, d)``). ``units`` of the output
    dim are then as many units of the input dim, index for index."""
    while node.op == "call_function" and len(node.users) == 1 and \
            (found := _sharded_view(node)) is not None and found[1] == dim:
        have, size = found[0], val(node).shape[dim]
        whole = val(node.args[0]).shape[have.dim]
        if not (isinstance(size, int) and isinstance(whole, int) and size % units == 0 and
                whole % size == 0):
            break
        node, dim = node.args[0], have.dim
    return node, dim


def _single_head(node: fx.Node):
    """``UnitShard(d, 1)`` for a view of an input sharded on dim ``d`` that only inserts a
    size-1 dim before it (``(B, T, head_dim) -> (B, T, 1, head_dim)``: the one KV head of
    multi-query attention); else ``None``."""
    found = _sharded_view(node)
    if found is None or not isinstance(found[0], Shard):
        return None
    have, out = found
    shape, out_shape = val(node.args[0]).shape, val(node).shape
    if len(out_shape) != len(shape) + 1 or out == 0 or out_shape[out - 1] != 1 or \
            out_shape[out] != shape[have.dim]:
        return None
    return UnitShard(have.dim, 1)


def _sharded_view(node: fx.Node):
    """``(placement, output dim)`` for a view whose input is sharded on a dim whose label
    lands on exactly one output dim; else ``None``."""
    rule = rule_for(node.target) if node.target in _VIEWS else None
    have = placement_of(node.args[0]) if rule is not None else None
    if not isinstance(have, (Shard, UnitShard)):
        return None
    spec = rule.spec(node)
    label = label_base(spec.inputs[0][have.dim])
    outs = [d for d, lab in enumerate(spec.outputs[0]) if label_base(lab) == label]
    return (have, outs[0]) if len(outs) == 1 else None


_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
          aten.unflatten.int}


def _slice_before_use(graph: fx.Graph, param: fx.Node, placement, why: str) -> None:
    """Keep ``param`` whole (``HELD_WHOLE``: ``why``, where it was sharded) and feed its
    users this rank's ``placement`` rows of it, sliced in the module reading it (so its
    gradient is synchronized with that block's)."""
    hold_whole(param, why)
    reader = next(iter(param.users), param)
    with graph.inserting_after(param):
        marker = graph.call_function(layout, (param, placement))
    marker.meta.update(val=val(param), nn_module_stack=dict(reader.meta.get("nn_module_stack", {})))
    marker.meta[BOUNDARY] = f"the heads of {param.target}"
    param.replace_all_uses_with(marker, delete_user_cb=lambda u: u is not marker)


def _partner(user: fx.Node, marker: fx.Node, dim: int):
    """``(weight get_attr, its dim)`` carrying, in ``user``'s rule, the label of
    ``marker``'s ``dim`` (a rowwise linear's input features), when it is a parameter
    read only there, as it is or transposed; else ``None``."""
    rule = rule_for(user.target) if user.op == "call_function" else None
    if rule is None:
        return None
    inputs = tensor_inputs(user)
    spec = rule.spec(user)
    label = label_base(spec.inputs[inputs.index(marker)][dim])
    for arg, labels in zip(inputs, spec.inputs):
        if arg is marker or labels is None:
            continue
        dims = [d for d, lab in enumerate(labels) if label_base(lab) == label]
        if dims:
            dim, w = dims[0], transposed_matrix(arg)
            if w is not None and val(arg).dim() == 2 and len(arg.users) == 1:
                arg, dim = w, 1 - dim  # x @ w.T (Falcon's FalconLinear)
            if arg.op != "get_attr" or len(arg.users) != 1:
                return None
            return arg, dim
    return None
