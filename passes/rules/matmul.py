"""Matrix products: ``linear``, ``mm``, ``addmm``, ``baddbmm``, ``bmm``, ``matmul``,
``einsum``, ``convolution`` and grouped matmuls (torch's and transformers')."""
from __future__ import annotations

import dataclasses

import torch
from torch.distributed.tensor import Shard

from ..dimspec import DimSpec, fixed_label, parse
from ..graph import op_arg, output_vals, tensor_inputs, val
from ..placement import BlockShard, block_sizes, is_blocked, with_dim
from .base import Rule, input_ndims, is_one, local_groups, ndim_of

aten = torch.ops.aten


def einsum(text: str, partial="none", partial_args=None):
    """A fixed spec over the node's tensor inputs, e.g. ``"... k+, n k+ -> ... n"``."""
    return Rule(lambda node: parse(text, input_ndims(node),
                                   [len(v.shape) for v in output_vals(node)], partial,
                                   partial_args))


def _linear_spec(node):
    """``x @ w.T + b``. With a bias nothing may produce or pass through Partial (the bias
    would be added on every rank); the seed pass splits the bias off planned rowwise
    linears."""
    if len(tensor_inputs(node)) == 3:
        return parse("... k!, n k!, n -> ... n", input_ndims(node))
    return parse("... k+, n k+ -> ... n", input_ndims(node), partial="product", partial_args=(0, 1))


def _addmm_spec(node):
    """``beta * bias + alpha * (m1 @ m2)``: like a biased linear, no Partial; the seed pass
    splits the bias off when ``m2`` is sharded on its rows."""
    bias_rank = ndim_of(node.args[0])
    bias = "m n" if bias_rank == 2 else ("n" if bias_rank == 1 else "")
    return parse(f"{bias}, m k!, k! n -> m n", input_ndims(node))


def _baddbmm_spec(node):
    bias = " ".join("b m n".split()[3 - ndim_of(node.args[0]):])
    return parse(f"{bias}, b m k!, b k! n -> b m n", input_ndims(node))


def _matmul_spec(node):
    """``a @ b``; a batch dim of size 1 on one side is broadcast (fixed on that side: one
    KV head read by every query head)."""
    ra, rb = input_ndims(node)
    a = "... m k+" if ra >= 2 else "k+"
    b = "... k+ n" if rb >= 2 else "k+"
    out = ("... m" if ra >= 2 else "...") + (" n" if rb >= 2 else "")
    if ra >= 2 and rb >= 2 and ra != rb:  # broadcast batch: only the larger side's batch
        small = "m k+" if ra < rb else "k+ n"
        a, b = (small, b) if ra < rb else (a, small)
    spec = parse(f"{a}, {b} -> {out}", [ra, rb], partial="product")
    if ra != rb or ra < 3:
        return spec
    shapes = [val(x).shape for x in tensor_inputs(node)]
    labels = [list(spec.inputs[0]), list(spec.inputs[1])]
    for j in range(ra - 2):
        for side in (0, 1):
            if is_one(shapes[side][j]) and not is_one(shapes[1 - side][j]):
                labels[side][j] = fixed_label()
    return dataclasses.replace(spec, inputs=tuple(map(tuple, labels)))


def _convolution_spec(node):
    """``aten.convolution``: input ``(N, C, *spatial)``, weight ``(O, C / groups,
    *kernel)``. The batch shards; with one group also the output channels (colwise) and,
    without a bias, the input channels (a Partial sum). Spatial dims stay whole (a shard
    would need its neighbours' edges); a transposed convolution shards the batch only, a
    grouped one also by whole groups (:func:`_grouped_convolution`)."""
    ranks = input_ndims(node)
    spatial, kernel = " _" * (ranks[0] - 2), " _" * (ranks[1] - 2)
    bias = len(ranks) == 3
    if op_arg(node, 6, "transposed", False) or op_arg(node, 8, "groups", 1) != 1:
        return parse(f"n _{spatial}, _ _{kernel}{', _' if bias else ''} -> n _{spatial}",
                     ranks)
    if bias:
        return parse(f"n c!{spatial}, o c!{kernel}, o -> n o{spatial}", ranks)
    return parse(f"n c+{spatial}, o c+{kernel} -> n o{spatial}", ranks, partial="product",
                 partial_args=(0, 1))


