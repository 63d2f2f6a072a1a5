"""The per-op sharding rule registry: ``RULES[aten_op] -> Rule``.

A rule turns an fx node into a :class:`~passes.dimspec.DimSpec` (from which propagation
derives the op's strategies) and, for ops that carry global shapes as arguments, says how
to rewrite those arguments for local shards. Ops are grouped by the shape of their rule:
most are one line.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Optional

import sympy
import torch
import torch.fx as fx
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .dimspec import DimSpec, fixed_label, parse, strategies
from .local_ops import sharded_dropout, vocab_parallel_embedding
from .loss_parallel import class_sharded, cross_entropy_spec, loss_parallel
from .placement import is_sharded

aten = torch.ops.aten


def val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def is_tensor_node(arg) -> bool:
    return isinstance(val(arg), torch.Tensor)


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The node's tensor inputs in argument order (the order DimSpec inputs follow)."""
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs),
                    lambda a: found.append(a) if is_tensor_node(a) else None)
    return found


def output_vals(node: fx.Node) -> list:
    v = val(node)
    return list(v) if isinstance(v, (tuple, list)) else [v]


@dataclass(frozen=True)
class Rule:
    """How fxtp shards one op.

    ``spec(node)`` states the dims, from which the op's strategies derive; ``extra(node,
    world)`` yields further ``(input placements, output placements)`` strategies a dim spec
    cannot state (a rule whose local op communicates, a split served by a strided input).
    ``shape_arg`` is the index of a global shape argument that localization rewrites for
    the output's placement.
    ``local_op(node, inputs, group)``, given the placements chosen for the tensor inputs
    and the :class:`~fxtp.mesh.Group`, returns the ``(target, args, kwargs)`` to run instead
    when the op cannot run as is on its shards; ``communicates`` says that local op issues
    collectives for its ``extra`` strategies (they need a real process group to check)."""

    spec: Callable[[fx.Node], DimSpec]
    shape_arg: Optional[int] = None
    local_op: Optional[Callable] = None
    extra: Optional[Callable] = None
    communicates: bool = False

    def strategies(self, node: fx.Node, world: int, actual=()):
        """Every valid ``(input placements, output placements)`` of ``node``; ``actual``,
        the placements its tensor inputs have now, lets strided labels follow them."""
        shapes = lambda vals: [getattr(v, "shape", None) for v in vals]  # noqa: E731
        yield from strategies(self.spec(node), shapes(val(a) for a in tensor_inputs(node)),
                              shapes(output_vals(node)), world, actual)
        if self.extra is not None:
            yield from self.extra(node, world)

    def localize(self, node: fx.Node, inputs, output, group, graph=None):
        """``(target, args, kwargs)`` of this rank's computation of ``node`` (whose args
        are graph values), given its tensor inputs' and its output's placements."""
        target, args, kwargs = node.target, node.args, node.kwargs
        if self.local_op is not None:
            target, args, kwargs = self.local_op(node, inputs, group)
        if self.shape_arg is not None:
            args = list(args)
            args[self.shape_arg] = localize_shape(args[self.shape_arg], output, group.world,
                                                  graph, node)
            args = tuple(args)
        return target, args, kwargs


def _rank(node) -> int:
    return val(node).dim()


def _ranks(node):
    return [_rank(a) for a in tensor_inputs(node)]


# --- rule shapes ------------------------------------------------------------------------

def pointwise(partial: str = "none", partial_args=None):
    """Broadcasting elementwise op. ``partial="sum"`` applies only when every operand is a
    tensor (adding a Python scalar to a Partial value would add it once per rank)."""
    def spec(node):
        out = val(node).shape
        n = len(out)
        inputs = []
        for a in tensor_inputs(node):
            shape = val(a).shape
            offset = n - len(shape)
            inputs.append(tuple(f"d{offset + j}" if shape[j] == out[offset + j] or
                                not _is_one(shape[j]) else fixed_label()
                                for j in range(len(shape))))
        kind = partial
        scalars = [a for a in node.args if isinstance(a, (int, float)) and not isinstance(a, bool)]
        if kind == "sum" and scalars and node.target not in _SCALAR_LINEAR:
            kind = "none"
        outs = tuple(tuple(f"d{j}" for j in range(n)) for _ in output_vals(node))
        return DimSpec(tuple(inputs), outs, kind, partial_args)
    return Rule(spec)


