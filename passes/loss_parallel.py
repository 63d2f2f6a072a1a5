"""The sharding rules of ``aten.cross_entropy_loss`` and ``aten.nll_loss_nd``: by tokens,
or loss parallel by classes.

Its dim spec shards the token dims (batch and spatial dims ``d1, ...``): per-token losses
stay sharded with ``reduction="none"``, their sum is ``Partial`` with ``"sum"``; ``"mean"``
divides by a count over all tokens and keeps them whole. The class dim never shards in the
spec: class-sharded logits are served by an extra strategy whose local op is
:func:`fxtp.edges.loss.loss_parallel_cross_entropy` (3 all-reduces of per-token values, none
backward), so propagation picks it over gathering the logits whenever they arrive sharded.
With ``"mean"``, tokens sharded by rows (the batch dim) are served by another extra
strategy: each rank's sum and kept weight, summed by one all-reduce
(:func:`~fxtp.kernels.cross_entropy.mean_of_token_shards`), so a head whose logits arrive
split by tokens needs no gather for its loss.
``nll_loss`` on class-sharded log-probabilities (a ``log_softmax`` written before it, which
:mod:`~fxtp.kernels.sharded_softmax` keeps sharded) takes each token's term on the rank
holding its target: a ``Partial`` loss, summed by one all-reduce where it is read
(:func:`~fxtp.kernels.local_ops.nll_loss_of_shard`).
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from ..kernels.cross_entropy import REDUCTIONS, loss_parallel_cross_entropy, mean_of_token_shards
from ..kernels.local_ops import nll_loss_of_shard
from .dimspec import DimSpec
from .graph import op_arg
from .placement import P, UnitShard, dealt_shard, is_sharded, local_range

_ARGS = (("weight", None), ("reduction", 1), ("ignore_index", -100), ("label_smoothing", 0.0))


def _options(node: fx.Node) -> dict:
    """weight, reduction (aten's enum), ignore_index, label_smoothing of the node."""
    return {name: op_arg(node, i, name, default)
            for i, (name, default) in enumerate(_ARGS, start=2)}


def _logits_and_target(node: fx.Node):
    return node.args[0].meta["val"], node.args[1].meta["val"]


def _class_dim(logits) -> int:
    return 1 if logits.dim() >= 2 else 0


def cross_entropy_spec(node: fx.Node) -> DimSpec:
    logits, target = _logits_and_target(node)
    options = _options(node)
    mark = {0: "", 1: "!", 2: "+"}[options["reduction"]]
    c = _class_dim(logits)
    labels = tuple("c!" if j == c else f"d{j}{mark}" for j in range(logits.dim()))
    tokens = labels[:c] + labels[c + 1:]
    inputs = (labels, labels if target.is_floating_point() else tokens)
    if options["weight"] is not None:
        inputs += (("c!",),)
    return DimSpec(inputs, (tokens if options["reduction"] == 0 else (),))


def class_sharded(node: fx.Node, world: int, actual=()):
    """Logits (and probability targets) sharded over classes -> replicated loss
    (``nll_loss``: partial); classes that do not divide by the world size are dealt as
    ``torch.chunk`` deals them."""
    logits, target = _logits_and_target(node)
    c = _class_dim(logits)
    classes = logits.shape[c]
    if not isinstance(classes, int) or -(-classes // world) * (world - 1) >= classes:
        return  # symbolic, or some rank would hold no class
    shard = dealt_shard(c, classes, world)
    inputs = (shard, shard if target.is_floating_point() else Replicate())
    if _options(node)["weight"] is not None:
        inputs += (Replicate(),)
    yield inputs, (P if node.target is torch.ops.aten.nll_loss_nd.default else Replicate(),)


def token_sharded(node: fx.Node, world: int, actual=()):
    """The mean of logits split by rows (and targets split alike) -> replicated loss: as
    they arrive (strided, uneven), or in ``world`` equal row shards."""
    logits, _ = _logits_and_target(node)
    options = _options(node)
    if options["reduction"] != 1 or logits.dim() < 2:
        return
    rows = actual[0] if actual and _row_shard(actual[0]) else Shard(0)
    if rows == Shard(0) and not (isinstance(logits.shape[0], int) and
                                 logits.shape[0] % world == 0):
        return
    inputs = (rows, rows)
    if options["weight"] is not None:
        inputs += (Replicate(),)
    yield inputs, (Replicate(),)


def cross_entropy_strategies(node: fx.Node, world: int, actual=()):
    """:func:`class_sharded` and :func:`token_sharded`."""
    yield from class_sharded(node, world, actual)
    yield from token_sharded(node, world, actual)


def _row_shard(p) -> bool:
    return is_sharded(p) and p.dim == 0


def _class_shard(node: fx.Node, inputs) -> bool:
    logits = node.args[0].meta["val"]
    c = _class_dim(logits)
    return inputs[0] in (Shard(c), UnitShard(c, logits.shape[c]))


def nll_on_classes(node: fx.Node, inputs, output, group):
    """Class-sharded log-probabilities run :func:`~fxtp.kernels.local_ops.nll_loss_of_shard`
    from this rank's first class; otherwise the op itself."""
    if not _class_shard(node, inputs):
        return node.target, node.args, node.kwargs
    o, logits = _options(node), node.args[0].meta["val"]
    offset = local_range(inputs[0], logits.shape[_class_dim(logits)], group.rank,
                         group.world)[0]
    return nll_loss_of_shard, (node.args[0], node.args[1], o["weight"], o["reduction"],
                               o["ignore_index"], offset), {}


def loss_parallel(node: fx.Node, inputs, output, group):
    """Class-sharded logits run :func:`~fxtp.edges.loss.loss_parallel_cross_entropy`; the mean of
    tokens sharded by rows :func:`~fxtp.kernels.cross_entropy.mean_of_token_shards`; other
    token shards and replicated logits run the op itself."""
    logits = node.args[0]
    c = _class_dim(logits.meta["val"])
    o = _options(node)
    if o["reduction"] == 1 and _row_shard(inputs[0]):
        return mean_of_token_shards, (logits, node.args[1], o["weight"], o["ignore_index"],
                                      o["label_smoothing"], group.name), {}
    if not _class_shard(node, inputs):
        return node.target, node.args, node.kwargs
    classes = logits.meta["val"].shape[c]
    uneven = {} if classes % group.world == 0 else dict(
        classes=(local_range(inputs[0], classes, group.rank, group.world)[0], classes))
    return loss_parallel_cross_entropy, (
        logits, node.args[1], o["weight"], REDUCTIONS[o["reduction"]], o["ignore_index"],
        o["label_smoothing"], c, group.rank, group.world, group.name), uneven
