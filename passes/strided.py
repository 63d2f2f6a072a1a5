"""Strided pass: serve a fused projection's split without a gather (Megatron's fused QKV).

A colwise projection whose output is split into parts along its sharded dim
(``q, k, v = qkv(x).split(D, -1)``, ``w13(x).chunk(2, -1)``, gpt-fast's grouped-query
``wqkv(x).split([dim, kv, kv], -1)``, Phi-3's slices ``qkv[..., :D]``,
``qkv[..., D:D + kv]``, timm's ``qkv(x).reshape(B, N, 3, heads, head_dim)``, ...) gives
each rank a contiguous chunk of ``[q|k|v]``, which cannot serve the split, so propagation
gathers it. Laid out in blocks, each sharded
(``_StridedShard(d, split_factor=k)`` for k equal parts, ``BlockShard(d, sizes)`` for
unequal ones), each rank holds ``[q_r|k_r|v_r]`` and every part comes out ``Shard(d)``
with no communication.

After a first propagation, for every op that gathers a ``Shard(d)`` input its rule could
take blocked, this pass walks back from that input along the nodes that
carry dim ``d`` with the same size (their chosen strategy shards it on every input it
comes from, with no redistribution) to where the shard comes from. Only when every source
is a parameter and every node on the way has no other user are those parameters re-seeded
blocked, and any ``Shard(d)`` module-boundary layout on the way (a colwise output) becomes
the blocked layout: the same dim is sharded, in another block order. Propagation then runs
again and carries the blocked placement down to the split (the pass keeps a new layout only
if the split's module then redistributes no more than before). Anything else (a tied
parameter, a fused output read elsewhere, parts that do not divide by the world size)
keeps the gather.
"""
from __future__ import annotations

from collections import Counter

import torch.fx as fx
from torch.distributed.tensor import Shard

from .context import PassContext, relayout
from .gather_early import gather_early
from .graph import (FALLBACKS, INPUTS, PLACEMENT, RELAID, layout, module_fqn, placement_of,
                    tensor_inputs, tied_attrs, val)
from .placement import (UnitShard, block_bounds, cut_in_blocks, is_blocked, is_replicate,
                        with_dim)
from .propagate import inputs_cost, propagate
from .rules import rule_for
from .snapshot import Snapshot


@relayout
def stride_fused_splits(gm: fx.GraphModule, ctx: PassContext) -> bool:
    """Re-seed the parameters behind every gathered fused split blocked; True if any was
    (propagation must then run again). A split's new layout is kept only if propagating it
    leaves the split's module redistributing no more (by propagation's own cost) than
    before, or strictly less once the gathers it then needs are placed where
    :func:`gather_early` places them. A part that cannot be served sharded downstream (one
    KV head) is then gathered where it is split, when the small parts' gathers cost less
    than one gather of the fused output (GPT-BigCode's ``c_attn`` at real widths: q stays
    sharded by heads, k and v are gathered, attention runs on this rank's heads). A layout
    that only moves the fused output's gather is not kept: the gather would stay, no longer
    reported as the split's fallback. Where no layout is kept, the graph is put back
    exactly as it was and ``False`` returned."""
    world = ctx.world
    costs = redistribution_costs(gm, world)
    tried: dict[str, dict[fx.Node, tuple]] = {}  # split's module -> node -> old layout
    tied = tied_attrs(gm)
    before = None
    for node in gm.graph.nodes:
        wanted = _wanted(node, world)
        carriers: dict[fx.Node, int] = {}
        blocked = None if wanted is None else _users_layout(node.args[0], world)
        if blocked is None or \
                not carried_from_params(node.args[0], blocked.dim, carriers, first=True):
            continue
        if tied & set(carriers):
            continue  # tied: the same tensor is also read under another name
        before = before or Snapshot(gm.graph)
        old = tried.setdefault(module_fqn(node), {})
        for n, dim in carriers.items():
            old.setdefault(n, (n.meta.get(PLACEMENT), n.args))
            if n.op == "get_attr":
                n.meta[PLACEMENT] = with_dim(blocked, dim)
            elif n.target is layout:
                n.args = (n.args[0], with_dim(blocked, dim))
    if tried:
        fallbacks = gm.meta.get(FALLBACKS)
        placed = redistribution_costs(propagate(gm, ctx), world)
        moved = redistribution_costs(gm, world) if gather_early(gm, ctx).meta[RELAID] else placed
        rejected = [m for m in tried if placed[m] > costs[m] and moved[m] >= costs[m]]
        if len(rejected) == len(tried):
            before.restore()
            gm.meta[FALLBACKS] = fallbacks
            return False
        for module in rejected:
            for n, (placement, args) in tried[module].items():
                n.meta[PLACEMENT], n.args = placement, args
    return bool(tried)


