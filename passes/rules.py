"""The per-op sharding rule table: :func:`rule_for` ``(aten op) -> Rule``.

A rule turns an fx node into a :class:`~fxtp.passes.dimspec.DimSpec` (from which
propagation derives the op's strategies) and, for ops that carry global shapes or
rank-dependent offsets as arguments, says how to rewrite them for local shards.

Coverage comes from torch's own op metadata where it exists: every op tagged
``torch.Tag.pointwise`` gets the broadcasting pointwise rule without being listed (the
linear ones, listed in :data:`LINEAR_POINTWISE`, also pass ``Partial`` through). The other
families (views, reductions, concatenation, indexing and scatter, sorting, cumulative ops,
normalizations, matrix products, convolutions and per-channel planes, attention) are
stated below, one line per op where the family's rule shape fits. Every strategy of every rule is checked numerically by
``tests/test_rule_oracle.py``.

Adding an op is usually one line in :data:`RULES`, e.g. a reduction over a ``dim``
argument at position 1 that sums (sharding the reduced dim gives ``Partial``)::

    aten.nansum.default: reduction(dims_arg(1), summed=True, partial="sum"),
"""
from __future__ import annotations

import copy
import functools
import math
import operator
from dataclasses import dataclass, replace
from typing import Callable, Optional

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.distributed.tensor import Partial, Replicate, Shard

from .dimspec import DimSpec, fixed_label, parse, strategies
from .effects import writes_first_input, written_through
from .graph import (INTO_PARTIAL, is_tensor_node, op_arg, output_vals, stamp_edge,
                    tensor_inputs, val)
from .local_ops import (add_replicated_once, gather_of_shard, index_select_of_shard,
                        mean_of_shard, select_of_shard, sharded_dropout,
                        vocab_parallel_embedding)
from .loss_parallel import (class_sharded, cross_entropy_spec, cross_entropy_strategies,
                            loss_parallel, nll_on_classes)
from .sharded_norm import layer_norm_rule_parts, norm_rule_parts
from .sharded_softmax import (pick_rule_parts, reduction_rule_parts, scan_rule_parts,
                              softmax_rule_parts, topk_rule_parts)
from .placement import (P, R, UnitShard, block_bounds, blocks, cut_in_blocks, is_blocked,
                        is_sharded, is_whole, local_range, shardings_over)

aten = torch.ops.aten


@dataclass(frozen=True)
class Rule:
    """How fxtp shards one op.

    ``spec(node)`` states the dims, from which the op's strategies derive; ``extra(node,
    world, actual)`` yields further ``(input placements, output placements)`` strategies a
    dim spec cannot state (a rule whose local op communicates, a split served by a blocked
    input), given the placements the tensor inputs have now.
    ``shape_arg`` is the index of a global shape argument that localization rewrites for
    the output's placement.
    ``local_op(node, inputs, output, group)``, given the placements chosen for the tensor
    inputs and the output and the group (``rank``, ``world`` and ``name``: a
    :class:`fxtp.mesh.Group`), returns the ``(target, args, kwargs)`` to run instead when the
    op cannot run as is on its shards or takes rank-dependent arguments; ``communicates``
    says that local op issues collectives for its ``extra`` strategies (they need a real
    process group to check). ``strided=False``: the op is offered no blocked
    (``_StridedShard``, ``BlockShard``) forms of its spec's strategies (its local form assumes one contiguous shard per rank:
    a vocab offset, a diagonal shift, a chunk of a mask). ``units=False``: nor
    :class:`~fxtp.passes.placement.UnitShard` forms (its local form assumes equal shards)."""

    spec: Callable[[fx.Node], DimSpec]
    shape_arg: Optional[int] = None
    local_op: Optional[Callable] = None
    extra: Optional[Callable] = None
    communicates: bool = False
    strided: bool = True
    units: bool = True

    def strategies(self, node: fx.Node, world: int, actual=()):
        """Every valid ``(input placements, output placements)`` of ``node``; ``actual``,
        the placements its tensor inputs have now, lets strided and unit-sharded labels
        follow them."""
        shapes = lambda vals: [getattr(v, "shape", None) for v in vals]  # noqa: E731
        yield from strategies(self.spec(node), shapes(val(a) for a in tensor_inputs(node)),
                              shapes(output_vals(node)), world, actual if self.strided else (),
                              actual if self.units else ())
        if self.extra is not None:
            yield from self.extra(node, world, actual)

    def localize(self, node: fx.Node, inputs, output, group, graph=None):
        """``(target, args, kwargs)`` of this rank's computation of ``node`` (whose args
        are graph values), given its tensor inputs' and its output's placements."""
        target, args, kwargs = node.target, node.args, node.kwargs
        # a value every rank holds whole computes as if replicated
        inputs = tuple(Replicate() if is_whole(p) else p for p in inputs)
        output = Replicate() if is_whole(output) else output
        if self.local_op is not None:
            target, args, kwargs = self.local_op(node, inputs, output, group)
        if self.shape_arg is not None:
            args = list(args)
            args[self.shape_arg] = localize_shape(args[self.shape_arg], output, group, graph,
                                                  node)
            args = tuple(args)
        return target, args, kwargs


def _rank(node) -> int:
    return val(node).dim()


def _ranks(node):
    return [_rank(a) for a in tensor_inputs(node)]


def _labels(n: int, prefix="d") -> tuple:
    return tuple(f"{prefix}{j}" for j in range(n))


# --- rule shapes ------------------------------------------------------------------------

def pointwise(partial: str = "none", partial_args=None, unread=()):
    """Broadcasting elementwise op. ``partial="sum"`` applies only when every operand is a
    tensor (adding a Python scalar to a Partial value would add it once per rank), except
    for ops that scale by their scalar (:data:`_SCALAR_LINEAR`), and ``partial`` not at all
    where the op casts an operand to a narrower dtype (:func:`_narrows`). ``unread``: indices of
    tensor inputs the op reads only the metadata of (``type_as``'s other)."""
    def spec(node):
        out = output_vals(node)[0].shape  # every output (frexp's two) has this shape
        n = len(out)
        inputs = []
        for i, a in enumerate(tensor_inputs(node)):
            if i in unread:
                inputs.append(None)
                continue
            shape = val(a).shape
            offset = n - len(shape)
            inputs.append(tuple(f"d{offset + j}" if statically_known_true(
                shape[j] == out[offset + j]) or not _is_one(shape[j]) else fixed_label()
                                for j in range(len(shape))))
        kind = partial
        scalars = [a for a in node.args if isinstance(a, (int, float)) and not isinstance(a, bool)]
        if kind == "sum" and scalars and node.target not in _SCALAR_LINEAR:
            kind = "none"
        dtype = output_vals(node)[0].dtype
        if kind != "none" and any(_narrows(val(a).dtype, dtype) for a in tensor_inputs(node)):
            kind = "none"  # rounding each rank's part is not rounding their sum
        outs = tuple(_labels(n) for _ in output_vals(node))
        return DimSpec(tuple(inputs), outs, kind, partial_args)
    return Rule(spec)


def _narrows(source: torch.dtype, target: torch.dtype) -> bool:
    """Does casting ``source`` to ``target`` lose what a sum of parts needs (precision,
    range, or the fraction: a cast to an integer)? Only widening a floating dtype keeps
    a partial sum's parts summing to the cast of their sum."""
    if source == target:
        return False
    return not (source.is_floating_point and target.is_floating_point and
                target.itemsize > source.itemsize)


def _is_one(size) -> bool:
    return isinstance(size, int) and size == 1


def einsum(text: str, partial="none", partial_args=None):
    """A fixed spec over the node's tensor inputs, e.g. ``"... k+, n k+ -> ... n"``."""
    return Rule(lambda node: parse(text, _ranks(node), [len(v.shape) for v in output_vals(node)],
                                   partial, partial_args))


def dims_arg(i: int, name: str = "dim", omitted: Optional[str] = None):
    """The dims an op acts on, read from argument ``i`` / keyword ``name``. When the argument
    is omitted or ``None`` (or an empty list, which reductions read as every dim), the op's
    own default applies: ``omitted="all"`` (every dim), ``"last"`` (dim -1) or ``None``
    (the argument is required)."""
    def dims(node):
        d = op_arg(node, i, name)
        if d is None or (isinstance(d, (list, tuple)) and not d):
            if omitted is None:
                raise ValueError(f"{node.target} was called without its {name!r} argument")
            n = _rank(node.args[0])
            return list(range(n)) if omitted == "all" else [n - 1] if n else []
        return list(d) if isinstance(d, (list, tuple)) else [d]
    return dims


ALL_DIMS = lambda node: list(range(_rank(node.args[0])))  # noqa: E731
"""The dims of an op without a dim argument (``sum(x)``): all of them."""


