"""Normalizations: layer and RMS norms, group norm and batch norm."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from ...kernels.sharded_norm import layer_norm_of_shards
from ..dimspec import DimSpec, fixed_label
from ..graph import op_arg, output_vals, tensor_inputs, val
from ..placement import UnitShard, is_blocked, is_grouped, is_sharded, local_range
from .base import Rule, communicating, local_groups, ndim_of

aten = torch.ops.aten


def layer_norm_rule_parts():
    """``(extra, local_op)`` of ``layer_norm``'s :class:`~fxtp.passes.rules.Rule`: ``x``
    arriving sharded on a normalized dim, evenly or in units, with ``weight`` and ``bias``
    sharded alike on their matching dim, gives an output sharded as ``x``."""
    def normalized(node):
        n, k = val(node.args[0]).dim(), len(node.args[1])
        return n, k

    def extra(node: fx.Node, world: int, actual=()):
        n, k = normalized(node)
        shape = val(node.args[0]).shape
        if not all(isinstance(shape[d], int) for d in range(n - k, n)):
            return  # the ranks' counts of a row's elements are numbers
        offered = [Shard(d) for d in range(n - k, n) if shape[d] % world == 0]
        arrived = actual[0] if actual else None
        if isinstance(arrived, UnitShard) and arrived.dim >= n - k and \
                not is_grouped(arrived, world):
            offered.append(arrived)
        for p in offered:
            params = Shard(p.dim - (n - k)) if type(p) is Shard else \
                UnitShard(p.dim - (n - k), p.units)
            yield (p,) + (params,) * (len(tensor_inputs(node)) - 1), (p,)

    def local_op(node: fx.Node, inputs, output, group):
        n, k = normalized(node)
        p = inputs[0]
        if not (is_sharded(p) and not is_blocked(p) and p.dim >= n - k):
            return node.target, node.args, node.kwargs
        shape = val(node.args[0]).shape
        rows = math.prod(shape[d] for d in range(n - k, n)) // shape[p.dim]
        counts = tuple(rows * local_range(p, shape[p.dim], r, group.world)[1]
                       for r in range(group.world))
        return layer_norm_of_shards, (node.args[0], k, op_arg(node, 2, "weight"),
                                      op_arg(node, 3, "bias"), op_arg(node, 4, "eps", 1e-5),
                                      counts, group.name), {}

    return extra, local_op


def _norm_spec(node):
    """``layer_norm`` / ``rms_norm`` (and ``native_layer_norm``'s mean and rstd, shaped
    (batch..., 1...)): normalized trailing dims never shard, batch dims do."""
    k = len(node.args[1])
    n = ndim_of(node.args[0])
    x = tuple(f"d{j}!" if j >= n - k else f"d{j}" for j in range(n))
    params = tuple(x[n - k:] for _ in tensor_inputs(node)[1:])
    outs = [x]
    for v in output_vals(node)[1:]:
        outs.append(x[:n - k] + tuple(fixed_label() for _ in range(v.dim() - (n - k))))
    return DimSpec((x,) + params, tuple(outs))


def _group_norm_spec(node):
    """``group_norm(x (N, C, *), groups, weight, bias)``: the batch dim shards; channels by
    :func:`_whole_groups`."""
    n = ndim_of(node.args[0])
    x = ("n",) + tuple(fixed_label() for _ in range(n - 1))
    params = tuple((x[1],) for _ in tensor_inputs(node)[1:])
    return DimSpec((x,) + params, (x,))


def _whole_groups(node: fx.Node, world: int, actual=()):
    """``group_norm`` on channel shards holding whole groups (the groups divide by the
    world size: RWKV's and RetNet's norm over heads, read on head shards), weight and bias
    sharded alike: each rank normalizes its own groups."""
    channels, groups = val(node.args[0]).shape[1], node.args[1]
    if isinstance(channels, int) and groups % world == 0:
        yield (Shard(1),) + (Shard(0),) * (len(tensor_inputs(node)) - 1), (Shard(1),)


def _batch_norm_spec(training_arg: Optional[int]):
    """``batch_norm`` / ``native_batch_norm(x (N, C, *), weight, bias, running_mean,
    running_var, training, ...)`` and the eval form: channels are independent, so the
    channel dim shards with every per-channel tensor (the running statistics it updates
    included) and the saved per-channel statistics; the batch and spatial dims, which
    statistics are taken over in training, never shard then (in eval, given
    ``training_arg`` None, they shard freely)."""
    def spec(node):
        n = ndim_of(node.args[0])
        training = training_arg is not None and op_arg(node, training_arg, "training", True)
        x = tuple("c" if j == 1 else f"d{j}!" if training else f"d{j}" for j in range(n))
        params = tuple(("c",) for _ in tensor_inputs(node)[1:])
        outs = [x] + [("c",) if getattr(v, "shape", None) == val(node.args[0]).shape[1:2]
                      else tuple(fixed_label() for _ in range(v.dim()))
                      if isinstance(v, torch.Tensor) else None
                      for v in output_vals(node)[1:]]
        return DimSpec((x,) + params, tuple(outs))
    return Rule(spec)


RULES: dict = {
    # normalizations
    aten.layer_norm.default: Rule(_norm_spec, **communicating(layer_norm_rule_parts())),
    aten.rms_norm.default: Rule(_norm_spec),
    aten.native_layer_norm.default: Rule(_norm_spec),
    aten._fused_rms_norm.default: Rule(_norm_spec),
    aten.group_norm.default: Rule(_group_norm_spec, extra=_whole_groups, local_op=local_groups(1),
                                  strided=False, units=False),
    aten.batch_norm.default: _batch_norm_spec(training_arg=5),
    aten.native_batch_norm.default: _batch_norm_spec(training_arg=5),
    aten._native_batch_norm_legit_no_training.default: _batch_norm_spec(training_arg=None),
}
