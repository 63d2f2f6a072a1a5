"""Strided pass: serve a fused projection's split without a gather (Megatron's fused QKV).

A colwise projection whose output is split into ``k`` equal parts along its sharded dim
(``q, k, v = qkv(x).split(D, -1)``, ``w13(x).chunk(2, -1)``, Phi-3's equal slices
``qkv[..., :D]``, ``qkv[..., D:2 * D]``, ...) gives each rank a contiguous
chunk of ``[q|k|v]``, which cannot serve the split, so propagation gathers it. Laid out as
``_StridedShard(d, split_factor=k)`` each rank holds ``[q_r|k_r|v_r]`` and every part
comes out ``Shard(d)`` with no communication.

After a first propagation, for every op that gathers a ``Shard(d)`` input its rule could
take as ``_StridedShard(d, k)``, this pass walks back from that input along the nodes that
carry dim ``d`` with the same size (their chosen strategy shards it on every input it
comes from, with no redistribution) to where the shard comes from. Only when every source
is a parameter and every node on the way has no other user are those parameters re-seeded
strided, and any ``Shard(d)`` module-boundary layout on the way (a colwise output) becomes
the strided layout: the same dim is sharded, in another block order. Propagation then runs
again and carries the strided placement down to the split. Anything else (a tied
parameter, a fused output read elsewhere, unequal parts) keeps the gather.
"""
from __future__ import annotations

from collections import Counter

import torch.fx as fx
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .graph import INPUTS, PLACEMENT, layout, placement_of, tensor_inputs, val
from .placement import UnitShard, is_replicate
from .rules import rule_for


def stride_fused_splits(gm: fx.GraphModule, world: int) -> bool:
    """Re-seed the parameters behind every gathered fused split strided; True if any was
    (propagation must then run again)."""
    tied = tied_attrs(gm)
    changed = False
    for node in gm.graph.nodes:
        strided = _wanted(node, world)
        carriers: dict[fx.Node, int] = {}
        if strided is None or not _all_users_want(node.args[0], strided, world) or \
                not carried_from_params(node.args[0], strided.dim, carriers, first=True):
            continue
        if tied & set(carriers):
            continue  # tied: the same tensor is also read under another name
        for n, dim in carriers.items():
            placement = _StridedShard(dim, split_factor=strided.split_factor)
            if n.op == "get_attr":
                n.meta[PLACEMENT] = placement
            elif n.target is layout:
                n.args = (n.args[0], placement)
        changed = True
    return changed


def _wanted(node: fx.Node, world: int):
    """The ``_StridedShard`` that ``node``'s rule could take for its first input, which is
    ``Shard`` on the same dim and which the chosen strategy gathers; else ``None``."""
    rule = rule_for(node.target) if node.op == "call_function" else None
    if rule is None or not tensor_inputs(node):
        return None
    actual = [placement_of(a) for a in tensor_inputs(node)]
    if not isinstance(actual[0], Shard) or node.meta[INPUTS][0] == actual[0]:
        return None
    for ins, _ in rule.strategies(node, world, actual):
        if isinstance(ins[0], _StridedShard) and ins[0].dim == actual[0].dim:
            return ins[0]
    return None


def _all_users_want(node: fx.Node, strided, world: int) -> bool:
    """Whether every user of the fused output takes it as ``strided`` (one split, or the
    k slices of Phi-3's ``qkv[..., a:b]``)."""
    return all(_wanted(user, world) == strided and user.args[0] is node for user in node.users)


def tied_attrs(gm: fx.GraphModule) -> set:
    """The ``get_attr`` nodes of tensors the graph reads under more than one name."""
    attrs = [n for n in gm.graph.nodes if n.op == "get_attr"]
    readers = Counter(id(_tensor(gm, n.target)) for n in attrs)
    return {n for n in attrs if readers[id(_tensor(gm, n.target))] > 1}


def carried_from_params(node: fx.Node, dim: int, carriers: dict, first: bool = False) -> bool:
    """Whether ``node``'s sharded ``dim`` comes, index for index and through nodes with
    one user each (``first``: the fused output itself may have several, checked by
    :func:`_all_users_want`), from parameters only; records every node on the way in
    ``carriers`` (node -> its dim)."""
    if len(node.users) != 1 and not first:
        return False
    carriers[node] = dim
    if node.op == "get_attr":
        return True
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


def _tensor(gm: fx.GraphModule, target: str):
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner), name)