def along(dims_of: Callable[[fx.Node], list[int]], partial: str = "none"):
    """An op that keeps its input's shape and computes along ``dims_of(node)`` (softmax,
    cumulative sums, sorting): those dims never shard, the others shard freely. Every
    output (values, indices) has the input's shape."""
    def spec(node):
        n = _rank(node.args[0])
        dims = {d % n for d in dims_of(node)} if n else set()
        labels = tuple(f"d{j}!" if j in dims else f"d{j}" for j in range(n))
        return DimSpec((labels,) + (None,) * (len(tensor_inputs(node)) - 1),
                       tuple(labels for _ in output_vals(node)), partial)
    return Rule(spec)


def reduction(dims_of: Callable[[fx.Node], list[int]], summed: bool = False,
              partial: str = "none", keepdim_arg: Optional[int] = 2):
    """An op that reduces ``dims_of(node)`` away (kept as size 1 with ``keepdim``, read from
    argument ``keepdim_arg``; every output, e.g. values and indices, has the reduced
    shape). With ``summed`` sharding a reduced dim leaves per-rank partial sums
    (``Partial``); otherwise reduced dims never shard. ``partial="sum"``: a Partial input
    gives a Partial output (the op is linear)."""
    def spec(node):
        n = _rank(node.args[0])
        dims = {d % n for d in dims_of(node)} if n else set()
        mark = "+" if summed else "!"
        labels = tuple(f"d{j}{mark}" if j in dims else f"d{j}" for j in range(n))
        keepdim = keepdim_arg is not None and op_arg(node, keepdim_arg, "keepdim", False)
        out = tuple(fixed_label() if j in dims else labels[j] for j in range(n)
                    if keepdim or j not in dims)
        return DimSpec((labels,) + (None,) * (len(tensor_inputs(node)) - 1),
                       tuple(out for _ in output_vals(node)), partial)
    return Rule(spec)


def _parts(parts) -> dict:
    """A communicating local form's ``(extra, local_op)`` as :class:`Rule` fields."""
    extra, local_op = parts
    return dict(extra=extra, local_op=local_op, communicates=True)


def softmax():
    """Softmax and log-softmax along argument 1: along a sharded dim too, by
    :mod:`~fxtp.passes.sharded_softmax` (the output placed as the input)."""
    return replace(along(dims_arg(1)), **_parts(softmax_rule_parts()))


def extremum(largest: bool):
    """``amax`` / ``amin`` (``max`` / ``min`` of every element): over sharded dims too,
    replicated by one all-reduce."""
    return replace(reduction(dims_arg(1, omitted="all")),
                   **_parts(reduction_rule_parts("amax" if largest else "amin")))


def logical(dims_of: Callable[[fx.Node], list[int]], every: bool, keepdim_arg=2):
    """``any`` (``every``: ``all``) over ``dims_of(node)``: over sharded dims too,
    replicated by one all-reduce."""
    return replace(reduction(dims_of, keepdim_arg=keepdim_arg),
                   **_parts(reduction_rule_parts("all" if every else "any")))


def pick(largest: bool, values: bool):
    """``max`` / ``min`` along a dim (``values``: values and indices) and ``argmax`` /
    ``argmin``: along a sharded dim too, each rank's candidate all-gathered."""
    dims = dims_arg(1) if values else dims_arg(1, omitted="all")
    return replace(reduction(dims), **_parts(pick_rule_parts(largest, values)))


def vector_norm():
    """A p-norm over ``dim`` (argument 2, every dim when omitted) of order argument 1:
    a reduction whose reduced dims may also arrive sharded, for finite ``p > 0``: the
    local op then sums every rank's powers (one all-reduce, see
    :mod:`~fxtp.passes.sharded_norm`) into a replicated norm."""
    dims_of = dims_arg(2, omitted="all")
    return replace(reduction(dims_of, keepdim_arg=3), **_parts(norm_rule_parts(dims_of)))


def permutation(perm_of: Callable[[fx.Node], list[int]]):
    """Output dim i is input dim ``perm[i]`` (transpose, permute)."""
    def spec(node):
        n = _rank(node.args[0])
        labels = _labels(n)
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


def _movedim_perm(node):
    n = _rank(node.args[0])
    src, dst = node.args[1], node.args[2]
    src, dst = ([src], [dst]) if isinstance(src, int) else (list(src), list(dst))
    src, dst = [s % n for s in src], [d % n for d in dst]
    rest = iter(j for j in range(n) if j not in src)
    where = dict(zip(dst, src))
    return [where[i] if i in where else next(rest) for i in range(n)]


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
        if i == len(src) or j == len(dst):  # symbolic sizes of 1 left on one side
            in_labels += [fixed_label() for _ in src[i:]]
            out_labels += [fixed_label() for _ in dst[j:]]
            break
        gi, gj, pi, pj = [i], [j], src[i], dst[j]
        while not _same(pi, pj):
            grow_in = _lt(pi, pj)
            if (i if grow_in else j) + 1 == len(src if grow_in else dst):
                # sizes no product is proven equal to (a length padded to a multiple,
                # cut into chunks): the dims left on each side are one group, of equal
                # products since the view keeps every element
                gi, gj = list(range(gi[0], len(src))), list(range(gj[0], len(dst)))
                break
            if grow_in:
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


