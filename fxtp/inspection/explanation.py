"""``fxtp.explain(gm)``: what fxtp did to a model, node by node, and what it costs per step.

Reads what the passes leave in ``node.meta`` of the ``GraphModule`` that
:func:`fxtp.parallelize` returned: placements, the collective each rewrite node issues,
fallbacks, and ``val`` (the global shape; the local shape is this rank's chunk of it).

Forward collectives are graph nodes. Backward collectives are not: each is the conjugate
of a forward one (the table in :mod:`fxtp.kernels.collectives`), issued when gradients flow
through it, i.e. when its input depends on a trainable parameter (or, with
``input_grads=True``, on a floating root input) through differentiable ops:

==================  ========================  =======================================
forward             forward bytes per rank    backward
==================  ========================  =======================================
all_reduce          the partial tensor        none
reduce_scatter      the partial tensor        all-gather of the output's shard
all_gather          this rank's shard         chunk (none), or a reduce-scatter of the
                                              full gradient when it is partial
shard               none                      all-gather of the output's shard
grad_sync           none                      all-reduce of the full gradient
grad_sync_bucket    none                      one all-reduce per dtype, of the summed
                                              parameter sizes
loss_parallel       3 per-token all-reduces   none
sharded_norm        the norm's powers summed  none
                    (its output's bytes)
==================  ========================  =======================================

Bytes per rank are those of the local tensor a rank hands to the collective, as
:func:`fxtp.count_collectives` counts them; blocked (``blocks``) collectives move
the bytes of contiguous ones. Symbolic dims count with their size hints (the example
inputs' sizes), listed in ``summary.symbolic_dims``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from ..kernels.torch_compat import OperatorBase
from ..passes.gradients import gradient_carriers
from ..passes.graph import (COLLECTIVE, FALLBACK, PLACEMENT, READS, attr, call_args,
                            list_block, module_fqn, val)
from ..passes.modules import inline_program
from ..passes.placement import (UnitShard, blocks, describe, is_sharded, local_range,
                                size_hint)
from ..passes.program_cost import conjugates

from ..edges.local_reads import LEAVES
from ..frontend.names import model_fqn
from ..kernels.cross_entropy import forward_all_reduce_bytes, loss_parallel_cross_entropy
from ..kernels.sharded_norm import layer_norm_bytes, layer_norm_of_shards, norm_of_shards
from ..kernels.sharded_softmax import (any_of_shards, arg_of_shards, collective_bytes,
                                       cumsum_of_shards, extremum_of_shards, logsumexp_of_shards,
                                       pick_of_shards, softmax_of_shards, topk_of_shards)
from .report import Comm, Fallback, HeldWhole, Layer, NodeInfo, Report, Summary, Totals


def explain(gm: fx.GraphModule, *, input_grads: bool = False) -> Report:
    """The report of ``gm`` (from :func:`fxtp.parallelize`) on its rank: print it for a
    table, ``.to_json()`` for ``report.json``. ``input_grads``: whether the root inputs
    require gradients (backward collectives that only they would cause are counted)."""
    info = getattr(gm, "fxtp", None)
    if info is None:
        raise TypeError("fxtp.explain takes the GraphModule fxtp.parallelize returned "
                        f"(it has a .fxtp attribute); got {type(gm).__name__}")
    rank, world = info.rank, info.world_size
    graph = inline_program(gm)  # the whole program: modules and checkpointed regions inlined
    grads = _carry_grad(gm, graph, input_grads)
    hints: dict[str, int] = {}
    rows = [n for n in graph.nodes  # a parameter read stands for its parameter: not its table
            if not (n.op == "get_attr" and n.target.rpartition(".")[2] == LEAVES)]
    nodes = [node_info(n, rank, world, hints, grads) for n in rows]
    params = _param_bytes(gm, info.param_shapes)
    forward, backward, layers = _rollup(nodes, params)
    fallbacks = [Fallback(n.name, row.op, row.module, n.meta[FALLBACK])
                 for n, row in zip(rows, nodes) if n.meta.get(FALLBACK)]
    held_whole = [HeldWhole(fqn, full - -(-full // world), info.held_whole[fqn])
                  for fqn, (_, full) in params.items() if fqn in info.held_whole]
    summary = Summary(world, forward, backward, forward.total_bytes() + backward.total_bytes(),
                      sum(p[0] for p in params.values()), sum(p[1] for p in params.values()),
                      layers, fallbacks, held_whole, hints)
    return Report(summary, nodes)


def _rollup(nodes: list[NodeInfo], params: dict) -> tuple[Totals, Totals, list[Layer]]:
    """Collectives forward and backward in all, and per layer with parameter memory;
    layers in the model's parameter order, then the graph's."""
    layers: dict[str, Layer] = {}

    def layer(module: str) -> Layer:
        return layers.setdefault(layer_of(module), Layer(layer_of(module)))
    for fqn, (local, full) in params.items():
        owner = layer(fqn.rpartition(".")[0])
        owner.param_bytes += local
        owner.param_bytes_unsharded += full
    forward, backward = Totals(), Totals()
    for row in nodes:
        if row.collective:
            for totals, comms in ((forward, row.forward), (backward, row.backward),
                                  (layer(row.module).forward, row.forward),
                                  (layer(row.module).backward, row.backward)):
                totals.add(comms)
    return forward, backward, list(layers.values())


def node_info(node: fx.Node, rank: int, world: int, hints: dict,
              grads: frozenset = frozenset()) -> NodeInfo:
    """One node's row: shapes, placement, and the collectives it issues (backward ones
    only where ``grads``, the nodes carrying gradients, holds its input)."""
    v, p = val(node), node.meta.get(PLACEMENT)
    tensor = isinstance(v, torch.Tensor)
    kind = collective_of(node)
    forward, backward = _comms(node, kind, rank, world, grads) if kind else ([], [])
    read = READS in node.meta  # a parameter, read through its owner's reads: as get_attr
    owner = node.target.rpartition(".")[0] if node.op == "get_attr" else \
        _read_target(node).rpartition(".")[0] if read else ""
    return NodeInfo(
        name=node.name, op="get_attr" if read else op_name(node),
        module=module_fqn(node) or owner,
        dtype=str(v.dtype).removeprefix("torch.") if tensor else None,
        global_shape=[_dim(s, hints)[0] for s in v.shape] if tensor else None,
        local_shape=[d for d, _ in _local_dims(v, p, rank, world, hints)] if tensor else None,
        placement=describe(p), collective=kind, forward=forward, backward=backward,
        fallback=node.meta.get(FALLBACK))


# local ops that communicate inside -> the kind explain reports them as
_COMMUNICATING = {loss_parallel_cross_entropy: "loss_parallel", norm_of_shards: "sharded_norm",
                  layer_norm_of_shards: "sharded_norm",
                  **dict.fromkeys([logsumexp_of_shards, softmax_of_shards, extremum_of_shards,
                                   pick_of_shards, arg_of_shards, any_of_shards,
                                   cumsum_of_shards, topk_of_shards], "sharded_softmax")}


def collective_of(node: fx.Node) -> Optional[str]:
    if node.op == "call_function" and node.target in _COMMUNICATING:
        return _COMMUNICATING[node.target]
    return node.meta.get(COLLECTIVE)


def op_name(node: fx.Node) -> str:
    """``aten.mm.default``, ``fxtp.all_gather``, ``getitem``; the fx op for non-calls."""
    if node.op != "call_function":
        return node.op
    target = node.target
    if isinstance(target, OperatorBase):
        return str(target)
    name = getattr(target, "__name__", str(target))
    package = (getattr(target, "__module__", None) or "").split(".")[0]
    return f"fxtp.{name}" if package in ("fxtp", "passes") else name


def layer_of(fqn: str) -> str:
    """``layers.3.attention.wq`` -> ``layers.3``; a module in no list is its own layer."""
    return list_block(fqn) or fqn


def _dim(size, hints: dict) -> tuple:
    """``(size as reported, size hint)``: an int, or a symbolic dim's expression."""
    if isinstance(size, int):
        return size, size
    constant = size.node.maybe_as_int()
    if constant is not None:
        return constant, constant
    text = str(size.node.expr)
    hints[text] = size_hint(size)
    return text, hints[text]


