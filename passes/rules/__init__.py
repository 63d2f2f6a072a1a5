"""The per-op sharding rule table: :func:`rule_for` ``(aten op) -> Rule``.

A rule turns an fx node into a :class:`~fxtp.passes.dimspec.DimSpec` (from which
propagation derives the op's strategies) and, for ops that carry global shapes or
rank-dependent offsets as arguments, says how to rewrite them for local shards.

Coverage comes from torch's own op metadata where it exists: every op tagged
``torch.Tag.pointwise`` gets the broadcasting pointwise rule without being listed (the
linear ones, listed in :data:`~.elementwise.LINEAR_POINTWISE`, also pass ``Partial``
through). The other families (views, reductions, concatenation, indexing and scatter,
sorting, cumulative ops, normalizations, matrix products, convolutions and per-channel
planes, attention) are stated in this package's modules, one per family, one line per op
where the family's rule shape fits. Every strategy of every rule is checked numerically by
``tests/rules/test_rule_oracle.py``.

Adding an op is usually one line in its family's ``RULES`` (which :data:`RULES` gathers),
e.g. in ``reductions.py`` a reduction over a ``dim`` argument at position 1 that sums
(sharding the reduced dim gives ``Partial``)::

    aten.nansum.default: reduction(dims_arg(1), summed=True, partial="sum"),
"""
from __future__ import annotations

import operator
from typing import Optional

import torch

from ...kernels.torch_compat import OpOverload, OpOverloadPacket
from ..effects import writes_first_input
from ..graph import stamp_edge, tensor_inputs
from . import (attention, elementwise, factories, indexing, losses, matmul, norms, planes,
               reductions, views)
from .base import Rule, local_size, localize_shape, pointwise
from .elementwise import replicated_into_partial
from .factories import FACTORIES, ZERO_FILLED
from .matmul import LIBRARY_RULES

aten = torch.ops.aten

__all__ = ["FACTORIES", "LIBRARY_RULES", "PASSTHROUGH", "RULES", "Rule", "ZERO_FILLED",
           "is_tagged_pointwise", "local_size", "localize_shape", "replicated_into_partial",
           "rule_for", "tagged_pointwise_ops", "tensor_inputs"]
# the names other modules import from the table (``tensor_inputs`` is ..graph's)

RULES: dict = {**elementwise.RULES, **matmul.RULES, **planes.RULES, **attention.RULES,
               **losses.RULES, **norms.RULES, **reductions.RULES, **views.RULES,
               **indexing.RULES, **factories.RULES}
"""Every op's stated rule; a family listed later overrides an earlier one's rule of the
same op."""

PASSTHROUGH = {operator.getitem, stamp_edge}

_POINTWISE = pointwise()


def rule_for(target) -> Optional[Rule]:
    """The rule of ``target``: stated in :data:`RULES` (or :data:`LIBRARY_RULES`), else the
    pointwise rule for an ATen op torch tags ``pointwise`` (no Partial pass-through) and
    for a call of a custom ``autograd.Function`` found elementwise (a target whose
    ``elementwise`` is true: :class:`fxtp.frontend.autograd_functions.Apply`), else ``None``."""
    if getattr(target, "elementwise", False) is True:
        return _POINTWISE
    rule = RULES.get(target)
    if rule is None and isinstance(target, OpOverload):
        rule = LIBRARY_RULES.get(target._schema.name) if target.namespace != "aten" else None
    if rule is None and is_tagged_pointwise(target):
        return _POINTWISE
    return rule


def is_tagged_pointwise(target) -> bool:
    """A functional or in-place ATen op torch tags ``pointwise``, or the in-place form of
    one (torch leaves 25 of those untagged: ``masked_fill_.Scalar``, ``gelu_``,
    ``threshold_``, ...); ``out=`` forms excluded, random ones too (``rrelu``: a shard
    would draw other numbers than the whole)."""
    if not isinstance(target, OpOverload):
        return False
    tags = target.tags
    if torch.Tag.pointwise not in tags and writes_first_input(target):
        functional = getattr(aten, target._schema.name.split("::")[1].rstrip("_"), None)
        overload = target._overloadname
        if isinstance(functional, OpOverloadPacket) and \
                overload in functional.overloads():
            tags = getattr(functional, overload).tags
    return torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags and \
        not any(a.is_out for a in target._schema.arguments)


def tagged_pointwise_ops() -> list:
    """Every ATen op :func:`is_tagged_pointwise` holds for (for the rule oracle)."""
    found = []
    for name in dir(aten):
        packet = getattr(aten, name, None)
        if isinstance(packet, OpOverloadPacket):
            # getattr, not packet.__getattr__: that makes a new OpOverload and caches it
            # in place of the one RULES is keyed by (``aten.x.y in RULES`` turns False)
            found += [op for op in (getattr(packet, o) for o in packet.overloads())
                      if is_tagged_pointwise(op)]
    return found
