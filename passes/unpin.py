"""Leave a plan's layouts where keeping them only costs: values gathered to be split again,
and partial sums reduced one by one where they are added up.

A layout is only a module boundary's communication: the values are the same whatever it is.
Two patterns make the plan's layouts a cost, not a need:

* Plans written for DTensor gather inside a block what DTensor cannot compute on shards,
  and split it again for the next projection: Hugging Face's ``colwise_gather_output``
  before a fused ``chunk`` (GLM, Phi-3) or a norm over all heads (OLMo-2), then
  ``rowwise_split_input``. fxtp computes on the shards those ops see (strided splits, a
  norm's partial mean).
* Row-parallel outputs that are summed: a parallel block's attention and MLP
  (``x + attn(x) + mlp(x)``: GPT-J, GPT-NeoX, Cohere, Phi), or experts in a ``ModuleList``
  adding their outputs into zeros (Mistral's and litgpt's mixture of experts). Each
  output's plan layout reduces it alone; the sum of partial sums reduces once (GPT-NeoX's
  and Megatron's hand-written blocks do so), and zeros to add into are a partial sum too.

:func:`unpin_layouts` tries each pattern in turn: it leaves the matching layouts as their
values are produced (and makes the zeros the partial sums are added into partial), places
the graph again and keeps that only if the program then sends strictly less, forward and
backward (the rewrite is run on a copy of the graph and its collectives counted: bytes per
rank and a fixed cost each), with no more fallbacks; otherwise every placement is as
before.
"""
from __future__ import annotations

from collections import defaultdict

import torch.fx as fx
from torch.distributed.tensor import Partial

from .buffers import writes_into
from .context import PassContext
from .graph import (FALLBACKS, INTO_PARTIAL, PINNED, RELAID, branches, layout, list_block,
                    module_fqn, placement_of)
from .placement import is_replicate, is_sharded
from .program_cost import kept_if_cheaper
from .rules import ZERO_FILLED

Trial = tuple[list[fx.Node], list[fx.Node]]
"""Layout markers to leave as their values are produced, zero-filled tensors to make
partial."""


def unpin_layouts(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Try, in turn, unpinning the gathers split again and the partial sums reduced apart,
    placing the program again (``ctx.place``) for each. Keep each that redistributes less
    with no more fallbacks (``gm.meta[FALLBACKS]`` then its fallbacks);
    ``gm.meta[RELAID]``: whether one was kept."""
    gm.meta[RELAID] = False
    if any(branches(gm, node) for node in gm.graph.nodes):
        return gm  # the rewrite edits torch.cond branches in place: no trial run
    kept = False
    for find in (_gathers_split_again, _partial_sums_added_up):
        markers, zeros = find(gm)
        if markers:
            kept = _try(gm, ctx, markers, zeros) or kept
    gm.meta[RELAID] = kept
    return gm


def _try(gm: fx.GraphModule, ctx: PassContext, markers: list[fx.Node],
         zeros: list[fx.Node]) -> bool:
    def unpin() -> list:
        for marker in markers:
            marker.args = (marker.args[0], placement_of(marker.args[0]))
        for node in zeros:
            node.meta[PINNED] = Partial()
        for node, reached in _upstream(gm, markers).items():
            if reached:  # adds computed from what the markers leave unreduced
                node.meta[INTO_PARTIAL] = True
        return ctx.place(gm, ctx).meta[FALLBACKS]
    return kept_if_cheaper(gm, ctx.world, unpin)


def _gathers_split_again(gm: fx.GraphModule) -> Trial:
    """The replicated layouts of sharded values in the blocks that split a replicated value
    again for a sharded layout."""
    markers = _markers(gm)
    split = {_block(m) for m in markers if is_sharded(m.args[1]) and
             is_replicate(placement_of(m.args[0]))} - {""}
    return [m for m in markers if is_replicate(m.args[1]) and
            is_sharded(placement_of(m.args[0])) and _block(m) in split], []


def _partial_sums_added_up(gm: fx.GraphModule) -> Trial:
    """The layouts reducing partial sums that another such layout of the same list of
    blocks neither feeds nor reads (siblings: a parallel block's attention and MLP, the
    experts of a layer), and the zero-filled tensors their values are written into."""
    markers = [m for m in _markers(gm) if isinstance(placement_of(m.args[0]), Partial)
               and not isinstance(m.args[1], Partial)]
    if len(markers) < 2:
        return [], []
    bit = {m: 1 << i for i, m in enumerate(markers)}
    upstream = _upstream(gm, markers)
    lists = defaultdict(list)
    for m in markers:
        lists[_block(m).rpartition(".")[0]].append(m)
    siblings = [m for group in lists.values() for m in group
                if any(not (upstream[m] & bit[o] or upstream[o] & bit[m])
                       for o in group if o is not m)]
    reached = 0
    for m in siblings:
        reached |= bit[m]
    zeros = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ZERO_FILLED
             and is_replicate(placement_of(n)) and _written_from(n, upstream, reached)]
    return siblings, zeros


def _upstream(gm: fx.GraphModule, markers: list[fx.Node]) -> dict[fx.Node, int]:
    """Each node -> the markers it is computed from, as bits (``1 << i`` for
    ``markers[i]``)."""
    bit = {m: 1 << i for i, m in enumerate(markers)}
    upstream: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        found = 0
        for source in node.all_input_nodes:
            found |= upstream[source] | bit.get(source, 0)
        upstream[node] = found
    return upstream


def _written_from(node: fx.Node, upstream: dict, markers: int) -> bool:
    """Whether a value computed from one of ``markers`` is written in place into ``node``
    (or a view of it)."""
    return any(upstream[writer] & markers for writer, *_ in writes_into(node))


def _markers(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.target is layout]


def _block(node: fx.Node) -> str:
    return list_block(module_fqn(node))