def _is_one(size) -> bool:
    return isinstance(size, int) and size == 1


def einsum(text: str, partial="none", partial_args=None):
    """A fixed spec over the node's tensor inputs, e.g. ``"... k+, n k+ -> ... n"``."""
    return Rule(lambda node: parse(text, _ranks(node), [len(v.shape) for v in output_vals(node)],
                                   partial, partial_args))


def along_dims(dims_of: Callable[[fx.Node], list[int]], partial="sum", keep=True,
               reduce_mark="!"):
    """Unary op that treats ``dims_of(node)`` specially: with ``keep`` they stay (fixed),
    otherwise they are reduced away (marked ``reduce_mark``: ``+`` sums, ``!`` forbids)."""
    def spec(node):
        n = _rank(node.args[0])
        dims = {d % n for d in dims_of(node)} if n else set()
        labels = tuple((f"d{j}{reduce_mark if not keep else '!'}" if j in dims else f"d{j}")
                       for j in range(n))
        if keep:
            outs = tuple(labels for _ in output_vals(node))
        else:
            keepdim = _arg(node, 2, "keepdim", False)
            outs = (tuple(fixed_label() if j in dims else labels[j] for j in range(n)
                          if keepdim or j not in dims),)
        return DimSpec((labels,) + (None,) * (len(tensor_inputs(node)) - 1), outs, partial)
    return Rule(spec)


def _arg(node, i, name, default=None):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _dim_list(i, name="dim"):
    def dims(node):
        d = _arg(node, i, name)
        if d is None:
            return list(range(_rank(node.args[0])))
        return list(d) if isinstance(d, (list, tuple)) else [d]
    return dims


def permutation(perm_of: Callable[[fx.Node], list[int]]):
    """Output dim i is input dim ``perm[i]`` (transpose, permute)."""
    def spec(node):
        n = _rank(node.args[0])
        labels = tuple(f"d{j}" for j in range(n))
        return DimSpec((labels,), (tuple(labels[p % n] for p in perm_of(node)),) if n else ((),),
                       "sum")
    return Rule(spec)


def _transpose_perm(node):
    n = _rank(node.args[0])
    perm = list(range(n))
    if n:
        a, b = node.args[1] % n, node.args[2] % n
        perm[a], perm[b] = perm[b], perm[a]
    return perm


def _view_spec(node):
    """Group input and output dims whose sizes multiply to the same value; sharding a
    group's leading dim on one side is sharding its leading dim on the other."""
    src, dst = list(val(node.args[0]).shape), list(val(node).shape)
    in_labels, out_labels = [], []
    i = j = 0
    while i < len(src) or j < len(dst):
        if i < len(src) and j < len(dst) and _same(src[i], dst[j]):
            label = f"g{i}"
            in_labels.append(label)
            out_labels.append(label)
            i, j = i + 1, j + 1
            continue
        if i < len(src) and _is_one(src[i]):
            in_labels.append(fixed_label())
            i += 1
            continue
        if j < len(dst) and _is_one(dst[j]):
            out_labels.append(fixed_label())
            j += 1
            continue
        gi, gj, pi, pj = [i], [j], src[i], dst[j]
        while not _same(pi, pj):
            if _lt(pi, pj):
                i += 1
                gi.append(i)
                pi = pi * src[i]
            else:
                j += 1
                gj.append(j)
                pj = pj * dst[j]
        label = f"g{gi[0]}"
        in_labels += [label] + [fixed_label() for _ in gi[1:]]
        out_labels += [label] + [fixed_label() for _ in gj[1:]]
        i, j = gi[-1] + 1, gj[-1] + 1
    return DimSpec((tuple(in_labels),), (tuple(out_labels),), "sum")