def _view_of_inner_shard(node, world, actual=()):
    """A view merging a sharded dim with dims before it (BLOOM's ``(batch, heads, ...) ->
    (batch * heads, ...)`` on head shards), or splitting such a merged dim again. For every
    index of the dims before it, a rank holds one contiguous piece of the elements: in the
    view, the dim holding them is cut in that many blocks, each sharded
    (``_StridedShard(d, m)``; ``Shard(d)`` for one block). Static sizes only; the leading
    dim of a group of merged dims is the view spec's own strategy. Also offered, whatever
    the input has now: a dim split into ``(k, m, ...)`` taken cut in ``k`` blocks, each
    sharded, is ``Shard`` of the ``m`` dim (timm's fused ``qkv`` viewed as ``(3, heads,
    head_dim)``: each rank holds its heads of each of q, k and v)."""
    src, dst = val(node.args[0]).shape, val(node).shape
    if not all(isinstance(s, int) and s > 0 for s in (*src, *dst)):
        return
    p, cut = _in_equal_blocks(actual)
    if p is not None:
        yield from _blocks_through_view(src, dst, p, cut, world)
    for d, k in _split_dims(src, dst):
        fused = cut_in_blocks(d, [src[d] // k] * k)
        if fused != p:
            yield from _blocks_through_view(src, dst, fused, k, world)


def _blocks_through_view(src, dst, p, cut: int, world: int):
    """The strategy of :func:`_view_of_inner_shard` for input ``p``, cut in ``cut`` equal
    blocks, if the view keeps each rank's pieces in one output dim."""
    if src[p.dim] % (cut * world):
        return
    before = math.prod(src[:p.dim]) * cut  # pieces each rank holds one part of
    out_before = 1
    for q, size in enumerate(dst):
        if before < out_before * size:  # dim q holds the pieces' boundaries
            m = before // out_before
            if before > 1 and before % out_before == 0 and size % (m * world) == 0:
                yield (p,), (cut_in_blocks(q, [size // m] * m) if m > 1 else Shard(q),)
            return
        out_before *= size


def _split_dims(src, dst) -> list[tuple[int, int]]:
    """``(input dim, k)`` for each input dim the view splits into three or more dims
    (parts, heads, head dim), the first of size ``k > 1`` (static sizes). Split in two, the
    dims are heads and head dim, which a blocked layout would cut inside heads."""
    found, i, j = [], 0, 0
    while i < len(src) and j < len(dst):
        if src[i] == dst[j]:
            i, j = i + 1, j + 1
            continue
        if dst[j] == 1:
            j += 1
            continue
        start, size = j, dst[j]
        while size < src[i] and j + 1 < len(dst):
            j += 1
            size *= dst[j]
        if size != src[i]:
            return found  # a merge: no dim is split here
        if j > start + 1 and dst[start] > 1:
            found.append((i, dst[start]))
        i, j = i + 1, j + 1
    return found


def _in_equal_blocks(actual) -> tuple:
    """``(placement, blocks)`` of a first input arriving sharded in one or more equal
    blocks (``Shard``, ``_StridedShard``), else ``(None, None)``."""
    p = actual[0] if actual else None
    if (isinstance(p, Shard) or is_blocked(p)) and not isinstance(blocks(p), tuple):
        return p, blocks(p)
    return None, None


def _expr(size):
    return sympy.Integer(size) if isinstance(size, int) else size.node.expr


def _same(a, b) -> bool:
    """Are two (possibly symbolic) sizes provably equal?"""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return sympy.expand(_expr(a) - _expr(b)) == 0


@functools.lru_cache(maxsize=4096)
def _ratio(a: sympy.Expr, b: sympy.Expr) -> sympy.Expr:
    """``a / b`` with common factors cancelled (a number where they are proportional)."""
    return sympy.cancel(a / b)


def _lt(a, b) -> bool:
    """``a < b`` for sizes that may be symbolic: by their ratio where it is a number (``u1``
    against ``4*u1``: a size known only from values has no hint to compare), else as torch
    decides it, else by their hints."""
    if not (isinstance(a, int) and isinstance(b, int)):
        ratio = _ratio(_expr(b), _expr(a))
        if ratio.is_number:
            return bool(ratio > 1)
    try:
        return bool(a < b)
    except Exception:  # noqa: BLE001 - symbolic sizes compare by hint
        return a.node.hint < b.node.hint


def _localize_unflatten(node, inputs, output, group):
    """``unflatten(dim, sizes)``: the sizes entry of a sharded output dim is local."""
    if not is_sharded(output):
        return node.target, node.args, node.kwargs
    dim = node.args[1] % _rank(node.args[0])
    sizes = list(node.args[2])
    k = output.dim - dim
    if 0 <= k < len(sizes) and sizes[k] != -1:
        sizes[k] = local_size(output, sizes[k], group)
    return node.target, (node.args[0], node.args[1], sizes) + tuple(node.args[3:]), node.kwargs


def _unfold_spec(node):
    """``unfold(dim, size, step)``: ``dim`` becomes the windows and a last dim of ``size``
    is added, neither sharded (a window may span shards); the other dims map as they are."""
    n = _rank(node.args[0])
    d = node.args[1] % n if n else 0
    labels = tuple(fixed_label() if j == d else f"d{j}" for j in range(n))
    return DimSpec((labels,), (labels + (fixed_label(),),), "sum")


def _diagonal_spec(node):
    """``diagonal(offset, dim1, dim2)``: the two dims become one last dim, never sharded;
    the other dims map as they are."""
    n = _rank(node.args[0])
    pair = {op_arg(node, 2, "dim1", 0) % n, op_arg(node, 3, "dim2", 1) % n}
    labels = tuple(fixed_label() if j in pair else f"d{j}" for j in range(n))
    return DimSpec((labels,), (tuple(lab for j, lab in enumerate(labels) if j not in pair)
                               + (fixed_label(),),), "sum")


def _dtype_view_spec(node):
    """``view(dtype)``: the same bytes read as another dtype; the last dim's length scales
    by the element sizes' ratio, so each element's words stay on its rank."""
    labels = _labels(_rank(node.args[0]))
    return DimSpec((labels,), (labels,))


def _unsqueeze_spec(node):
    n = _rank(node.args[0])
    d = node.args[1] % (n + 1)
    labels = _labels(n)
    return DimSpec((labels,), (labels[:d] + (fixed_label(),) + labels[d:],), "sum")


def _squeeze_spec(node):
    shape = val(node.args[0]).shape
    n = len(shape)
    dims = dims_arg(1, omitted="all")(node)
    drop = {d % n for d in dims if _is_one(shape[d % n])} if n else set()
    labels = tuple(fixed_label() if j in drop else f"d{j}" for j in range(n))
    return DimSpec((labels,), (tuple(lab for j, lab in enumerate(labels) if j not in drop),),
                   "sum")


def _local_squeeze(node, inputs, output, group):
    """A shard may have size 1 on a dim the global tensor does not: squeeze exactly the
    dims of size 1 globally."""
    if not is_sharded(inputs[0]):
        return node.target, node.args, node.kwargs
    shape = val(node.args[0]).shape
    n = len(shape)
    dims = sorted({d % n for d in dims_arg(1, omitted="all")(node) if _is_one(shape[d % n])})
    return aten.squeeze.dims, (node.args[0], dims), {}


def _expand_spec(node):
    """Dims expanded from size 1 (or prepended) appear in the output only: a rank may
    expand a replicated input straight to its shard of them (every slice along them is the
    same), its input's gradient then partial."""
    src, dst = val(node.args[0]).shape, val(node).shape
    off = len(dst) - len(src)
    kept = [j >= off and _same(src[j - off], dst[j]) for j in range(len(dst))]
    ins = tuple(f"d{off + j}" if kept[off + j] else fixed_label() for j in range(len(src)))
    outs = tuple(f"d{j}" if kept[j] else f"e{j}" for j in range(len(dst)))
    return DimSpec((ins,), (outs,), "sum")


def _repeat_spec(node):
    """``repeat(sizes)``: dims repeated once keep their sharding; tiled dims never shard."""
    src, reps = val(node.args[0]).shape, list(node.args[1])
    off = len(reps) - len(src)
    ins = tuple(f"d{off + j}" if reps[off + j] == 1 else fixed_label() for j in range(len(src)))
    outs = tuple(f"d{j}" if j >= off and reps[j] == 1 else fixed_label()
                 for j in range(len(reps)))
    return DimSpec((ins,), (outs,), "sum")


def _tiled_shard(node, world, actual=()):
    """``repeat`` of a dim arriving sharded (in ``k`` equal blocks, or one): each copy holds
    the blocks, so the result is cut in ``reps * k`` blocks, each sharded, and every rank
    repeats its pieces (DeBERTa tiles its head-sharded relative position keys over the
    batch, to meet its queries' batch-and-heads dim). Static sizes only."""
    p, cut = _in_equal_blocks(actual)
    if p is None:
        return
    src, reps = val(node.args[0]).shape, list(node.args[1])
    off = len(reps) - len(src)
    size, r = src[p.dim], reps[off + p.dim]
    if isinstance(size, int) and isinstance(r, int) and r > 1 and size % (cut * world) == 0:
        yield (p,), (cut_in_blocks(off + p.dim, [size // cut] * (r * cut)),)


def _cat_spec(node):
    tensors = [t for t in node.args[0] if is_tensor_node(t)]
    n = _rank(node)
    d = op_arg(node, 1, "dim", 0) % n
    label = lambda j: fixed_label() if j == d else f"d{j}"  # noqa: E731
    ins = tuple(tuple(label(j) for j in range(n)) if _rank(t) == n else (fixed_label(),)
                for t in tensors)
    return DimSpec(ins, (tuple(label(j) for j in range(n)),), "sum")


def _stack_spec(node):
    """``stack(tensors, dim)``: equal-shaped inputs share every dim; the new dim is fixed."""
    n = _rank(node) - 1
    d = op_arg(node, 1, "dim", 0) % (n + 1)
    labels = _labels(n)
    ins = tuple(labels for _ in tensor_inputs(node))
    return DimSpec(ins, (labels[:d] + (fixed_label(),) + labels[d:],), "sum")


def _split_spec(node):
    n = _rank(node.args[0])
    d = op_arg(node, 2, "dim", 0) % n
    labels = tuple(f"d{j}!" if j == d else f"d{j}" for j in range(n))
    return DimSpec((labels,), tuple(labels for _ in output_vals(node)), "sum")


def _unbind_spec(node):
    n = _rank(node.args[0])
    d = op_arg(node, 1, "dim", 0) % n
    labels = tuple(f"d{j}!" if j == d else f"d{j}" for j in range(n))
    out = tuple(lab for j, lab in enumerate(labels) if j != d)
    return DimSpec((labels,), tuple(out for _ in output_vals(node)), "sum")


def _blocked_parts(node, world, actual=()):
    """A split into parts each divisible by ``world`` is served by the input cut in those
    blocks, each sharded (``_StridedShard(d, k)`` for k equal parts, ``BlockShard`` for
    unequal ones: gpt-fast's ``[dim, kv, kv]``): every output is ``Shard(d)``, computed by
    splitting the local shard into local sizes. ``chunk`` takes equal parts only (its
    local form counts parts)."""
    d = op_arg(node, 2, "dim", 0) % _rank(node.args[0])
    parts = [v.shape[d] for v in output_vals(node)]
    if len(parts) < 2 or not all(isinstance(p, int) and p % world == 0 for p in parts):
        return
    if len(set(parts)) == 1 or node.target is not aten.chunk.default:
        yield (cut_in_blocks(d, parts),), (Shard(d),) * len(parts)


def _local_split(node, inputs, output, group):
    """Split sizes of an input blocked on the split dim are this rank's sizes (``chunk``
    counts parts; an input blocked on another dim splits as is)."""
    d = op_arg(node, 2, "dim", 0) % _rank(node.args[0])
    if not is_blocked(inputs[0]) or inputs[0].dim != d or node.target is aten.chunk.default:
        return node.target, node.args, node.kwargs
    sizes = node.args[1]
    local = [s // group.world for s in sizes] if isinstance(sizes, (list, tuple)) else \
        sizes // group.world
    return node.target, (node.args[0], local) + tuple(node.args[2:]), node.kwargs


def _fixed_dim_spec(dim_index: int, drop: bool = False, default: int = 0):
    """Ops that act on one dim given by argument ``dim_index`` (slice, select, narrow, flip,
    roll, index_select's dim): it never shards; ``drop`` removes it from the output."""
    def spec(node):
        n = _rank(node.args[0])
        dims = dims_arg(dim_index, omitted="all")(node) if default is None else \
            [op_arg(node, dim_index, "dim", default)]
        fixed = {d % n for d in dims}
        labels = tuple(f"d{j}!" if j in fixed else f"d{j}" for j in range(n))
        out = tuple(lab for j, lab in enumerate(labels) if not (drop and j in fixed))
        return DimSpec((labels,) + (None,) * (len(tensor_inputs(node)) - 1), (out,), "sum")
    return Rule(spec)


def _slice_args(node):
    """``(dim, size, start, end, step)`` of a slice with static bounds, clamped into the
    dim, else ``None``."""
    x = val(node.args[0])
    d = op_arg(node, 1, "dim", 0) % x.dim()
    size, step = x.shape[d], op_arg(node, 4, "step", 1)
    start, end = op_arg(node, 2, "start", None), op_arg(node, 3, "end", None)
    start, end = 0 if start is None else start, size if end is None else end
    if not all(isinstance(v, int) for v in (size, start, end, step)):
        return None
    start, end = (min(max(v + size if v < 0 else v, 0), size) for v in (start, end))
    return d, size, start, end, step


def _slice_bounds(node):
    """``(dim, start, end)`` of a step-1 slice with static bounds inside the dim, else
    ``None``."""
    args = _slice_args(node)
    if args is None or args[4] != 1:
        return None
    d, _, start, end, _ = args
    return d, start, end


def _blocked_slice(node, world, actual=()):
    """A slice that is one block of its dim, each block divisible by ``world``, is served
    by the input cut in those blocks, each sharded, like a split: the output is
    ``Shard(d)``. The blocks are the input's when it arrives blocked and the slice is one
    of them, else the slice's own: before, the slice, after (Phi-3's fused
    ``qkv[..., q:q + kv]``; :mod:`fxtp.passes.strided` merges the cuts of all slices of
    one value)."""
    bounds = _slice_bounds(node)
    if bounds is None:
        return
    d, start, end = bounds
    size, part = val(node.args[0]).shape[d], end - start
    if not 0 < part < size:
        return
    have = actual[0] if actual else None
    if is_blocked(have) and have.dim == d and (start, end) in block_bounds(have, size):
        yield (have,), (Shard(d),)
        return
    cut = [b for b in (start, part, size - end) if b]
    if all(b % world == 0 for b in cut):
        yield (cut_in_blocks(d, cut),), (Shard(d),)


def _strided_slice(node, world, actual=()):
    """A slice taking every ``step``-th element of a whole dim from an offset below
    ``step`` (``x[..., ::2]``, ``x[..., 1::2]``: gpt-oss's interleaved gate and up) keeps
    that dim sharded where each rank's equal shard is a multiple of ``step``: every shard
    starts at a multiple of ``step``, so its own slice is its contiguous, equal part of the
    result."""
    args = _slice_args(node)
    if args is None:
        return
    d, size, start, end, step = args
    if step > 1 and start < step and end == size and size % (world * step) == 0:
        yield (Shard(d),), (Shard(d),)


def _sliced(node, world, actual=()):
    """The slice strategies beyond the spec's: blocked and strided."""
    yield from _blocked_slice(node, world, actual)
    yield from _strided_slice(node, world, actual)


def _local_slice(node, inputs, output, group):
    """A slice of an input blocked on the sliced dim takes this rank's piece of the block:
    local bounds (blocked on another dim, it slices as is)."""
    bounds = _slice_bounds(node)
    if not is_blocked(inputs[0]) or bounds is None or bounds[0] != inputs[0].dim:
        return node.target, node.args, node.kwargs
    d, start, end = bounds
    return node.target, (node.args[0], d, start // group.world, end // group.world), {}


def _mean_of_shard(dims_of):
    """A mean over a sharded dim: each rank's mean of its shard, scaled by its share of
    that dim (``1 / world`` for equal shards), is its Partial contribution (OLMo-2
    normalizes q and k over all heads)."""
    def local(node, inputs, output, group):
        p = inputs[0]
        n = _rank(node.args[0])
        if not (is_sharded(p) and p.dim in {d % n for d in dims_of(node)}):
            return node.target, node.args, node.kwargs
        dim = None if node.target is aten.mean.default else op_arg(node, 1, "dim")
        share = (local_size(p, val(node.args[0]).shape[p.dim], group),
                 val(node.args[0]).shape[p.dim]) if isinstance(p, UnitShard) else \
            (1, group.world)
        return mean_of_shard, (node.args[0], *share), dict(
            dim=dim, keepdim=op_arg(node, 2, "keepdim", False), dtype=node.kwargs.get("dtype"))
    return local


def _diff_spec(node):
    """``diff(x, n, dim, prepend, append)``: ``dim`` never shards; ``prepend`` / ``append``
    shard with ``x`` on the other dims."""
    n = _rank(node.args[0])
    d = op_arg(node, 2, "dim", -1) % n
    labels = tuple(f"d{j}!" if j == d else f"d{j}" for j in range(n))
    return DimSpec(tuple(labels for _ in tensor_inputs(node)), (labels,))


def _pad_spec(node):
    """``constant_pad_nd(x, pad, value)`` / ``pad(x, pad, mode, value)``: padded (trailing)
    dims never shard (a pad of symbolic size counts as one); a nonzero constant fill would
    be added once per rank to a Partial value, so only zero padding and the modes that
    copy elements (reflect, replicate, circular) pass it."""
    n, pads = _rank(node.args[0]), list(node.args[1])
    padded = {n - 1 - k // 2 for k, p in enumerate(pads) if not (isinstance(p, int) and p == 0)}
    labels = tuple(f"d{j}!" if j in padded else f"d{j}" for j in range(n))
    if node.target is aten.pad.default:
        mode, fill = op_arg(node, 2, "mode", "constant"), op_arg(node, 3, "value", None)
    else:
        mode, fill = "constant", op_arg(node, 2, "value", 0)
    return DimSpec((labels,), (labels,), "sum" if mode != "constant" or not fill else "none")


def _shifted_diagonal(node, inputs, output, group):
    """``tril`` / ``triu`` of a shard: element ``(i, j)`` is kept by comparing ``j - i``
    with the diagonal, so a shard whose rows start at global row ``o`` shifts the diagonal
    by ``+o``, one whose columns start at ``o`` by ``-o``: both trailing dims may shard."""
    p = inputs[0]
    n = _rank(node.args[0])
    if not is_sharded(p) or p.dim < n - 2:
        return node.target, node.args, node.kwargs
    offset = _start(p, val(node.args[0]), group)
    shift = offset if p.dim == n - 2 else -offset
    return node.target, (node.args[0], op_arg(node, 1, "diagonal", 0) + shift), {}


def _start(p, value, group) -> int:
    """The global index of this rank's first element along ``p``'s (sharded) dim."""
    return local_range(p, value.shape[p.dim], group.rank, group.world)[0]


def _tri_spec(node):
    labels = _labels(_rank(node.args[0]))
    return DimSpec((labels,), (labels,), "sum")


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


def _baddbmm_spec(node):
    bias = " ".join("b m n".split()[3 - _rank(node.args[0]):])
    return parse(f"{bias}, b m k!, b k! n -> b m n", _ranks(node))


def _matmul_spec(node):
    ra, rb = _ranks(node)
    a = "... m k+" if ra >= 2 else "k+"
    b = "... k+ n" if rb >= 2 else "k+"
    out = ("... m" if ra >= 2 else "...") + (" n" if rb >= 2 else "")
    if ra >= 2 and rb >= 2 and ra != rb:  # broadcast batch: only the larger side's batch
        small = "m k+" if ra < rb else "k+ n"
        a, b = (small, b) if ra < rb else (a, small)
    return parse(f"{a}, {b} -> {out}", [ra, rb], partial="product")


def _convolution_spec(node):
    """``aten.convolution``: input ``(N, C, *spatial)``, weight ``(O, C / groups,
    *kernel)``. The batch shards; with one group also the output channels (colwise) and,
    without a bias, the input channels (a Partial sum). Spatial dims stay whole (a shard
    would need its neighbours' edges); a transposed convolution shards the batch only, a
    grouped one also by whole groups (:func:`_grouped_convolution`)."""
    ranks = _ranks(node)
    spatial, kernel = " _" * (ranks[0] - 2), " _" * (ranks[1] - 2)
    bias = len(ranks) == 3
    if op_arg(node, 6, "transposed", False) or op_arg(node, 8, "groups", 1) != 1:
        return parse(f"n _{spatial}, _ _{kernel}{', _' if bias else ''} -> n _{spatial}",
                     ranks)
    if bias:
        return parse(f"n c!{spatial}, o c!{kernel}, o -> n o{spatial}", ranks)
    return parse(f"n c+{spatial}, o c+{kernel} -> n o{spatial}", ranks, partial="product",
                 partial_args=(0, 1))


def planes(spatial: int, linear: bool = True, grid: bool = False):
    """Ops on ``(*, C, *spatial)`` planes, each channel of each sample on its own
    (resampling, pooling, reflection and replication padding, pixel shuffles): every
    leading dim shards (the batch, the channels, a pixel shuffle's channels in matching
    chunks), the ``spatial`` last ones never do (an output point reads its neighbours).
    ``linear`` in the first input: Partial passes through it. Further tensor inputs: laid
    out as the first (``max_unpool``'s indices), or ``grid`` (``grid_sample``'s ``(N,
    *out, k)`` points, sharing the batch only)."""
    def spec(node):
        lead = _labels(_rank(node.args[0]) - spatial)
        def whole(k):
            return tuple(fixed_label() for _ in range(k))
        ins = [lead + whole(spatial)]
        for arg in tensor_inputs(node)[1:]:
            ins.append(lead[:1] + whole(_rank(arg) - 1) if grid else lead + whole(spatial))
        outs = tuple(lead + whole(out.dim() - len(lead)) for out in output_vals(node))
        return DimSpec(tuple(ins), outs, "sum" if linear else "none",
                       (0,) if linear else None)
    return Rule(spec)


def _grouped_convolution(node, world, actual=()):
    """A grouped convolution whose groups divide by the world size, on channel shards: each
    rank convolves whole groups, its channels of the input, the weight and the bias
    (Mamba's and ConvNeXt's depthwise convolutions); the local op takes ``groups /
    world`` (:func:`_local_groups`)."""
    groups = op_arg(node, 8, "groups", 1)
    if op_arg(node, 6, "transposed", False) or not isinstance(groups, int) or groups == 1 \
            or groups % world:
        return
    yield (Shard(1), Shard(0)) + (Shard(0),) * (len(tensor_inputs(node)) - 2), (Shard(1),)


_GROUPED_MM = "s! k+, _ k+ n, _ -> s! n"
"""A grouped matmul of rows grouped by expert (``offs``: each group's end) by a stack of
expert weights: row i of group e times weight[e]. The rows and the experts stay whole, as
the grouping needs."""


def _grouped_mm_spec(node):
    """``torch._grouped_mm`` in the form mixture-of-experts layers use (2-D rows, 3-D
    weights, offsets); its other forms keep every dim whole (a gather, reported)."""
    ranks = _ranks(node)
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
            elif _is_one(size):
                out.append(fixed_label())
            else:
                out.append(c if c in out_letters else c + "+")
        return tuple(out)
    ins = tuple(labels(t, val(a).shape) for t, a in zip(terms, operands))
    out_shape = val(node).shape
    out = labels(rhs, out_shape)
    return DimSpec(ins, (out,), "product")


def _norm_spec(node):
    """``layer_norm`` / ``rms_norm`` (and ``native_layer_norm``'s mean and rstd, shaped
    (batch..., 1...)): normalized trailing dims never shard, batch dims do."""
    k = len(node.args[1])
    n = _rank(node.args[0])
    x = tuple(f"d{j}!" if j >= n - k else f"d{j}" for j in range(n))
    params = tuple(x[n - k:] for _ in tensor_inputs(node)[1:])
    outs = [x]
    for v in output_vals(node)[1:]:
        outs.append(x[:n - k] + tuple(fixed_label() for _ in range(v.dim() - (n - k))))
    return DimSpec((x,) + params, tuple(outs))


def _group_norm_spec(node):
    """``group_norm(x (N, C, *), groups, weight, bias)``: the batch dim shards; channels by
    :func:`_whole_groups`."""
    n = _rank(node.args[0])
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


def _local_groups(index: int):
    """The local op of an op of groups of channels (its argument ``index``: the number of
    groups) taking channel shards of whole groups: this rank's number of groups."""
    def local(node, inputs, output, group):
        if inputs[0] != Shard(1) or node.args[index] == 1:  # one group: a Partial sum's
            return node.target, node.args, node.kwargs
        args = list(node.args)
        args[index] //= group.world
        return node.target, tuple(args), node.kwargs
    return local


def _batch_norm_spec(training_arg: Optional[int]):
    """``batch_norm`` / ``native_batch_norm(x (N, C, *), weight, bias, running_mean,
    running_var, training, ...)`` and the eval form: channels are independent, so the
    channel dim shards with every per-channel tensor (the running statistics it updates
    included) and the saved per-channel statistics; the batch and spatial dims, which
    statistics are taken over in training, never shard then (in eval, given
    ``training_arg`` None, they shard freely)."""
    def spec(node):
        n = _rank(node.args[0])
        training = training_arg is not None and op_arg(node, training_arg, "training", True)
        x = tuple("c" if j == 1 else f"d{j}!" if training else f"d{j}" for j in range(n))
        params = tuple(("c",) for _ in tensor_inputs(node)[1:])
        outs = [x] + [("c",) if getattr(v, "shape", None) == val(node.args[0]).shape[1:2]
                      else tuple(fixed_label() for _ in range(v.dim()))
                      if isinstance(v, torch.Tensor) else None
                      for v in output_vals(node)[1:]]
        return DimSpec((x,) + params, tuple(outs))
    return Rule(spec)


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
        specs.append(("b" if _same(x.shape[0], b) and not _is_one(b) else fixed_label(),
                      "h" if _same(x.shape[1], h) and not _is_one(h) else fixed_label()) +
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


def _broadcast_labels(shape, full):
    """Labels of a tensor broadcast against dims labelled ``full`` (size-1 dims fixed)."""
    off = len(full) - len(shape)
    return tuple(fixed_label() if _is_one(shape[j]) else full[off + j] for j in range(len(shape)))


def _embedding_spec(node):
    """A vocab-sharded table gives Partial rows (see :func:`_vocab_parallel`)."""
    return parse("v+ d, ... -> ... d", _ranks(node), partial="product", partial_args=(0,))


def _vocab_parallel(node, inputs, output, group):
    if not (isinstance(inputs[0], (Shard, UnitShard)) and inputs[0].dim == 0):
        return node.target, node.args, node.kwargs
    weight, indices = node.args[:2]
    offset = _start(inputs[0], val(weight), group)
    return vocab_parallel_embedding, (weight, indices, offset,
                                      op_arg(node, 2, "padding_idx", -1)), {}


def _dropout(node, inputs, output, group):
    """Dropout of a shard draws the whole mask and keeps this rank's part of it, a chunk or
    one per block (see :func:`~fxtp.passes.local_ops.sharded_dropout`); of a replicated
    value, the same mask on every rank (all ranks' generators are in step), which also
    drops the same elements of every rank's part of a partial sum."""
    if not is_sharded(inputs[0]):
        return node.target, node.args, node.kwargs
    x, p, train = node.args[0], op_arg(node, 1, "p"), op_arg(node, 2, "train")
    d, size = inputs[0].dim, val(x).shape[inputs[0].dim]
    if is_blocked(inputs[0]):
        pieces = [(a + start, length) for a, b in block_bounds(inputs[0], size)
                  for start, length in [local_range(inputs[0], b - a, group.rank,
                                                    group.world)]]
    else:
        pieces = [local_range(inputs[0], size, group.rank, group.world)]
    return sharded_dropout, (x, p, train, d, pieces, size), {}


def _same_dims(node):
    """Every dim of the input maps to the same dim of the output, whose size may be a
    multiple of it (``repeat_interleave`` along a dim keeps contiguous blocks together).
    Without a dim the input is flattened first: only its leading dim maps, to the 1-d output."""
    labels = _labels(_rank(node.args[0]))
    if op_arg(node, 2, "dim") is None:
        labels = labels[:1] + tuple(fixed_label() for _ in labels[1:])
        return DimSpec((labels,), (labels[:1] or (fixed_label(),),), "sum")
    return DimSpec((labels,), (labels,), "sum")


def _complex_view_spec(node):
    """``view_as_complex`` folds the trailing (re, im) dim away; ``view_as_real`` adds it."""
    n_in, n_out = _rank(node.args[0]), _rank(node)
    labels = _labels(min(n_in, n_out))
    pair = (fixed_label(),)
    return DimSpec((labels + pair if n_in > n_out else labels,),
                   (labels + pair if n_out > n_in else labels,), "sum")


def _factory(node):
    """Factories (``new_zeros``, ``zeros``): read only their input's metadata, if any, and
    fill the output uniformly (or leave it uninitialized), so it may be made in any
    placement; with no input to follow, Replicate unless a written value's placement is
    pinned on it (:mod:`fxtp.passes.buffers`)."""
    return DimSpec((None,) * len(tensor_inputs(node)),
                   (tuple(f"f{i}" for i in range(_rank(node))),))


# --- indexing and scatter -------------------------------------------------------------------

def _index_layout(self_labels, indices):
    """Labels of ``self[indices]`` (advanced indexing; ``indices`` has ``None`` for dims
    taken whole): the index tensors' broadcast dims (never sharded) replace the indexed
    dims, in place when those are adjacent, else in front."""
    pos = [i for i, ix in enumerate(indices) if ix is not None]
    index_rank = max(_rank(ix) for ix in indices if ix is not None)
    index_dims = tuple(fixed_label() for _ in range(index_rank))
    kept = [lab for i, lab in enumerate(self_labels) if i not in pos]
    if pos == list(range(pos[0], pos[-1] + 1)):
        return tuple(kept[:pos[0]]) + index_dims + tuple(kept[pos[0]:])
    return index_dims + tuple(kept)


def _index_spec(node):
    """``x[indices]`` (``aten.index.Tensor``): dims not indexed shard; linear in ``x``."""
    n = _rank(node.args[0])
    indices = list(node.args[1])
    if any(ix is not None and val(ix).dtype == torch.bool for ix in indices):
        labels = tuple(fixed_label() for _ in range(n))
        return DimSpec((labels,) + tuple(_fixed(ix) for ix in indices if ix is not None),
                       (tuple(fixed_label() for _ in range(_rank(node))),))
    labels = _labels(n)
    out = _index_layout(labels, indices)
    return DimSpec((labels,) + tuple(_fixed(ix) for ix in indices if ix is not None), (out,),
                   "product", (0,))


def _fixed(node) -> tuple:
    return tuple(fixed_label() for _ in range(_rank(node)))


def _index_put_spec(node):
    """``x[indices] = values`` (``index_put`` / ``index_put_``): dims not indexed shard
    with the matching dims of ``values`` (broadcast size-1 dims fixed). Jointly linear in
    ``x`` and ``values``. Indexed dims of ``x`` never shard (the indices are global), but
    for one boolean mask over ``x``'s leading dims and a single value (``h[h > t] = t``):
    a masked fill, sharded as ``x`` is with the mask alike."""
    n = _rank(node.args[0])
    indices = list(node.args[1])
    values = val(node.args[2])
    if len(indices) == 1 and indices[0] is not None and val(indices[0]).dtype == torch.bool \
            and values.numel() == 1:  # x[mask] = v: a masked fill, elementwise
        labels = _labels(n)
        return DimSpec((labels, labels[:_rank(indices[0])], (fixed_label(),) * values.dim()),
                       (labels,), "sum", (0, 2))
    labels = tuple(fixed_label() if j < len(indices) and indices[j] is not None else f"d{j}"
                   for j in range(n))
    if any(ix is not None and val(ix).dtype == torch.bool for ix in indices):
        labels = tuple(fixed_label() for _ in range(n))
        target = labels
    else:
        target = _index_layout(labels, indices)
    values_labels = _broadcast_labels(values.shape, list(target))
    ins = (labels,) + tuple(_fixed(ix) for ix in indices if ix is not None) + (values_labels,)
    return DimSpec(ins, (labels,), "sum", (0, len(ins) - 1))


def _index_select_spec(node):
    """``index_select(x, dim, index)``: ``dim`` never shards; linear in ``x``."""
    n = _rank(node.args[0])
    d = node.args[1] % n if n else 0
    labels = tuple(f"d{j}!" if j == d else f"d{j}" for j in range(n))
    return DimSpec((labels, _fixed(node.args[2])), (labels,), "product", (0,))


def _index_update_spec(partial: str):
    """``index_copy / index_add / index_fill(x, dim, index, [source])``: ``dim`` never
    shards; the other dims shard with the source's. ``partial="sum"``: jointly linear in
    ``x`` and the source."""
    def spec(node):
        n = _rank(node.args[0])
        d = node.args[1] % n if n else 0
        labels = tuple(f"d{j}!" if j == d else f"d{j}" for j in range(n))
        ins = [labels, _fixed(node.args[2])]
        ins += [labels if _rank(t) == n else _fixed(t) for t in tensor_inputs(node)[2:]]
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
        shard = {j for j in range(n) if j != d and all(_same(s[j], x.shape[j]) for s in shapes)}
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
    start = _start(inputs[0], val(x), group)
    if node.target is aten.select.int:
        return select_of_shard, (x, d, node.args[2] % val(x).shape[d], start), {}
    pick = gather_of_shard if node.target is aten.gather.default else index_select_of_shard
    return pick, (x, d, node.args[2], start), {}


# --- the table ----------------------------------------------------------------------------

_SCALAR_LINEAR = {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar,
                  aten.mul_.Scalar, aten.div_.Scalar, aten.mul_.Tensor, aten.div_.Tensor}

LINEAR_POINTWISE = [
    aten.neg.default, aten.neg_.default, aten.clone.default, aten.alias.default,
    aten.detach.default, aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout,
    aten.to.device, aten.lift_fresh_copy.default, aten.contiguous.default,
    aten.positive.default, aten.mul.Scalar, aten.mul_.Scalar, aten.div.Scalar,
    aten.div_.Scalar, aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor, aten.sub_.Tensor,
    aten.zeros_like.default, aten.zero_.default, aten.real.default, aten.imag.default,
    aten.conj.default, aten._conj.default, aten.copy_.default,
    aten.copy.default,
]
"""Pointwise ops linear in all their tensor operands jointly: Partial in, Partial out."""

NONLINEAR_POINTWISE = [
    aten.masked_fill.Tensor, aten.masked_fill_.Tensor, aten.ones_like.default,
    aten.full_like.default, aten.empty_like.default, aten.fill_.Scalar, aten.fill_.Tensor,
    aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar, aten.__and__.Tensor,
    aten.__or__.Tensor, aten.__xor__.Tensor,
]
"""Elementwise ops torch does not tag ``pointwise`` (0-d operands, scalar forms, the
Python operator aliases of the bitwise ops; Hugging Face's mask code uses them)."""

RULES: dict = {op: pointwise("sum") for op in LINEAR_POINTWISE}
RULES.update({op: pointwise() for op in NONLINEAR_POINTWISE})

_LINEAR_POINTWISE = pointwise("sum")
_LIKE = {aten.zeros_like.default: aten.new_zeros.default,
         aten.ones_like.default: aten.new_ones.default,
         aten.full_like.default: aten.new_full.default,
         aten.empty_like.default: aten.new_empty.default}
"""``*_like`` ops -> the factory that makes their result from a shape."""


def _whole_like(node: fx.Node, world: int, actual=()):
    """A ``*_like`` op of a sharded or partial tensor of static shape may give its result
    whole: only the input's metadata is read, not its values."""
    if not actual or isinstance(actual[0], Replicate) or \
            not all(isinstance(n, int) for n in val(node).shape):
        return
    if any(ins[0] == actual[0] for ins, _ in _LINEAR_POINTWISE.strategies(node, world, actual)):
        yield (actual[0],), (R,)  # a layout the input can have


def _like_of_whole(node, inputs, output, group):
    """The whole result from the factory, at the global shape (the shard is not read)."""
    if isinstance(inputs[0], Replicate) or not isinstance(output, Replicate):
        return node.target, node.args, node.kwargs
    kwargs = {k: v for k, v in node.kwargs.items() if k != "memory_format"}
    return _LIKE[node.target], (node.args[0], list(val(node).shape), *node.args[1:]), kwargs


RULES.update({op: replace(RULES[op], extra=_whole_like, local_op=_like_of_whole)
              for op in _LIKE})
_ADDS = {aten.add.Tensor: False, aten.add_.Tensor: False, aten.sub.Tensor: True,
         aten.sub_.Tensor: True}
"""Adds and subtractions -> whether they subtract."""


def replicated_into_partial(target, ins, outs) -> Optional[int]:
    """Under the strategy ``ins -> outs`` of an add or subtraction, the index of its
    replicated operand added into the other's partial sum (on one rank:
    :func:`~fxtp.passes.local_ops.add_replicated_once`), whose gradient is then whole on
    every rank, not partial; else ``None``."""
    if target not in _ADDS or len(ins) != 2 or not isinstance(outs[0], Partial):
        return None
    partial = [isinstance(p, Partial) for p in ins]
    return partial.index(False) if sum(partial) == 1 and \
        isinstance(ins[partial.index(False)], Replicate) else None


def _into_partial(node: fx.Node, world: int, actual=()):
    """On an add marked ``meta[INTO_PARTIAL]`` (by :mod:`~fxtp.passes.unpin`, which leaves
    partial sums unreduced; elsewhere reducing first costs as much and keeps the plan's
    layouts): ``(R, P) -> P`` and ``(P, R) -> P``, where the partial operand has the
    output's shape (a sum is not broadcast to more elements) and this op alone reads it (a
    value another op needs reduced is reduced once, for both), and the other arrives
    replicated (``actual``; never gathered for it). The replicated value is added into the
    partial sum; in place, into a partial ``self`` only."""
    inputs = tensor_inputs(node)
    if not node.meta.get(INTO_PARTIAL) or len(inputs) != 2 or inputs[0] is inputs[1]:
        return
    out = val(node).shape
    for i in (0,) if writes_first_input(node.target) else (0, 1):
        shape = val(inputs[i]).shape
        if len(shape) == len(out) and all(map(_same, shape, out)) and \
                len(inputs[i].users) == 1 and (not actual or isinstance(actual[1 - i], Replicate)):
            yield (P, R) if i == 0 else (R, P), (P,)


def _added_once(node: fx.Node, inputs, output, group):
    replicated = replicated_into_partial(node.target, inputs, (output,))
    if replicated is None:
        return node.target, node.args, node.kwargs
    return add_replicated_once, (*node.args[:2], node.kwargs.get("alpha", 1),
                                 _ADDS[node.target], replicated, group.rank == 0,
                                 writes_first_input(node.target)), {}


RULES.update({op: replace(RULES[op], extra=_into_partial, local_op=_added_once)
              for op in _ADDS})
RULES.update({
    # pointwise with a Partial pass-through in one operand
    aten.mul.Tensor: pointwise("product"),
    aten.mul_.Tensor: pointwise("product"),
    aten.div.Tensor: pointwise("product", partial_args=(0,)),
    aten.div_.Tensor: pointwise("product", partial_args=(0,)),
    aten.type_as.default: pointwise("sum", unread=(1,)),
    aten.to.other: pointwise("sum", unread=(1,)),
    aten.dropout.default: Rule(lambda node: replace(pointwise().spec(node), partial="sum"),
                               local_op=_dropout),
    aten.tril.default: Rule(_tri_spec, local_op=_shifted_diagonal, strided=False),
    aten.triu.default: Rule(_tri_spec, local_op=_shifted_diagonal, strided=False),
    # matrix products
    aten.convolution.default: Rule(_convolution_spec, local_op=_local_groups(8),
                                   extra=_grouped_convolution),
    aten.linear.default: Rule(_linear_spec),
    # planes of (*, C, *spatial): resampled, pooled, padded per channel
    **{op: planes(1) for op in (aten.upsample_nearest1d.default,
                                aten._upsample_nearest_exact1d.default,
                                aten.upsample_linear1d.default, aten.reflection_pad1d.default,
                                aten.replication_pad1d.default)},
    **{op: planes(2) for op in (aten.upsample_nearest2d.default,
                                aten._upsample_nearest_exact2d.default,
                                aten.upsample_bilinear2d.default, aten.upsample_bicubic2d.default,
                                aten._upsample_bilinear2d_aa.default,
                                aten._upsample_bicubic2d_aa.default, aten.avg_pool2d.default,
                                aten._adaptive_avg_pool2d.default, aten.reflection_pad2d.default,
                                aten.replication_pad2d.default, aten.pixel_shuffle.default,
                                aten.pixel_unshuffle.default, aten.max_unpool2d.default)},
    **{op: planes(3) for op in (aten.upsample_nearest3d.default,
                                aten._upsample_nearest_exact3d.default,
                                aten.upsample_trilinear3d.default, aten.avg_pool3d.default,
                                aten._adaptive_avg_pool3d.default, aten.reflection_pad3d.default,
                                aten.replication_pad3d.default, aten.max_unpool3d.default)},
    aten.max_pool2d_with_indices.default: planes(2, linear=False),
    aten.adaptive_max_pool2d.default: planes(2, linear=False),
    aten.max_pool3d_with_indices.default: planes(3, linear=False),
    aten.adaptive_max_pool3d.default: planes(3, linear=False),
    aten.grid_sampler_2d.default: planes(2, grid=True),
    aten.grid_sampler_3d.default: planes(3, grid=True),
    aten.matmul.default: Rule(_matmul_spec),
    aten.addmm.default: Rule(_addmm_spec),
    aten.baddbmm.default: Rule(_baddbmm_spec),
    aten.mm.default: einsum("m k+, k+ n -> m n", "product"),
    aten._grouped_mm.default: Rule(_grouped_mm_spec),
    aten.bmm.default: einsum("b m k+, b k+ n -> b m n", "product"),
    aten.einsum.default: Rule(_einsum_spec),
    aten.embedding.default: Rule(_embedding_spec, local_op=_vocab_parallel, strided=False),
    # attention and losses
    aten.scaled_dot_product_attention.default: Rule(_sdpa_spec, extra=_grouped_kv_heads),
    aten._scaled_dot_product_flash_attention_for_cpu.default: Rule(_sdpa_spec),
    aten._scaled_dot_product_flash_attention.default: Rule(_sdpa_spec),
    aten._scaled_dot_product_efficient_attention.default: Rule(_sdpa_spec),
    aten._scaled_dot_product_cudnn_attention.default: Rule(_sdpa_spec),
    aten._scaled_dot_product_attention_math.default: Rule(_sdpa_spec),
    torch.ops.higher_order.flex_attention: Rule(_flex_spec, local_op=_flex_global_heads,
                                                strided=False, units=False),
    aten.cross_entropy_loss.default: Rule(cross_entropy_spec, local_op=loss_parallel,
                                          extra=cross_entropy_strategies, communicates=True),
    aten.nll_loss_nd.default: Rule(cross_entropy_spec, local_op=nll_on_classes,
                                   extra=class_sharded),
    # normalizations
    aten.layer_norm.default: Rule(_norm_spec, **_parts(layer_norm_rule_parts())),
    aten.rms_norm.default: Rule(_norm_spec),
    aten.native_layer_norm.default: Rule(_norm_spec),
    aten._fused_rms_norm.default: Rule(_norm_spec),
    aten.group_norm.default: Rule(_group_norm_spec, extra=_whole_groups, local_op=_local_groups(1),
                                  strided=False, units=False),
    aten.batch_norm.default: _batch_norm_spec(training_arg=5),
    aten.native_batch_norm.default: _batch_norm_spec(training_arg=5),
    aten._native_batch_norm_legit_no_training.default: _batch_norm_spec(training_arg=None),
    # along a dim
    aten.softmax.int: softmax(),
    aten._softmax.default: softmax(),
    aten._safe_softmax.default: softmax(),
    aten.log_softmax.int: softmax(),
    aten._log_softmax.default: softmax(),
    aten.cumsum.default: replace(along(dims_arg(1), partial="sum"), **_parts(scan_rule_parts())),
    aten.cumsum_.default: along(dims_arg(1), partial="sum"),
    aten.cumprod.default: along(dims_arg(1)),
    aten.logcumsumexp.default: along(dims_arg(1)),
    aten.cummax.default: along(dims_arg(1)),
    aten.cummin.default: along(dims_arg(1)),
    aten.sort.default: along(dims_arg(1, omitted="last")),
    aten.sort.stable: along(dims_arg(2, omitted="last")),
    aten.argsort.default: along(dims_arg(1, omitted="last")),
    aten.argsort.stable: along(dims_arg(2, omitted="last")),
    aten.topk.default: replace(along(dims_arg(2, omitted="last")), **_parts(topk_rule_parts())),
    aten.diff.default: Rule(_diff_spec),
    # reductions
    aten.sum.default: reduction(ALL_DIMS, summed=True, partial="sum",
                                keepdim_arg=None),
    aten.sum.dim_IntList: reduction(dims_arg(1, omitted="all"), summed=True, partial="sum"),
    aten.nansum.default: reduction(dims_arg(1, omitted="all"), summed=True, partial="sum"),
    aten.mean.default: Rule(reduction(ALL_DIMS, summed=True, partial="sum", keepdim_arg=None)
                            .spec, local_op=_mean_of_shard(ALL_DIMS)),
    aten.mean.dim: Rule(reduction(dims_arg(1, omitted="all"), summed=True, partial="sum").spec,
                        local_op=_mean_of_shard(dims_arg(1, omitted="all"))),
    aten.prod.default: reduction(ALL_DIMS, keepdim_arg=None),
    aten.prod.dim_int: reduction(dims_arg(1)),
    aten.amax.default: extremum(largest=True),
    aten.amin.default: extremum(largest=False),
    aten.max.default: extremum(largest=True),
    aten.min.default: extremum(largest=False),
    aten.max.dim: pick(largest=True, values=True),
    aten.min.dim: pick(largest=False, values=True),
    aten.argmax.default: pick(largest=True, values=False),
    aten.argmin.default: pick(largest=False, values=False),
    aten.any.default: logical(ALL_DIMS, every=False, keepdim_arg=None),
    aten.any.dim: logical(dims_arg(1), every=False),
    aten.any.dims: logical(dims_arg(1, omitted="all"), every=False),
    aten.all.default: logical(ALL_DIMS, every=True, keepdim_arg=None),
    aten.all.dim: logical(dims_arg(1), every=True),
    aten.all.dims: logical(dims_arg(1, omitted="all"), every=True),
    aten.logsumexp.default: replace(reduction(dims_arg(1)),
                                    **_parts(reduction_rule_parts("logsumexp"))),
    aten.var.correction: reduction(dims_arg(1, omitted="all"), keepdim_arg=3),
    aten.std.correction: reduction(dims_arg(1, omitted="all"), keepdim_arg=3),
    aten.var_mean.correction: reduction(dims_arg(1, omitted="all"), keepdim_arg=3),
    aten.std_mean.correction: reduction(dims_arg(1, omitted="all"), keepdim_arg=3),
    aten.var.dim: reduction(dims_arg(1, omitted="all"), keepdim_arg=3),
    aten.std.dim: reduction(dims_arg(1, omitted="all"), keepdim_arg=3),
    aten.linalg_vector_norm.default: vector_norm(),
    aten.norm.ScalarOpt_dim: vector_norm(),
    aten.count_nonzero.dim_IntList: reduction(dims_arg(1, omitted="all"), keepdim_arg=None),
    aten.count_nonzero.default: reduction(dims_arg(1, omitted="all"), keepdim_arg=None),
    aten.median.dim: reduction(dims_arg(1)),
    aten.kthvalue.default: reduction(dims_arg(2, omitted="last"), keepdim_arg=3),
    # views and shape changes
    aten.view.default: Rule(_view_spec, shape_arg=1, extra=_view_of_inner_shard),
    aten.reshape.default: Rule(_view_spec, shape_arg=1, extra=_view_of_inner_shard),
    aten._unsafe_view.default: Rule(_view_spec, shape_arg=1, extra=_view_of_inner_shard),
    aten.expand.default: Rule(_expand_spec, shape_arg=1),
    aten.flatten.using_ints: Rule(_view_spec, extra=_view_of_inner_shard),
    aten.unflatten.int: Rule(_view_spec, local_op=_localize_unflatten),
    aten.transpose.int: permutation(_transpose_perm),
    aten.permute.default: permutation(lambda n: list(n.args[1])),
    aten.t.default: permutation(lambda n: list(range(_rank(n.args[0])))[::-1]),
    aten.movedim.int: permutation(_movedim_perm),
    aten.movedim.intlist: permutation(_movedim_perm),
    aten.unsqueeze.default: Rule(_unsqueeze_spec),
    aten.squeeze.default: Rule(_squeeze_spec, local_op=_local_squeeze),
    aten.squeeze.dim: Rule(_squeeze_spec, local_op=_local_squeeze),
    aten.squeeze.dims: Rule(_squeeze_spec, local_op=_local_squeeze),
    aten.repeat.default: Rule(_repeat_spec, extra=_tiled_shard),
    aten.repeat_interleave.self_int: Rule(_same_dims),
    aten.view_as_complex.default: Rule(_complex_view_spec),
    aten.view_as_real.default: Rule(_complex_view_spec),
    aten.cat.default: Rule(_cat_spec),
    aten.stack.default: Rule(_stack_spec),
    aten.split.Tensor: Rule(_split_spec, local_op=_local_split, extra=_blocked_parts),
    aten.split_with_sizes.default: Rule(_split_spec, local_op=_local_split, extra=_blocked_parts),
    aten.chunk.default: Rule(_split_spec, extra=_blocked_parts),
    aten.unbind.int: Rule(_unbind_spec),
    aten.unfold.default: Rule(_unfold_spec),
    aten.diagonal.default: Rule(_diagonal_spec),
    aten.view.dtype: Rule(_dtype_view_spec),
    aten.slice.Tensor: Rule(_fixed_dim_spec(1).spec, local_op=_local_slice, extra=_sliced),
    aten.narrow.default: _fixed_dim_spec(1),
    aten.select.int: replace(_fixed_dim_spec(1, drop=True), extra=_picked_from_shards,
                             local_op=_pick_of_shard),
    aten.flip.default: _fixed_dim_spec(1, default=None),
    aten.roll.default: _fixed_dim_spec(2, default=None),
    aten.constant_pad_nd.default: Rule(_pad_spec),
    aten.pad.default: Rule(_pad_spec),
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
})

FACTORIES = {aten.new_zeros.default: 1, aten.new_ones.default: 1, aten.new_empty.default: 1,
             aten.new_full.default: 1, aten.zeros.default: 0, aten.ones.default: 0,
             aten.empty.memory_format: 0, aten.full.default: 0}
"""Ops making a fresh tensor from sizes alone (reading at most another tensor's metadata),
which may be made in any placement -> the position of their size argument."""
RULES.update({op: Rule(_factory, shape_arg=i) for op, i in FACTORIES.items()})

ZERO_FILLED = frozenset({aten.zeros.default, aten.new_zeros.default, aten.zeros_like.default})
"""Ops making zeros from sizes (or a replicated tensor's): zeros on every rank are also a
``Partial`` sum, which partial values can be added into without reducing them first
(:mod:`fxtp.passes.unpin` pins them so, ``meta[PINNED]``)."""

PASSTHROUGH = {operator.getitem, stamp_edge}

_POINTWISE = pointwise()


LIBRARY_RULES: dict[str, Rule] = {
    # transformers' grouped matmul of mixture-of-experts layers, where torch's is missing
    "transformers::grouped_mm_fallback": einsum(_GROUPED_MM, "product", (0, 1)),
}
"""Rules of other libraries' custom ops, by qualified name (their libraries may not be
loaded, or not installed)."""


def rule_for(target) -> Optional[Rule]:
    """The rule of ``target``: stated in :data:`RULES` (or :data:`LIBRARY_RULES`), else the
    pointwise rule for an ATen op torch tags ``pointwise`` (no Partial pass-through) and
    for a call of a custom ``autograd.Function`` found elementwise (a target whose
    ``elementwise`` is true: :class:`fxtp.autograd_functions.Apply`), else ``None``."""
    if getattr(target, "elementwise", False) is True:
        return _POINTWISE
    rule = RULES.get(target)
    if rule is None and isinstance(target, torch._ops.OpOverload):
        rule = LIBRARY_RULES.get(target._schema.name) if target.namespace != "aten" else None
    if rule is None and is_tagged_pointwise(target):
        return _POINTWISE
    return rule


def is_tagged_pointwise(target) -> bool:
    """A functional or in-place ATen op torch tags ``pointwise``, or the in-place form of
    one (torch leaves 25 of those untagged: ``masked_fill_.Scalar``, ``gelu_``,
    ``threshold_``, ...); ``out=`` forms excluded, random ones too (``rrelu``: a shard
    would draw other numbers than the whole)."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    tags = target.tags
    if torch.Tag.pointwise not in tags and writes_first_input(target):
        functional = getattr(aten, target._schema.name.split("::")[1].rstrip("_"), None)
        overload = target._overloadname
        if isinstance(functional, torch._ops.OpOverloadPacket) and \
                overload in functional.overloads():
            tags = getattr(functional, overload).tags
    return torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags and \
        not any(a.is_out for a in target._schema.arguments)


def tagged_pointwise_ops() -> list:
    """Every ATen op :func:`is_tagged_pointwise` holds for (for the rule oracle)."""
    found = []
    for name in dir(aten):
        packet = getattr(aten, name, None)
        if isinstance(packet, torch._ops.OpOverloadPacket):
            # getattr, not packet.__getattr__: that makes a new OpOverload and caches it
            # in place of the one RULES is keyed by (``aten.x.y in RULES`` turns False)
            found += [op for op in (getattr(packet, o) for o in packet.overloads())
                      if is_tagged_pointwise(op)]
    return found


def localize_shape(shape, placement, group, graph: fx.Graph, before: fx.Node):
    """Rewrite a global shape list for an output with ``placement`` on ``group``'s rank:
    the sharded entry is divided by the world size (a :class:`UnitShard`'s is this rank's
    length; ``-1`` stays inferred; a symbolic size gets a floordiv node). On a rank holding
    none of the dim (6 heads dealt to 4 ranks: 2, 2, 2, 0), a ``-1`` elsewhere would be
    ambiguous for no elements: it becomes the traced size there."""
    if not is_sharded(placement):
        return shape
    shape = list(shape)
    d = placement.dim
    entry = shape[d]
    if isinstance(entry, int):
        shape[d] = entry if entry == -1 else local_size(placement, entry, group)
    else:
        with graph.inserting_before(before):
            shape[d] = graph.call_function(operator.floordiv, (entry, group.world))
    if shape[d] == 0:
        traced = val(before).shape
        shape = [traced[i] if s == -1 else s for i, s in enumerate(shape)]
    return shape


def local_size(placement, size: int, group) -> int:
    """This rank's length of a sharded dim of global ``size``."""
    if isinstance(placement, UnitShard):
        return local_range(placement, size, group.rank, group.world)[1]
    return size // group.world
