"""Keep values sharded where a plan gathers them only to split them again.

Plans written for DTensor gather inside a block what DTensor cannot compute on shards, and
split it again for the next projection: Hugging Face's ``colwise_gather_output`` before a
fused ``chunk`` (GLM, Phi-3) or a norm over all heads (OLMo-2), then
``rowwise_split_input``. fxtp computes on the shards those ops see (strided splits, a
norm's partial mean), so the gather and the split are a cost, not a need. A layout is only
a module boundary's communication: the values are the same whatever it is.

:func:`unpin_gathers_split_again` tries, in every block that splits a replicated value
for a rowwise input, leaving the outputs the plan gathers in that block as they are
produced, places the graph again and keeps that only if it redistributes strictly less
(propagation's own cost: bytes per rank and a latency per collective) with no more
fallbacks; otherwise every placement is as before.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch.fx as fx

from .graph import FALLBACK, layout, list_block, module_fqn, placement_of
from .placement import is_replicate, is_sharded
from .strided import redistribution_costs


def unpin_gathers_split_again(gm: fx.GraphModule, world: int,
                              place: Callable[[], list]) -> Optional[list]:
    """Unpin the replicated layouts of the blocks that split a replicated value again and
    run ``place`` (propagation and the relayout passes; it returns the fallbacks).
    Return its fallbacks if that redistributes less with no more fallbacks, else restore
    ``gm``'s placements and return ``None``."""
    markers = [n for n in gm.graph.nodes if n.target is layout]
    split = {_block(m) for m in markers if is_sharded(m.args[1]) and
             is_replicate(placement_of(m.args[0]))} - {""}
    gathers = [m for m in markers if is_replicate(m.args[1]) and
               is_sharded(placement_of(m.args[0])) and _block(m) in split]
    if not gathers:
        return None
    cost, fallbacks = _cost(gm, world)
    saved = {n: (n.args, dict(n.meta)) for n in gm.graph.nodes}
    for marker in gathers:
        marker.args = (marker.args[0], placement_of(marker.args[0]))
    found = place()
    now, now_fallbacks = _cost(gm, world)
    if set(gm.graph.nodes) == set(saved) and now < cost and now_fallbacks <= fallbacks:
        return found
    for node, (args, meta) in saved.items():
        node.args = args
        node.meta.clear()
        node.meta.update(meta)
    return None


def _cost(gm: fx.GraphModule, world: int) -> tuple[float, int]:
    return (sum(redistribution_costs(gm, world).values()),
            sum(FALLBACK in n.meta for n in gm.graph.nodes))


def _block(node: fx.Node) -> str:
    return list_block(module_fqn(node))