def _grouped_convolution(node, world, actual=()):
    """A grouped convolution whose groups divide by the world size, on channel shards: each
    rank convolves whole groups, its channels of the input, the weight and the bias
    (Mamba's and ConvNeXt's depthwise convolutions); the local op takes ``groups /
    world`` (:func:`local_groups`). Channels that arrive in blocks (a fused projection's
    q, k and v, convolved before they are split: Qwen3.5's linear attention) keep them
    where each rank's chunk of every block is whole groups."""
    groups = op_arg(node, 8, "groups", 1)
    if op_arg(node, 6, "transposed", False) or not isinstance(groups, int) or groups == 1 \
            or groups % world:
        return
    params = len(tensor_inputs(node)) - 1
    yield (Shard(1),) + (Shard(0),) * params, (Shard(1),)
    have = actual[0] if actual else None
    channels, out = val(node.args[0]).shape[1], val(node).shape[1]
    if not (is_blocked(have) and have.dim == 1 and isinstance(channels, int) and all(
            size % (world * (channels // groups)) == 0 for size in block_sizes(have, channels))):
        return
    made = have  # each group's output channels in its input channels' blocks
    if isinstance(have, BlockShard):
        made = BlockShard(1, tuple(size * out // channels for size in have.blocks))
    yield (have,) + (with_dim(made, 0),) * params, (made,)


_GROUPED_MM = "s! k+, _ k+ n, _ -> s! n"
"""A grouped matmul of rows grouped by expert (``offs``: each group's end) by a stack of
expert weights: row i of group e times weight[e]. The rows and the experts stay whole, as
the grouping needs."""


def _grouped_mm_spec(node):
    """``torch._grouped_mm`` in the form mixture-of-experts layers use (2-D rows, 3-D
    weights, offsets); its other forms keep every dim whole (a gather, reported)."""
    ranks = input_ndims(node)
    if ranks == [2, 3, 1] and op_arg(node, 3, "bias") is None:
        return parse(_GROUPED_MM, ranks, partial="product", partial_args=(0, 1))
    out = val(node).dim()
    return DimSpec(tuple(tuple(fixed_label() for _ in range(r)) for r in ranks),
                   (tuple(fixed_label() for _ in range(out)),))


def _einsum_spec(node):
    """``torch.einsum(equation, operands)``: letters shared between operands shard together;
    a letter missing from the output is summed (``Partial`` when sharded); broadcast
    (size-1) dims and ``...`` dims of unequal rank never shard."""
    equation = node.args[0].replace(" ", "")
    lhs, _, rhs = equation.partition("->")
    terms = lhs.split(",")
    if not rhs and "->" not in equation:
        rhs = "".join(sorted(c for c in set(lhs) - {",", "."} if lhs.count(c) == 1))
    operands = tensor_inputs(node)
    out_letters = set(rhs)

    def labels(term, shape):
        letters = term.replace("...", "." * (len(shape) - len(term.replace("...", ""))))
        out = []
        for c, size in zip(letters, shape):
            if c == ".":
                out.append(fixed_label())
            elif is_one(size):
                out.append(fixed_label())
            else:
                out.append(c if c in out_letters else c + "+")
        return tuple(out)
    ins = tuple(labels(t, val(a).shape) for t, a in zip(terms, operands))
    out_shape = val(node).shape
    out = labels(rhs, out_shape)
    return DimSpec(ins, (out,), "product")


RULES: dict = {
    # matrix products
    aten.convolution.default: Rule(_convolution_spec, local_op=local_groups(8),
                                   extra=_grouped_convolution),
    aten.linear.default: Rule(_linear_spec),
    aten.matmul.default: Rule(_matmul_spec),
    aten.addmm.default: Rule(_addmm_spec),
    aten.baddbmm.default: Rule(_baddbmm_spec),
    aten.mm.default: einsum("m k+, k+ n -> m n", "product"),
    aten._grouped_mm.default: Rule(_grouped_mm_spec),
    aten.bmm.default: einsum("b m k+, b k+ n -> b m n", "product"),
    aten.einsum.default: Rule(_einsum_spec),
}


LIBRARY_RULES: dict[str, Rule] = {
    # transformers' grouped matmul of mixture-of-experts layers, where torch's is missing
    "transformers::grouped_mm_fallback": einsum(_GROUPED_MM, "product", (0, 1)),
}
"""Rules of other libraries' custom ops, by qualified name (their libraries may not be
loaded, or not installed)."""
