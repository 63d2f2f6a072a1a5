"""Views and shape changes: view / reshape, expand, transpose / permute, squeeze /
unsqueeze, repeat, cat / stack, split / chunk / unbind, slice / narrow / flip / roll, pads."""
from __future__ import annotations

import functools
import math
from typing import Callable

import sympy
import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from ..dimspec import DimSpec, fixed_label
from ..graph import is_tensor_node, op_arg, output_vals, tensor_inputs, val
from ..placement import block_bounds, blocks, cut_in_blocks, is_blocked, is_sharded
from .base import (Rule, dim_labels, dims_arg, fixed_dim_spec, is_one, local_size, ndim_of,
                   same_size, size_expr)

aten = torch.ops.aten


def permutation(perm_of: Callable[[fx.Node], list[int]]):
    """Output dim i is input dim ``perm[i]`` (transpose, permute)."""
    def spec(node):
        n = ndim_of(node.args[0])
        labels = dim_labels(n)
        return DimSpec((labels,), (tuple(labels[p % n] for p in perm_of(node)),) if n else ((),),
                       "sum")
    return Rule(spec)


def _transpose_perm(node):
    n = ndim_of(node.args[0])
    perm = list(range(n))
    if n:
        a, b = node.args[1] % n, node.args[2] % n
        perm[a], perm[b] = perm[b], perm[a]
    return perm


def _reversed_perm(node):
    return list(range(ndim_of(node.args[0])))[::-1]


def _last_two_swapped(node):
    perm = list(range(ndim_of(node.args[0])))
    perm[-2], perm[-1] = perm[-1], perm[-2]
    return perm


def _movedim_perm(node):
    n = ndim_of(node.args[0])
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
        if i < len(src) and j < len(dst) and same_size(src[i], dst[j]):
            label = f"g{i}"
            in_labels.append(label)
            out_labels.append(label)
            i, j = i + 1, j + 1
            continue
        if i < len(src) and is_one(src[i]):
            in_labels.append(fixed_label())
            i += 1
            continue
        if j < len(dst) and is_one(dst[j]):
            out_labels.append(fixed_label())
            j += 1
            continue
        if i == len(src) or j == len(dst):  # symbolic sizes of 1 left on one side
            in_labels += [fixed_label() for _ in src[i:]]
            out_labels += [fixed_label() for _ in dst[j:]]
            break
        gi, gj, pi, pj = [i], [j], src[i], dst[j]
        while not same_size(pi, pj):
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


@functools.lru_cache(maxsize=4096)
def _ratio(a: sympy.Expr, b: sympy.Expr) -> sympy.Expr:
    """``a / b`` with common factors cancelled (a number where they are proportional)."""
    return sympy.cancel(a / b)


def _lt(a, b) -> bool:
    """``a < b`` for sizes that may be symbolic: by their ratio where it is a number (``u1``
    against ``4*u1``: a size known only from values has no hint to compare), else as torch
    decides it, else by their hints."""
    if not (isinstance(a, int) and isinstance(b, int)):
        ratio = _ratio(size_expr(b), size_expr(a))
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
    dim = node.args[1] % ndim_of(node.args[0])
    sizes = list(node.args[2])
    k = output.dim - dim
    if 0 <= k < len(sizes) and sizes[k] != -1:
        sizes[k] = local_size(output, sizes[k], group)
    return node.target, (node.args[0], node.args[1], sizes) + tuple(node.args[3:]), node.kwargs


def _unfold_spec(node):
    """``unfold(dim, size, step)``: ``dim`` becomes the windows and a last dim of ``size``
    is added, neither sharded (a window may span shards); the other dims map as they are."""
    n = ndim_of(node.args[0])
    d = node.args[1] % n if n else 0
    labels = tuple(fixed_label() if j == d else f"d{j}" for j in range(n))
    return DimSpec((labels,), (labels + (fixed_label(),),), "sum")


def _diagonal_spec(node):
    """``diagonal(offset, dim1, dim2)``: the two dims become one last dim, never sharded;
    the other dims map as they are."""
    n = ndim_of(node.args[0])
    pair = {op_arg(node, 2, "dim1", 0) % n, op_arg(node, 3, "dim2", 1) % n}
    labels = tuple(fixed_label() if j in pair else f"d{j}" for j in range(n))
    return DimSpec((labels,), (tuple(lab for j, lab in enumerate(labels) if j not in pair)
                               + (fixed_label(),),), "sum")


def _dtype_view_spec(node):
    """``view(dtype)``: the same bytes read as another dtype; the last dim's length scales
    by the element sizes' ratio, so each element's words stay on its rank."""
    labels = dim_labels(ndim_of(node.args[0]))
    return DimSpec((labels,), (labels,))