def _chunk(size: int, rank: int, world: int) -> int:
    """The size of ``rank``'s piece of ``torch.chunk(size, world)``."""
    step = -(-size // world)
    return max(0, min(step, size - rank * step))


def _local_dims(v: torch.Tensor, p, rank: int, world: int, hints: dict) -> list[tuple]:
    dims = [_dim(s, hints) for s in v.shape]
    if not is_sharded(p):
        return dims
    if isinstance(p, UnitShard):  # static sizes only
        length = local_range(p, dims[p.dim][1], rank, world)[1]
        dims[p.dim] = (length, length)
        return dims
    cut, (size, hint) = blocks(p), dims[p.dim]
    local_hint = sum(b // world for b in cut) if isinstance(cut, tuple) else \
        cut * _chunk(hint // cut, rank, world)
    dims[p.dim] = (local_hint if isinstance(size, int) else f"{size}/{world}", local_hint)
    return dims


def _local_bytes(node: fx.Node, rank: int, world: int) -> int:
    v = val(node)
    dims = _local_dims(v, node.meta.get(PLACEMENT), rank, world, {})
    return math.prod(h for _, h in dims) * v.dtype.itemsize


def _comms(node: fx.Node, kind: str, rank: int, world: int, grads) -> tuple[list, list]:
    """``(forward, backward)`` collectives of a collective node of ``kind``."""
    args = call_args(node)
    if kind == "grad_sync_bucket":
        by_dtype: dict = {}
        for param in args["xs"]:
            by_dtype[val(param).dtype] = by_dtype.get(val(param).dtype, 0) + \
                _local_bytes(param, rank, world)
        flows = any(param in grads for param in args["xs"])
        return [], [Comm("all_reduce", b) for b in by_dtype.values()] if flows else []
    if kind == "loss_parallel":
        logits, target = val(args["logits"]), val(args["target"])
        tokens = _numel_hint(logits) // _hint(logits.shape[args["class_dim"]])
        sizes = forward_all_reduce_bytes(tokens, logits.dtype, target.is_floating_point(),
                                         args["label_smoothing"])
        return [Comm("all_reduce", b) for b in sizes], []
    norm = node.target is layer_norm_of_shards
    if kind == "sharded_softmax" or norm:  # a few values per row of x, over the reduced dims
        x = val(args["x"])
        dims = range(x.dim() - args["k"], x.dim()) if norm else \
            args["dims"] if "dims" in args else [args["dim"]]
        rows = _numel_hint(x) // math.prod(_hint(x.shape[d]) for d in dims)
        if node.target is topk_of_shards:  # k pairs per row (a norm's k is its dims)
            rows *= args["k"]
        forward, backward = layer_norm_bytes(rows, x.dtype) if norm else \
            collective_bytes(node.target, rows, args.get("dtype") or x.dtype)
        return [Comm(*c) for c in forward], [Comm(*c) for c in backward if args["x"] in grads]
    if kind == "sharded_norm":  # replicated: every rank sums a tensor of the norm's size
        return [Comm("all_reduce", _local_bytes(node, rank, world))], []
    forward, backward = conjugates(node, grads)
    return ([Comm(forward, _local_bytes(args["x"], rank, world))] if forward else [],
            [Comm(backward, _local_bytes(node, rank, world))] if backward else [])


def _hint(size) -> int:
    return _dim(size, {})[1]


def _numel_hint(v: torch.Tensor) -> int:
    return math.prod(_hint(s) for s in v.shape)


def _carry_grad(gm: fx.GraphModule, graph: fx.Graph, input_grads: bool) -> frozenset:
    """Nodes whose value carries a gradient in backward: trainable parameters (and floating
    root inputs with ``input_grads``) and floating values computed from them by
    differentiable ops."""
    def is_root(node, v):
        if node.op == "placeholder":
            return input_grads and isinstance(v, torch.Tensor) and \
                (v.dtype.is_floating_point or v.dtype.is_complex)
        if READS in node.meta:  # a parameter, read through its owner's reads
            return attr(gm, _read_target(node)).requires_grad
        return node.op == "get_attr" and getattr(attr(gm, node.target), "requires_grad", False)
    return gradient_carriers(graph, is_root)


def _read_target(node: fx.Node) -> str:
    """The path of the parameter a read node of the inlined program reads (its ``READS``
    path is relative to the graph module it came from)."""
    owner, name = node.args[0].target.rpartition(".")[0], node.args[1]
    return f"{owner}.{name}" if owner else name


def _param_bytes(gm: fx.GraphModule, shapes: dict) -> dict[str, tuple[int, int]]:
    """Parameter FQN -> (bytes on this rank, bytes unsharded); tied parameters once."""
    out = {}
    for name, p in gm.named_parameters():
        fqn, local = model_fqn(name), (p.to_local() if isinstance(p, DTensor) else p)
        size = local.element_size()
        out[fqn] = (local.numel() * size, math.prod(shapes.get(fqn, local.shape)) * size)
    return out
