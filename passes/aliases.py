"""Aliases pass: a write through a view lands in the value the view was taken of.

A view op (``slice``, ``select``, ``view``, a ``split``'s parts, ...) whose input
propagation redistributes computes on a copy, not on its input. A write into that view (or
into a view of it) then misses the value it was taken of, and a write into the value
misses the view: ``h[..., :k] *= 0.5`` on a feature-sharded ``h`` would scale a gathered
copy and leave ``h`` as it was, with no error. For every value written in place, directly
or through views, whose alias set (the value it is a view of, at the root, and every view
taken of it, transitively) holds a view that redistributes its input, every op of the set
is pinned to Replicate (``meta[PINNED]``): the root is made whole where it is made (a
reported gather), the views and the writes act on it as on one device, and readers outside
the set take their parts of it. A root that is an input, parameter or buffer, or a value
the plan lays out at a module boundary, cannot be re-made:
:class:`~fxtp.passes.errors.ShardingError`. An in-place op whose rule cannot compute on
the value it writes as placed is such a copying member too (propagation gathers for it).
"""
from __future__ import annotations

import operator

import torch.fx as fx

from ..kernels.torch_compat import OpOverload
from .context import PassContext, relayout
from .effects import alias_root, alias_set, returns_alias, written_args
from .errors import ShardingError
from .graph import (BOUNDARY, INPUTS, PINNED, layout, module_fqn, placement_of, stamp_edge,
                    val)
from .placement import R, describe


@relayout
def pin_written_aliases(gm: fx.GraphModule, ctx: PassContext) -> bool:
    """Pin to Replicate every alias set of ``gm`` written in place and holding a view that
    redistributes its input; return whether any pin changed (propagation must then run
    again). It reads the placements propagation chose."""
    changed, done = False, set()
    for node in gm.graph.nodes:
        for root in written_roots(node):
            if root in done:
                continue
            done.add(root)
            members = alias_set(root)
            copied = [m for m in members if _redistributes(m)]
            if not copied:
                continue
            if root.op != "call_function" or root.target in (layout, stamp_edge):
                what = f"the {root.meta[BOUNDARY]} layout" if BOUNDARY in root.meta else \
                    f"'{root.name}'"
                raise ShardingError(
                    f"'{node.name}' ({node.target}) in module '{module_fqn(node) or '<root>'}' "
                    f"writes in place into {what} (placed {describe(placement_of(root))}, "
                    f"fixed by the plan or as an input, parameter or buffer) where "
                    f"'{copied[0].name}' takes it "
                    f"redistributed, so the write would land in a copy. Lay that value out "
                    f"replicated, or compute the written value out of place")
            for m in [root, *members]:
                pin = tuple(R for _ in val(m)) if isinstance(val(m), (tuple, list)) else R
                if m.meta.get(PINNED) != pin:
                    m.meta[PINNED] = pin
                    changed = True
    return changed


def written_roots(node: fx.Node) -> list[fx.Node]:
    """The values ``node`` writes in place, each as the value its written view (if it is
    one) was taken of."""
    if node.op != "call_function":
        return []
    return [alias_root(node.args[p]) for p in written_args(node.target)
            if p < len(node.args) and isinstance(node.args[p], fx.Node)]


def written_groups(node: fx.Node) -> list[set[fx.Node]]:
    """For each value ``node`` writes in place, every node sharing its memory: the value
    its written view was taken of, and every view of that."""
    return [{root, *alias_set(root)} for root in written_roots(node)]


def written_values(graph: fx.Graph) -> set[fx.Node]:
    """The values some node of ``graph`` writes in place (as :func:`written_roots`)."""
    return {root for node in graph.nodes for root in written_roots(node)}


def observed(written: fx.Node) -> bool:
    """Whether an in-place write into ``written`` can be seen elsewhere: it is an input, a
    parameter or buffer, a view of another value, or read by more than the writing op.
    Otherwise (a temporary the writing op alone reads, e.g. a matmul's output a bias is
    added to in place) the op may write into a redistributed copy."""
    return written.op != "call_function" or len(written.users) > 1 or _may_alias(written)


def _may_alias(node: fx.Node) -> bool:
    """Whether ``node``'s value may share memory with another value: the op's schema says
    its result aliases an input (a ``getitem`` of ``split``'s results too), a marker's
    value may be seen elsewhere, or the op is not an ATen op. (The trace's fake values do
    not say: they are not marked as views.)"""
    if node.target is operator.getitem:
        return _may_alias(node.args[0])
    if node.target in (layout, stamp_edge):  # identity marks: the value they mark
        return observed(node.args[0])
    return not isinstance(node.target, OpOverload) or returns_alias(node.target)


def _redistributes(node: fx.Node) -> bool:
    """Whether propagation gives ``node`` its first input in another placement while that
    input is seen elsewhere: a view is then of a copy, an in-place op writes a copy (where
    its rule cannot compute on the value as placed; a temporary nothing else reads may be
    written as a copy)."""
    needed = node.meta.get(INPUTS) or ()
    return bool(needed) and needed[0] is not None and \
        needed[0] != placement_of(node.args[0]) and \
        (0 not in written_args(node.target) or observed(node.args[0]))