def _unsqueeze_spec(node):
    n = ndim_of(node.args[0])
    d = node.args[1] % (n + 1)
    labels = dim_labels(n)
    return DimSpec((labels,), (labels[:d] + (fixed_label(),) + labels[d:],), "sum")


def _squeeze_spec(node):
    shape = val(node.args[0]).shape
    n = len(shape)
    dims = dims_arg(1, omitted="all")(node)
    drop = {d % n for d in dims if is_one(shape[d % n])} if n else set()
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
    dims = sorted({d % n for d in dims_arg(1, omitted="all")(node) if is_one(shape[d % n])})
    return aten.squeeze.dims, (node.args[0], dims), {}


def _expand_spec(node):
    """Dims expanded from size 1 (or prepended) appear in the output only: a rank may
    expand a replicated input straight to its shard of them (every slice along them is the
    same), its input's gradient then partial."""
    src, dst = val(node.args[0]).shape, val(node).shape
    off = len(dst) - len(src)
    kept = [j >= off and same_size(src[j - off], dst[j]) for j in range(len(dst))]
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
    n = ndim_of(node)
    d = op_arg(node, 1, "dim", 0) % n
    label = lambda j: fixed_label() if j == d else f"d{j}"  # noqa: E731
    ins = tuple(tuple(label(j) for j in range(n)) if ndim_of(t) == n else (fixed_label(),)
                for t in tensors)
    return DimSpec(ins, (tuple(label(j) for j in range(n)),), "sum")


def _blocked_cat(node, world, actual=()):
    """Parts each sharded on the concatenated dim, each divisible by ``world``, give the
    whole cut in their blocks, each sharded (a blocked split undone: Qwen3-Next's q, k and
    v concatenated for its convolution): each rank concatenates its shards. Offered where
    every part arrives so (or to enumerate every strategy)."""
    tensors = [t for t in node.args[0] if is_tensor_node(t)]
    n = ndim_of(node)
    d = op_arg(node, 1, "dim", 0) % n
    sizes = [val(t).shape[d] for t in tensors]
    if len(tensors) < 2 or any(ndim_of(t) != n for t in tensors) or \
            not all(isinstance(s, int) and s > 0 and s % world == 0 for s in sizes) or \
            actual and any(a != Shard(d) for a in actual):
        return
    yield (Shard(d),) * len(tensors), (cut_in_blocks(d, sizes),)


def _stack_spec(node):
    """``stack(tensors, dim)``: equal-shaped inputs share every dim; the new dim is fixed."""
    n = ndim_of(node) - 1
    d = op_arg(node, 1, "dim", 0) % (n + 1)
    labels = dim_labels(n)
    ins = tuple(labels for _ in tensor_inputs(node))
    return DimSpec(ins, (labels[:d] + (fixed_label(),) + labels[d:],), "sum")


def _split_spec(node):
    n = ndim_of(node.args[0])
    d = op_arg(node, 2, "dim", 0) % n
    labels = tuple(f"d{j}!" if j == d else f"d{j}" for j in range(n))
    return DimSpec((labels,), tuple(labels for _ in output_vals(node)), "sum")


def _unbind_spec(node):
    n = ndim_of(node.args[0])
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
    d = op_arg(node, 2, "dim", 0) % ndim_of(node.args[0])
    parts = [v.shape[d] for v in output_vals(node)]
    if len(parts) < 2 or not all(isinstance(p, int) and p % world == 0 for p in parts):
        return
    if len(set(parts)) == 1 or node.target is not aten.chunk.default:
        yield (cut_in_blocks(d, parts),), (Shard(d),) * len(parts)


