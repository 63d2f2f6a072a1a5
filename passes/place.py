"""The place stage as passes: placements propagated from the seeds, with the relayouts that
spare a gather, then the trials that place the program again where that sends less."""
from __future__ import annotations

import torch.fx as fx

from .aliases import pin_written_aliases
from .buffers import shard_written_buffers
from .context import PassContext
from .decompose import decompose_sharded_norms, decompose_sharded_unruled
from .gather_early import gather_early
from .graph import RELAID
from .propagate import propagate
from .strided import stride_fused_splits
from .unfuse import unfuse_splits
from .units import deal_consumers, deal_sources
from .unpin import unpin_layouts

RELAYOUTS = (decompose_sharded_unruled, stride_fused_splits, deal_sources, deal_consumers,
             shard_written_buffers, decompose_sharded_norms, pin_written_aliases)
"""The relayout passes, in the order they run between propagations."""

TRIALS = (unfuse_splits, unpin_layouts, gather_early)
"""The passes that place the program again (``ctx.place``) and keep it where it sends less:
fused projections whose parts cannot be sharded together split part by part, a plan's
layouts let go, gathers moved early (last: propagation would undo it)."""


def propagate_and_relayout(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Propagate; then, each time one of the layouts that serve what would be gathered
    changes the graph, again: ops without a rule as torch decomposes them, fused
    projections strided, heads that do not divide by the world size dealt whole (and their
    consumers alike), buffers written in place (KV caches) placed as what is written into
    them, norms over sharded dims taken as partial sums, and values written through views
    that take them redistributed made whole."""
    propagate(gm, ctx)
    for relayout in RELAYOUTS:
        if relayout(gm, ctx).meta[RELAID]:
            propagate(gm, ctx)
    return gm


def place(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """The seeded ``gm`` placed: :func:`propagate_and_relayout`, then the :data:`TRIALS`
    (each placing it again with ``ctx.place``, by default :func:`propagate_and_relayout`).
    The fallbacks left are ``gm.meta[FALLBACKS]``."""
    if ctx.place is None:
        ctx = ctx.but(place=propagate_and_relayout)
    for pass_ in (ctx.place, *TRIALS):
        pass_(gm, ctx)
    return gm