def _expr(size):
    return sympy.Integer(size) if isinstance(size, int) else size.node.expr


def _same(a, b) -> bool:
    """Are two (possibly symbolic) sizes provably equal?"""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return sympy.expand(_expr(a) - _expr(b)) == 0


def _lt(a, b) -> bool:
    try:
        return bool(a < b)
    except Exception:  # noqa: BLE001 - symbolic sizes compare by hint
        return a.node.hint < b.node.hint


def _unsqueeze_spec(node):
    n = _rank(node.args[0])
    d = node.args[1] % (n + 1)
    labels = tuple(f"d{j}" for j in range(n))
    return DimSpec((labels,), (labels[:d] + (fixed_label(),) + labels[d:],), "sum")


def _squeeze_spec(node):
    shape = val(node.args[0]).shape
    n = len(shape)
    dims = _dim_list(1)(node)
    drop = {d % n for d in dims if _is_one(shape[d % n])} if n else set()
    labels = tuple(fixed_label() if j in drop else f"d{j}" for j in range(n))
    return DimSpec((labels,), (tuple(lab for j, lab in enumerate(labels) if j not in drop),),
                   "sum")


def _expand_spec(node):
    src, dst = val(node.args[0]).shape, val(node).shape
    off = len(dst) - len(src)
    ins = tuple(f"d{off + j}" if _same(src[j], dst[off + j]) else fixed_label()
                for j in range(len(src)))
    outs = tuple(f"d{j}" if j >= off and _same(src[j - off], dst[j]) else fixed_label()
                 for j in range(len(dst)))
    return DimSpec((ins,), (outs,), "sum")


def _cat_spec(node):
    tensors = [t for t in node.args[0] if is_tensor_node(t)]
    n = _rank(node)
    d = _arg(node, 1, "dim", 0) % n
    label = lambda j: fixed_label() if j == d else f"d{j}"  # noqa: E731
    ins = tuple(tuple(label(j) for j in range(n)) if _rank(t) == n else (fixed_label(),)
                for t in tensors)
    return DimSpec(ins, (tuple(label(j) for j in range(n)),), "sum")


def _split_spec(node):
    n = _rank(node.args[0])
    d = _arg(node, 2, "dim", 0) % n
    labels = tuple(f"d{j}!" if j == d else f"d{j}" for j in range(n))
    return DimSpec((labels,), tuple(labels for _ in output_vals(node)), "sum")


def _equal_parts(node, world):
    """A split into k > 1 equal parts, each divisible by ``world``, is served by the input
    ``_StridedShard(d, k)`` (each rank holds its piece of every part): every output is
    ``Shard(d)``, computed by splitting the local shard into local sizes."""
    d = _arg(node, 2, "dim", 0) % _rank(node.args[0])
    parts = [v.shape[d] for v in output_vals(node)]
    if len(parts) > 1 and all(isinstance(p, int) and p == parts[0] for p in parts) and \
            parts[0] % world == 0:
        yield (_StridedShard(d, split_factor=len(parts)),), (Shard(d),) * len(parts)