def _local_split(node, inputs, output, group):
    """Split sizes of an input blocked on the split dim are this rank's sizes (``chunk``
    counts parts; an input blocked on another dim splits as is)."""
    d = op_arg(node, 2, "dim", 0) % ndim_of(node.args[0])
    if not is_blocked(inputs[0]) or inputs[0].dim != d or node.target is aten.chunk.default:
        return node.target, node.args, node.kwargs
    sizes = node.args[1]
    local = [s // group.world for s in sizes] if isinstance(sizes, (list, tuple)) else \
        sizes // group.world
    return node.target, (node.args[0], local) + tuple(node.args[2:]), node.kwargs


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


def _pad_spec(node):
    """``constant_pad_nd(x, pad, value)`` / ``pad(x, pad, mode, value)``: padded (trailing)
    dims never shard (a pad of symbolic size counts as one); a nonzero constant fill would
    be added once per rank to a Partial value, so only zero padding and the modes that
    copy elements (reflect, replicate, circular) pass it."""
    n, pads = ndim_of(node.args[0]), list(node.args[1])
    padded = {n - 1 - k // 2 for k, p in enumerate(pads) if not (isinstance(p, int) and p == 0)}
    labels = tuple(f"d{j}!" if j in padded else f"d{j}" for j in range(n))
    if node.target is aten.pad.default:
        mode, fill = op_arg(node, 2, "mode", "constant"), op_arg(node, 3, "value", None)
    else:
        mode, fill = "constant", op_arg(node, 2, "value", 0)
    return DimSpec((labels,), (labels,), "sum" if mode != "constant" or not fill else "none")


def _same_dims(node):
    """Every dim of the input maps to the same dim of the output, whose size may be a
    multiple of it (``repeat_interleave`` along a dim keeps contiguous blocks together).
    Without a dim the input is flattened first: only its leading dim maps, to the 1-d output."""
    labels = dim_labels(ndim_of(node.args[0]))
    if op_arg(node, 2, "dim") is None:
        labels = labels[:1] + tuple(fixed_label() for _ in labels[1:])
        return DimSpec((labels,), (labels[:1] or (fixed_label(),),), "sum")
    return DimSpec((labels,), (labels,), "sum")


def _local_repeat_interleave(node, inputs, output, group):
    """``output_size`` checks the repeated dim's global size: a rank whose output is sharded
    leaves it out (an int ``repeats`` sets the size)."""
    if node.kwargs.get("output_size") is None or not is_sharded(output):
        return node.target, node.args, node.kwargs
    return node.target, node.args, {k: v for k, v in node.kwargs.items() if k != "output_size"}


def _complex_view_spec(node):
    """``view_as_complex`` folds the trailing (re, im) dim away; ``view_as_real`` adds it."""
    n_in, n_out = ndim_of(node.args[0]), ndim_of(node)
    labels = dim_labels(min(n_in, n_out))
    pair = (fixed_label(),)
    return DimSpec((labels + pair if n_in > n_out else labels,),
                   (labels + pair if n_out > n_in else labels,), "sum")


RULES: dict = {
    # views and shape changes
    aten.view.default: Rule(_view_spec, shape_arg=1, extra=_view_of_inner_shard),
    aten.reshape.default: Rule(_view_spec, shape_arg=1, extra=_view_of_inner_shard),
    aten._unsafe_view.default: Rule(_view_spec, shape_arg=1, extra=_view_of_inner_shard),
    aten.expand.default: Rule(_expand_spec, shape_arg=1),
    aten.flatten.using_ints: Rule(_view_spec, extra=_view_of_inner_shard),
    aten.unflatten.int: Rule(_view_spec, local_op=_localize_unflatten),
    aten.transpose.int: permutation(_transpose_perm),
    aten.permute.default: permutation(lambda n: list(n.args[1])),
    aten.t.default: permutation(_reversed_perm),
    aten.numpy_T.default: permutation(_reversed_perm),  # x.T
    aten.mT.default: permutation(_last_two_swapped),
    aten.adjoint.default: permutation(_last_two_swapped),  # conjugates: elementwise
    aten.mH.default: permutation(_last_two_swapped),
    aten.matrix_H.default: permutation(_last_two_swapped),
    aten.movedim.int: permutation(_movedim_perm),
    aten.movedim.intlist: permutation(_movedim_perm),
    aten.unsqueeze.default: Rule(_unsqueeze_spec),
    aten.squeeze.default: Rule(_squeeze_spec, local_op=_local_squeeze),
    aten.squeeze.dim: Rule(_squeeze_spec, local_op=_local_squeeze),
    aten.squeeze.dims: Rule(_squeeze_spec, local_op=_local_squeeze),
    aten.repeat.default: Rule(_repeat_spec, extra=_tiled_shard),
    aten.repeat_interleave.self_int: Rule(_same_dims, local_op=_local_repeat_interleave),
    aten.view_as_complex.default: Rule(_complex_view_spec),
    aten.view_as_real.default: Rule(_complex_view_spec),
    aten.cat.default: Rule(_cat_spec, extra=_blocked_cat),
    aten.stack.default: Rule(_stack_spec),
    aten.split.Tensor: Rule(_split_spec, local_op=_local_split, extra=_blocked_parts),
    aten.split_with_sizes.default: Rule(_split_spec, local_op=_local_split, extra=_blocked_parts),
    aten.chunk.default: Rule(_split_spec, extra=_blocked_parts),
    aten.unbind.int: Rule(_unbind_spec),
    aten.unfold.default: Rule(_unfold_spec),
    aten.diagonal.default: Rule(_diagonal_spec),
    aten.view.dtype: Rule(_dtype_view_spec),
    aten.slice.Tensor: Rule(fixed_dim_spec(1).spec, local_op=_local_slice, extra=_sliced),
    aten.narrow.default: fixed_dim_spec(1),
    aten.flip.default: fixed_dim_spec(1, default=None),
    aten.roll.default: fixed_dim_spec(2, default=None),
    aten.constant_pad_nd.default: Rule(_pad_spec),
    aten.pad.default: Rule(_pad_spec),
}
