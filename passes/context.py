"""What a pass is given besides the graph.

Every pass is ``pass_(gm, ctx) -> gm``: it edits ``gm`` in place, returns it, and leaves
what it found in the ``node.meta`` / ``gm.meta`` keys :mod:`fxtp.passes.graph` lists
(``gm.meta[FALLBACKS]``, ``gm.meta[RELAID]``, ...). A pass reads the fields of
:class:`PassContext` it names and ignores the rest.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch.fx as fx

from .graph import RELAID


@dataclass(frozen=True)
class PassContext:
    """Where the program runs and what the plan and the trace tell the passes."""

    world: int
    """How many ranks the program is laid out over."""
    group: Any = None
    """The :class:`~fxtp.plans.mesh.Group` the program runs on (its name, rank and world):
    rewrite, localize, rehearse. ``None`` where a program is only placed and costed."""
    strict: bool = False
    """propagate: a fallback raises :class:`~fxtp.passes.errors.ShardingError`."""
    shardings: Mapping = field(default_factory=dict)
    """seed: module FQN -> :class:`~fxtp.passes.graph.ModuleSharding`."""
    calls: Mapping = field(default_factory=dict)
    """seed: module FQN -> its traced calls (:class:`~fxtp.passes.graph.ModuleCall`)."""
    aliases: Mapping = field(default_factory=dict)
    """seed: parameter FQN -> every FQN of the same (tied) tensor."""
    scope: Optional[Callable[[fx.Node], str]] = None
    """rewrite: the FQN of the outermost module kept as a submodule around a node."""
    copies: Mapping = field(default_factory=dict)
    """localize: tensors no node reads (a stamped block's) -> the tensor read in their place."""
    place: Optional[Callable[[fx.GraphModule, "PassContext"], fx.GraphModule]] = None
    """unfuse_splits, unpin_layouts: the pass that places the program again (propagation and
    the relayouts)."""
    kept: frozenset = frozenset()
    """drop_unused: nodes to keep though nothing reads them (module boundaries)."""
    model: Any = None
    """The assembly passes: the single-device model the program was traced from (its
    classes, attributes and state-dict keys)."""
    outline: tuple = ()
    """outline_modules: the FQNs of the modules kept as submodules."""
    stamped: Mapping = field(default_factory=dict)
    """outline_modules, stamp_modules: a stamped block's FQN -> its reference's."""
    regions: Mapping = field(default_factory=dict)
    """outline_checkpoints: each activation-checkpoint region's ``checkpoint`` options."""

    @property
    def rank(self) -> int:
        return self.group.rank if self.group is not None else 0

    @property
    def group_name(self) -> str:
        return self.group.name if self.group is not None else ""

    def but(self, **changes) -> "PassContext":
        """This context with ``changes``."""
        return dataclasses.replace(self, **changes)


Pass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]


def relayout(find: Callable[[fx.GraphModule, PassContext], bool]) -> Pass:
    """The pass of a relayout ``find(gm, ctx) -> changed``: it records in ``gm.meta[RELAID]``
    whether it changed a placement."""
    @functools.wraps(find)
    def relayout_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        gm.meta[RELAID] = bool(find(gm, ctx))
        return gm
    return relayout_pass
