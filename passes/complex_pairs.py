"""Complex values as real pairs: rewrite a graph module tree to compute without complex
tensors.

Each complex tensor of shape ``s`` becomes its real view of shape ``s + (2,)`` (what
``torch.view_as_real`` gives): ``view_as_complex`` and ``view_as_real`` vanish, a complex
product becomes the pair formula, and shape ops keep the trailing pair dim. Meta's complex
rotary tables are this pattern. A graph module tree so rewritten takes and returns the
pairs where it took and returned complex tensors. Used on :mod:`.stateless` copies, whose
compiler region (a nested compile region) cannot differentiate through complex tensors.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .recompute import call_submodule, run_checkpointed

aten = torch.ops.aten

PASS_THROUGH = {run_checkpointed, call_submodule, operator.getitem, aten.clone.default,
                aten.alias.default, aten.detach.default, aten.contiguous.default,
                aten.add.Tensor, aten.sub.Tensor, aten.neg.default}
"""Targets that compute on pairs as they do on complex values (both operands complex for
add and sub)."""


CONVERSIONS = {aten.to.dtype_layout, aten.to.dtype, aten.to.device, aten._to_copy.default}
"""Device and dtype conversions: on pairs, to the real dtype of the complex one."""


class Unpaired(Exception):
    """A complex value used by an op this pass has no pair form of."""


def pair_complex(gm: fx.GraphModule) -> bool:
    """Rewrite every graph module of ``gm``'s tree in place; returns whether any computed
    with complex values. Raises :class:`Unpaired` (before changing anything) where an op
    has no pair form."""
    graphs = [m for m in gm.modules() if isinstance(m, fx.GraphModule)]
    complex_dims = [(m, {n: d for n in m.graph.nodes
                         if (d := _complex_dim(n)) is not None}) for m in graphs]
    for m, paired in complex_dims:
        for node in m.graph.nodes:
            if node in paired or any(a in paired for a in node.all_input_nodes):
                _check(node, paired)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    if any(a in complex_dims[0][1] for a in output.all_input_nodes):
        raise Unpaired("it returns a complex value")
    for m, paired in complex_dims:
        if paired:
            for node in list(m.graph.nodes):
                if node in paired or any(a in paired for a in node.all_input_nodes):
                    _rewrite(m.graph, node, paired)
            m.graph.lint()
            m.recompile()
    return any(paired for _, paired in complex_dims)


def _complex_dim(node: fx.Node):
    """The dims of the complex tensor ``node`` makes, else None."""
    val = node.meta.get("val")
    return val.dim() if isinstance(val, torch.Tensor) and val.is_complex() else None


def _check(node: fx.Node, paired: dict) -> None:
    """Raise :class:`Unpaired` unless ``node``, which makes or takes a complex value, has a
    pair form."""
    if node.op in ("placeholder", "output", "call_module", "get_attr"):
        return
    target = node.target
    if target in (aten.add.Tensor, aten.sub.Tensor) and not all(
            isinstance(a, fx.Node) and a in paired for a in node.args[:2]):
        raise Unpaired(f"{target} of a complex and a real value")
    if target is aten.mul.Tensor and any(isinstance(a, complex) for a in node.args):
        raise Unpaired(f"{target} by a complex number")
    if target in CONVERSIONS:
        if any(isinstance(d, torch.dtype) and not d.is_complex for d in _dtypes(node)):
            raise Unpaired(f"{target} of a complex value to a real dtype")
        return
    if target in PASS_THROUGH or target in _SHAPE_OPS or target in (
            aten.view_as_complex.default, aten.view_as_real.default, aten.mul.Tensor):
        return
    raise Unpaired(f"{target} on a complex value")


def _rewrite(graph: fx.Graph, node: fx.Node, paired: dict) -> None:
    """Give ``node`` its pair form; ``paired``: the values held as pairs -> their complex
    dims, kept up to date."""
    target = node.target
    if node.op != "call_function" or target in PASS_THROUGH:
        return
    x, *rest = node.args
    with graph.inserting_before(node):
        if target in (aten.view_as_complex.default, aten.view_as_real.default):
            new = graph.call_function(aten.alias.default, (x,))  # the pairs themselves
        elif target is aten.mul.Tensor:
            new = _mul(graph, x, rest[0], paired)
        elif target in CONVERSIONS:
            new = graph.call_function(target, *fx.node.map_aggregate(
                (node.args, dict(node.kwargs)), _real_dtype))
        else:
            new = graph.call_function(target, (x, *_SHAPE_OPS[target](paired[x], *rest)),
                                      dict(node.kwargs))
    if node in paired:
        paired[new] = paired.pop(node)
    node.replace_all_uses_with(new)
    graph.erase_node(node)


def _dtypes(node: fx.Node) -> list:
    return [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, torch.dtype)]


def _real_dtype(a):
    return a.to_real() if isinstance(a, torch.dtype) and a.is_complex else a


def _mul(graph: fx.Graph, a, b, paired: dict) -> fx.Node:
    """``a * b`` on pairs: (ar br - ai bi, ar bi + ai br); a real factor scales both."""
    def is_pair(v):
        return isinstance(v, fx.Node) and v in paired
    if not is_pair(a):
        a, b = b, a
    if not is_pair(b):
        if isinstance(b, fx.Node):
            b = graph.call_function(aten.unsqueeze.default, (b, -1))
        return graph.call_function(aten.mul.Tensor, (a, b))
    ar, ai, br, bi = (graph.call_function(aten.select.int, (v, -1, i))
                      for v in (a, b) for i in (0, 1))
    re = graph.call_function(aten.sub.Tensor, (graph.call_function(aten.mul.Tensor, (ar, br)),
                                               graph.call_function(aten.mul.Tensor, (ai, bi))))
    im = graph.call_function(aten.add.Tensor, (graph.call_function(aten.mul.Tensor, (ar, bi)),
                                               graph.call_function(aten.mul.Tensor, (ai, br))))
    return graph.call_function(aten.stack.default, ([re, im], -1))


def _dim(d: int, ndim: int) -> int:
    """A complex value's dim as its pairs' (a negative one counted from the pair dim)."""
    return d + ndim if d < 0 else d


_SHAPE_OPS = {
    aten.reshape.default: lambda ndim, shape: ([*shape, 2],),
    aten.view.default: lambda ndim, shape: ([*shape, 2],),
    aten.expand.default: lambda ndim, sizes, *r: ([*sizes, 2], *r),
    aten.slice.Tensor: lambda ndim, dim=0, *r: (_dim(dim, ndim), *r),
    aten.select.int: lambda ndim, dim, index: (_dim(dim, ndim), index),
    aten.unsqueeze.default: lambda ndim, dim: (_dim(dim, ndim + 1),),
    aten.squeeze.dim: lambda ndim, dim: (_dim(dim, ndim),),
    aten.transpose.int: lambda ndim, a, b: (_dim(a, ndim), _dim(b, ndim)),
    aten.permute.default: lambda ndim, dims: ([*(_dim(d, ndim) for d in dims), ndim],),
    aten.flatten.using_ints: lambda ndim, start=0, end=-1: (_dim(start, ndim),
                                                            _dim(end, ndim)),
}
"""Shape ops on a complex value: their arguments after the input, given the value's
dims, as the same op on its pairs."""
