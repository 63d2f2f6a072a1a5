"""What the rule families share: the :class:`Rule` of an op, the rule shapes and helpers
more than one family uses, and the localization of global shape arguments."""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Optional

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.distributed.tensor import Replicate, Shard

from ..dimspec import DimSpec, fixed_label, strategies
from ..graph import op_arg, output_vals, tensor_inputs, val
from ..placement import UnitShard, is_blocked, is_sharded, is_whole, local_range

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
    :class:`fxtp.plans.mesh.Group`), returns the ``(target, args, kwargs)`` to run instead when the
    op cannot run as is on its shards or takes rank-dependent arguments; ``communicates``
    says that local op issues collectives for its ``extra`` strategies (they need a real
    process group to check). ``strided=False``: the op is offered no blocked
    (``_StridedShard``, ``BlockShard``) forms of its spec's strategies (its local form assumes
    one contiguous shard per rank:
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


def ndim_of(node) -> int:
    return val(node).dim()


def input_ndims(node):
    return [ndim_of(a) for a in tensor_inputs(node)]


def dim_labels(n: int, prefix="d") -> tuple:
    return tuple(f"{prefix}{j}" for j in range(n))


def size_expr(size):
    return sympy.Integer(size) if isinstance(size, int) else size.node.expr


def same_size(a, b) -> bool:
    """Are two (possibly symbolic) sizes provably equal?"""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return sympy.expand(size_expr(a) - size_expr(b)) == 0


def shard_start(p, value, group) -> int:
    """The global index of this rank's first element along ``p``'s (sharded) dim."""
    return local_range(p, value.shape[p.dim], group.rank, group.world)[0]


def broadcast_labels(shape, full):
    """Labels of a tensor broadcast against dims labelled ``full`` (size-1 dims fixed)."""
    off = len(full) - len(shape)
    return tuple(fixed_label() if is_one(shape[j]) else full[off + j] for j in range(len(shape)))


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
                shape[j] == out[offset + j]) or not is_one(shape[j]) else fixed_label()
                                for j in range(len(shape))))
        kind = partial
        scalars = [a for a in node.args if isinstance(a, (int, float)) and not isinstance(a, bool)]
        if kind == "sum" and scalars and node.target not in _SCALAR_LINEAR:
            kind = "none"
        dtype = output_vals(node)[0].dtype
        if kind != "none" and any(_narrows(val(a).dtype, dtype) for a in tensor_inputs(node)):
            kind = "none"  # rounding each rank's part is not rounding their sum
        outs = tuple(dim_labels(n) for _ in output_vals(node))
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


def is_one(size) -> bool:
    return isinstance(size, int) and size == 1


_SCALAR_LINEAR = {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar,
                  aten.mul_.Scalar, aten.div_.Scalar, aten.mul_.Tensor, aten.div_.Tensor}


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
            n = ndim_of(node.args[0])
            return list(range(n)) if omitted == "all" else [n - 1] if n else []
        return list(d) if isinstance(d, (list, tuple)) else [d]
    return dims


def communicating(parts) -> dict:
    """A communicating local form's ``(extra, local_op)`` as :class:`Rule` fields."""
    extra, local_op = parts
    return dict(extra=extra, local_op=local_op, communicates=True)


def fixed_dim_spec(dim_index: int, drop: bool = False, default: int = 0):
    """Ops that act on one dim given by argument ``dim_index`` (slice, select, narrow, flip,
    roll, index_select's dim): it never shards; ``drop`` removes it from the output."""
    def spec(node):
        n = ndim_of(node.args[0])
        dims = dims_arg(dim_index, omitted="all")(node) if default is None else \
            [op_arg(node, dim_index, "dim", default)]
        fixed = {d % n for d in dims}
        labels = tuple(f"d{j}!" if j in fixed else f"d{j}" for j in range(n))
        out = tuple(lab for j, lab in enumerate(labels) if not (drop and j in fixed))
        return DimSpec((labels,) + (None,) * (len(tensor_inputs(node)) - 1), (out,), "sum")
    return Rule(spec)


def local_groups(index: int):
    """The local op of an op of groups of channels (its argument ``index``: the number of
    groups) taking channel shards of whole groups (or blocks of them): this rank's number
    of groups."""
    def local(node, inputs, output, group):
        sharded = inputs[0] == Shard(1) or is_blocked(inputs[0]) and inputs[0].dim == 1
        if not sharded or node.args[index] == 1:  # one group: a Partial sum's
            return node.target, node.args, node.kwargs
        args = list(node.args)
        args[index] //= group.world
        return node.target, tuple(args), node.kwargs
    return local


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