def redistribution_costs(gm: fx.GraphModule, world: int) -> Counter:
    """Module FQN -> what its nodes' input redistributions cost, as propagation costs them
    (bytes sent per rank, plus a latency term per collective)."""
    costs = Counter()
    for node in gm.graph.nodes:
        needed = node.meta.get(INPUTS) if node.op == "call_function" else None
        if needed:
            args = tensor_inputs(node)
            costs[module_fqn(node)] += inputs_cost([placement_of(a) for a in args], needed,
                                                   [val(a) for a in args], world)
    return costs


def _wanted(node: fx.Node, world: int, actual=None):
    """The blocked placement (``_StridedShard`` or ``BlockShard``) that ``node``'s rule
    could take for its first input, which is ``Shard`` (or, given ``actual``, arrives so)
    on the same dim and which the chosen strategy gathers; else ``None``."""
    rule = rule_for(node.target) if node.op == "call_function" else None
    if rule is None or not tensor_inputs(node):
        return None
    now = [placement_of(a) for a in tensor_inputs(node)]
    if not isinstance(now[0], Shard) or node.meta[INPUTS][0] == now[0]:
        return None
    for ins, _ in rule.strategies(node, world, actual or now):
        if is_blocked(ins[0]) and ins[0].dim == now[0].dim and \
                (actual is None or ins[0] == actual[0]):
            return ins[0]
    return None


def _users_layout(fused: fx.Node, world: int):
    """The one blocked layout of ``fused`` that serves all its users (one split, or the
    slices of Phi-3's ``qkv[..., a:b]``: their blocks' cuts merged), or ``None``."""
    users = list(fused.users)
    wanted = [_wanted(u, world) if u.args[0] is fused else None for u in users]
    if not wanted or None in wanted or len({w.dim for w in wanted}) != 1:
        return None
    size = val(fused).shape[wanted[0].dim]
    ends = sorted({end for w in wanted for _, end in block_bounds(w, size)})
    merged = cut_in_blocks(wanted[0].dim, [b - a for a, b in zip([0] + ends, ends)])
    if all(_wanted(u, world, [merged] + [placement_of(a) for a in tensor_inputs(u)[1:]])
           == merged for u in users):
        return merged
    return None


def carried_from_params(node: fx.Node, dim: int, carriers: dict, first: bool = False) -> bool:
    """Whether ``node``'s sharded ``dim`` comes, index for index and through nodes with
    one user each (``first``: the fused output itself may have several, checked by
    :func:`_all_users_want`), from parameters or layouts of replicated values only; records
    every node on the way in ``carriers`` (node -> its dim)."""
    if len(node.users) != 1 and not first:
        return False
    carriers[node] = dim
    if node.op == "get_attr" or node.target is layout and is_replicate(placement_of(node.args[0])):
        return True  # a parameter, or a replicated value's layout: any slice of it is free
    p = placement_of(node)
    if node.op != "call_function" or not (isinstance(p, (Shard, UnitShard)) and p.dim == dim):
        return False
    size, carried = val(node).shape[dim], False
    for arg, needed in zip(tensor_inputs(node), node.meta[INPUTS]):
        if needed is None or is_replicate(needed):
            continue
        if not (isinstance(needed, (Shard, UnitShard)) and placement_of(arg) == needed and
                _same_static(val(arg).shape[needed.dim], size) and
                carried_from_params(arg, needed.dim, carriers)):
            return False
        carried = True
    return carried


def _same_static(a, b) -> bool:
    return isinstance(a, int) and isinstance(b, int) and a == b