def _local_split(node, inputs, group):
    """Split sizes of a strided input are this rank's sizes (``chunk`` counts parts)."""
    if not isinstance(inputs[0], _StridedShard) or node.target is aten.chunk.default:
        return node.target, node.args, node.kwargs
    sizes = node.args[1]
    local = [s // group.world for s in sizes] if isinstance(sizes, (list, tuple)) else \
        sizes // group.world
    return node.target, (node.args[0], local) + tuple(node.args[2:]), node.kwargs


def _slice_spec(node):
    n = _rank(node.args[0])
    d = _arg(node, 1, "dim", 0) % n
    labels = tuple(f"d{j}!" if j == d else f"d{j}" for j in range(n))
    drop = node.target is aten.select.int
    return DimSpec((labels,), (tuple(lab for j, lab in enumerate(labels)
                                     if not (drop and j == d)),), "sum")


def _linear_spec(node):
    """``x @ w.T + b``. With a bias nothing may produce or pass through Partial (the bias
    would be added on every rank); the seed pass splits the bias off planned rowwise
    linears."""
    if len(tensor_inputs(node)) == 3:
        return parse("... k!, n k!, n -> ... n", _ranks(node))
    return parse("... k+, n k+ -> ... n", _ranks(node), partial="product", partial_args=(0, 1))


def _addmm_spec(node):
    """``beta * bias + alpha * (m1 @ m2)``: like a biased linear, no Partial; the seed pass
    splits the bias off when ``m2`` is sharded on its rows."""
    bias_rank = _rank(node.args[0])
    bias = "m n" if bias_rank == 2 else ("n" if bias_rank == 1 else "")
    return parse(f"{bias}, m k!, k! n -> m n", _ranks(node))


def _matmul_spec(node):
    ra, rb = _ranks(node)
    a = "... m k+" if ra >= 2 else "k+"
    b = "... k+ n" if rb >= 2 else "k+"
    out = ("... m" if ra >= 2 else "...") + (" n" if rb >= 2 else "")
    if ra >= 2 and rb >= 2 and ra != rb:  # broadcast batch: only the larger side's batch
        small = "m k+" if ra < rb else "k+ n"
        a, b = (small, b) if ra < rb else (a, small)
    return parse(f"{a}, {b} -> {out}", [ra, rb], partial="product")


def _layer_norm_spec(node):
    k = len(node.args[1])
    n = _rank(node.args[0])
    x = tuple(f"d{j}!" if j >= n - k else f"d{j}" for j in range(n))
    params = tuple(x[n - k:] for _ in tensor_inputs(node)[1:])
    return DimSpec((x,) + params, tuple(x for _ in output_vals(node)))


def _sdpa_spec(node):
    """Batch and head dims shard; query/key length and head dim do not (GQA: key/value may
    have fewer heads; they shard on the same head label). Serves ``scaled_dot_product_attention``
    and the fused kernels it dispatches to (CPU flash, flash, efficient, cuDNN, math): tensor
    inputs after q, k, v are masks or biases broadcast to (..., s, t); outputs are the
    attention output, the log-sum-exp (..., s), attention weights (..., s, t), and
    bookkeeping values (RNG state, sequence lengths) that stay replicated."""
    q, k, v, *masks = (val(a) for a in tensor_inputs(node))
    n = q.dim()
    batch = [f"d{j}" for j in range(n - 2)]
    specs = [tuple(batch + ["s!", "e!"]), tuple(batch + ["t!", "e!"]),
             tuple(batch + ["t!", "f!"])]
    for mask in masks:
        specs.append(_broadcast_labels(mask.shape, batch + ["s!", "t!"]))
    out, *extra = output_vals(node)
    outs = [tuple(batch + ["s!", "f!"])]
    for x in extra:  # log-sum-exp (..., s), attention weights (..., s, t), bookkeeping
        if not isinstance(x, torch.Tensor):
            outs.append(None)
        elif x.dim() in (n - 1, n) and all(_same(a, b) for a, b in zip(x.shape, out.shape[:-2])):
            outs.append(tuple(batch + ["s!", "t!"][: x.dim() - len(batch)]))
        else:
            outs.append(tuple(fixed_label() for _ in x.shape))
    return DimSpec(tuple(specs), tuple(outs))


def _broadcast_labels(shape, full):
    """Labels of a tensor broadcast against dims labelled ``full`` (size-1 dims fixed)."""
    off = len(full) - len(shape)
    return tuple(fixed_label() if _is_one(shape[j]) else full[off + j] for j in range(len(shape)))


def _embedding_spec(node):
    """A vocab-sharded table gives Partial rows (see :func:`_vocab_parallel`)."""
    return parse("v+ d, ... -> ... d", _ranks(node), partial="product", partial_args=(0,))


def _vocab_parallel(node, inputs, group):
    if not (isinstance(inputs[0], Shard) and inputs[0].dim == 0):
        return node.target, node.args, node.kwargs
    weight, indices = node.args[:2]
    offset = group.rank * (val(weight).shape[0] // group.world)
    return vocab_parallel_embedding, (weight, indices, offset, _arg(node, 2, "padding_idx", -1)), {}


def _dropout(node, inputs, group):
    """Dropout of a shard draws the whole mask and keeps its chunk (see
    :func:`~passes.local_ops.sharded_dropout`); of a replicated value, the same mask on every
    rank (all ranks' generators are in step)."""
    if not isinstance(inputs[0], Shard):
        return node.target, node.args, node.kwargs
    x, p, train = node.args[0], _arg(node, 1, "p"), _arg(node, 2, "train")
    return sharded_dropout, (x, p, train, inputs[0].dim, group.rank, group.world), {}


def _same_dims(node):
    """Every dim of the input maps to the same dim of the output, whose size may be a
    multiple of it (``repeat_interleave`` along a dim keeps contiguous blocks together)."""
    labels = tuple(f"d{j}" for j in range(_rank(node.args[0])))
    return DimSpec((labels,), (labels,), "sum")


def _complex_view_spec(node):
    """``view_as_complex`` folds the trailing (re, im) dim away; ``view_as_real`` adds it."""
    n_in, n_out = _rank(node.args[0]), _rank(node)
    labels = tuple(f"d{j}" for j in range(min(n_in, n_out)))
    pair = (fixed_label(),)
    return DimSpec((labels + pair if n_in > n_out else labels,),
                   (labels + pair if n_out > n_in else labels,), "sum")


def _ignore_input(node):
    """Factory-like ops (``new_zeros``): read only their input's metadata; output R."""
    n = _rank(node)
    return DimSpec((None,) * len(tensor_inputs(node)), (tuple(fixed_label() for _ in range(n)),))


# --- the table ----------------------------------------------------------------------------

_SCALAR_LINEAR = {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar}

NONLINEAR_POINTWISE = [
    aten.relu.default, aten.gelu.default, aten.silu.default, aten.sigmoid.default,
    aten.tanh.default, aten.exp.default, aten.log.default, aten.rsqrt.default,
    aten.sqrt.default, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.abs.default,
    aten.erf.default, aten.cos.default, aten.sin.default, aten.reciprocal.default,
    aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.where.self,
    aten.clamp.default, aten.maximum.default, aten.minimum.default, aten.ones_like.default,
    aten.full_like.default, aten.eq.Tensor, aten.eq.Scalar, aten.ne.Scalar, aten.lt.Scalar,
    aten.gt.Scalar, aten.logical_not.default, aten.rsub.Scalar, aten.tril.default,
    aten.triu.default, aten.relu_.default, aten.add.Scalar, aten.sub.Scalar,
]
LINEAR_POINTWISE = [
    aten.neg.default, aten.clone.default, aten.alias.default, aten.detach.default,
    aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device,
    aten.lift_fresh_copy.default, aten.mul.Scalar, aten.div.Scalar, aten.zeros_like.default,
    aten.contiguous.default, aten.type_as.default, aten.add.Tensor, aten.sub.Tensor,
    aten.add_.Tensor, aten.sub_.Tensor,
]

RULES: dict = {op: pointwise() for op in NONLINEAR_POINTWISE}
RULES.update({op: pointwise("sum") for op in LINEAR_POINTWISE})
RULES.update({
    aten.mul.Tensor: pointwise("product"),
    aten.mul_.Tensor: pointwise("product"),
    aten.div.Tensor: pointwise("product", partial_args=(0,)),
    aten.linear.default: Rule(_linear_spec),
    aten.matmul.default: Rule(_matmul_spec),
    aten.addmm.default: Rule(_addmm_spec),
    aten.mm.default: einsum("m k+, k+ n -> m n", "product"),
    aten.bmm.default: einsum("b m k+, b k+ n -> b m n", "product"),
    aten.embedding.default: Rule(_embedding_spec, local_op=_vocab_parallel),
    aten.dropout.default: Rule(pointwise().spec, local_op=_dropout),
    aten.scaled_dot_product_attention.default: Rule(_sdpa_spec),
    aten._scaled_dot_product_flash_attention_for_cpu.default: Rule(_sdpa_spec),
    aten._scaled_dot_product_flash_attention.default: Rule(_sdpa_spec),
    aten._scaled_dot_product_efficient_attention.default: Rule(_sdpa_spec),
    aten._scaled_dot_product_cudnn_attention.default: Rule(_sdpa_spec),
    aten._scaled_dot_product_attention_math.default: Rule(_sdpa_spec),
    aten.cross_entropy_loss.default: Rule(cross_entropy_spec, local_op=loss_parallel,
                                          extra=class_sharded, communicates=True),
    aten.layer_norm.default: Rule(_layer_norm_spec),
    aten.rms_norm.default: Rule(_layer_norm_spec),
    aten.softmax.int: along_dims(_dim_list(1), "none"),
    aten._softmax.default: along_dims(_dim_list(1), "none"),
    aten.log_softmax.int: along_dims(_dim_list(1), "none"),
    aten._log_softmax.default: along_dims(_dim_list(1), "none"),
    aten.sum.dim_IntList: along_dims(_dim_list(1), "sum", keep=False, reduce_mark="+"),
    aten.sum.default: along_dims(_dim_list(99), "sum", keep=False, reduce_mark="+"),
    aten.mean.dim: along_dims(_dim_list(1), "sum", keep=False),
    aten.mean.default: along_dims(_dim_list(99), "sum", keep=False),
    aten.amax.default: along_dims(_dim_list(1), "none", keep=False),
    aten.view.default: Rule(_view_spec, shape_arg=1),
    aten.reshape.default: Rule(_view_spec, shape_arg=1),
    aten._unsafe_view.default: Rule(_view_spec, shape_arg=1),
    aten.expand.default: Rule(_expand_spec, shape_arg=1),
    aten.transpose.int: permutation(_transpose_perm),
    aten.permute.default: permutation(lambda n: list(n.args[1])),
    aten.t.default: permutation(lambda n: list(range(_rank(n.args[0])))[::-1]),
    aten.unsqueeze.default: Rule(_unsqueeze_spec),
    aten.squeeze.dim: Rule(_squeeze_spec),
    aten.squeeze.dims: Rule(_squeeze_spec),
    aten.cat.default: Rule(_cat_spec),
    aten.split.Tensor: Rule(_split_spec, local_op=_local_split, extra=_equal_parts),
    aten.split_with_sizes.default: Rule(_split_spec, local_op=_local_split, extra=_equal_parts),
    aten.chunk.default: Rule(_split_spec, extra=_equal_parts),
    aten.slice.Tensor: Rule(_slice_spec),
    aten.select.int: Rule(_slice_spec),
    aten.flatten.using_ints: Rule(_view_spec),
    aten.repeat_interleave.self_int: Rule(_same_dims),
    aten.view_as_complex.default: Rule(_complex_view_spec),
    aten.view_as_real.default: Rule(_complex_view_spec),
    aten.new_zeros.default: Rule(_ignore_input),
    aten.new_ones.default: Rule(_ignore_input),
    aten.new_empty.default: Rule(_ignore_input),
    aten.new_full.default: Rule(_ignore_input),
})

PASSTHROUGH = {operator.getitem}


def localize_shape(shape, placement, world: int, graph: fx.Graph, before: fx.Node):
    """Rewrite a global shape list for an output with ``placement``: the sharded entry is
    divided by ``world`` (``-1`` stays inferred; a symbolic size gets a floordiv node)."""
    if not is_sharded(placement):
        return shape
    shape = list(shape)
    d = placement.dim
    entry = shape[d]
    if isinstance(entry, int):
        shape[d] = entry if entry == -1 else entry // world
    else:
        with graph.inserting_before(before):
            shape[d] = graph.call_function(operator.floordiv, (entry, world))
    return shape
