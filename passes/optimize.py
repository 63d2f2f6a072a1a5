"""Post-rewrite passes: fewer and larger collectives, same program.

They run on any graph whose collectives are calls of :mod:`fxtp.kernels.collectives` functions:
fxtp's own ``GraphModule`` and the graph dynamo makes of it under ``torch.compile``.
Each pass keeps forward values and gradients exactly (the backward of each collective is
its conjugate, so removing a forward pair removes the matching backward pair too), keeps
the order in which collectives are issued identical on every rank, and works from call
arguments alone (no placements needed).

* :func:`cancel_round_trips`: ``shard`` then ``all_gather`` along the same dim (or the
  reverse) -> nothing; ``reduce_scatter`` then ``all_gather`` -> one ``all_reduce``. Where
  the gather reduce-scattered a partial gradient, a ``grad_sync`` keeps that sum (one
  backward all-reduce instead of a reduce-scatter and an all-gather).
* :func:`merge_redundant`: the same value redistributed twice in the same way -> once
  (unless it is written in place in between).
* :func:`bucket`: independent collectives of one kind, group and dtype whose inputs are
  ready before the first of their results is needed -> one bucketed collective (not those
  of values written in place, which moving them could read before or after the write, nor
  those whose results are written in place before the bucket would issue: moving the write
  after the bucket would move it past reads of what it writes).
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from ..kernels import collectives as C
from .aliases import written_groups, written_roots, written_values
from .effects import alias_root
from .gradients import gradient_carriers
from .graph import COLLECTIVE, call_args, val
from .placement import numel_hint

BUCKET_CAP_BYTES = 4 << 20
"""Largest bucket: past a few MiB a collective is bandwidth-bound and bucketing only
delays the first tensors."""

def optimize(gm: fx.GraphModule) -> fx.GraphModule:
    """Run every pass on ``gm`` in place; return it."""
    cancel_round_trips(gm.graph)
    merge_redundant(gm.graph)
    bucket(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return gm


def collective_args(node: fx.Node) -> Optional[dict]:
    """A collective call's arguments by parameter name (defaults filled), else ``None``."""
    return call_args(node) if node.op == "call_function" and node.target in C.COLLECTIVES \
        else None


def merge_redundant(graph: fx.Graph) -> None:
    seen: dict[tuple, fx.Node] = {}
    for node in list(graph.nodes):
        for stale in written_groups(node):  # a write in place makes earlier results stale
            seen = {k: v for k, v in seen.items() if collective_args(v)["x"] not in stale}
        args = collective_args(node)
        if args is None:
            continue
        key = (node.target, *args.values())
        if key in seen:
            node.replace_all_uses_with(seen[key])
            graph.erase_node(node)
        else:
            seen[key] = node


def cancel_round_trips(graph: fx.Graph) -> None:
    written = written_values(graph)
    for node in list(graph.nodes):
        outer = collective_args(node)
        if outer is None or not isinstance(outer["x"], fx.Node):
            continue
        inner_node = outer["x"]
        inner = collective_args(inner_node)
        if inner is None or inner["group"] != outer["group"] or \
                isinstance(inner["x"], fx.Node) and alias_root(inner["x"]) in written or \
                inner.get("dim") != outer.get("dim") or \
                inner.get("blocks", 1) != outer.get("blocks", 1):
            continue
        pair = (inner_node.target, node.target)
        with graph.inserting_before(node):
            if pair == (C.shard, C.all_gather):
                value = inner["x"]
            elif pair == (C.all_gather, C.shard) and not inner["partial_grad"]:
                value = inner["x"]
            elif pair == (C.reduce_scatter, C.all_gather) and len(inner_node.users) == 1:
                value = graph.call_function(C.all_reduce, (inner["x"], outer["group"]))
                value.meta.update(node.meta, **{COLLECTIVE: "all_reduce"})
            else:
                continue
            if outer.get("partial_grad"):  # its backward summed the gradient: keep that
                value = graph.call_function(C.grad_sync, (value, outer["group"]))
                value.meta.update(node.meta, **{COLLECTIVE: "grad_sync"})
        node.replace_all_uses_with(value)
        graph.erase_node(node)
        if not inner_node.users:
            graph.erase_node(inner_node)


# Arguments that must agree for collectives to share a bucket (besides kind and dtype).
_SHARED = {C.all_reduce: ("group",), C.grad_sync: ("group",),
           C.all_gather: ("rank", "world", "group", "partial_grad"),
           C.reduce_scatter: ("world", "group"), C.shard: ("rank", "world", "group")}
_BACKWARD_ONLY = (C.grad_sync, C.shard)  # communicate only for values that need gradients


def bucket(graph: fx.Graph) -> None:
    """Bucket one group at a time: each merge adds dependencies that the next search
    must see."""
    while (found := _next_bucket(graph)) is not None:
        found.emit(graph)


def _next_bucket(graph: fx.Graph) -> Optional["_Bucket"]:
    """The first group of at least two collectives that can issue as one, in graph order."""
    with_grad = gradient_carriers(graph, _may_need_grad)
    written = written_values(graph)
    position = {n: i for i, n in enumerate(graph.nodes)}
    open_buckets: dict[tuple, _Bucket] = {}
    for node in graph.nodes:
        args = collective_args(node)
        if args is None or node.target not in _SHARED or args.get("blocks", 1) != 1:
            continue  # the bucketed forms lay out contiguous shards only
        if isinstance(args["x"], fx.Node) and alias_root(args["x"]) in written:
            continue  # moved to the bucket, it could read its input before or after a write
        value = _value(args["x"])
        if value is None or (node.target in _BACKWARD_ONLY and args["x"] not in with_grad):
            continue
        key = (node.target, value.dtype, *(args[k] for k in _SHARED[node.target]))
        nbytes = numel_hint(value) * value.element_size()
        b = open_buckets.get(key)
        reach = _downstream(node)
        if b is not None and not b.admits(args["x"], nbytes, reach, position):
            if len(b.members) > 1:
                return b
            b = None
        if b is None:
            b = open_buckets[key] = _Bucket()
        b.add(node, nbytes, reach, position)
    ready = [b for b in open_buckets.values() if len(b.members) > 1]
    return ready[0] if ready else None


class _Bucket:
    """Collectives that can issue as one: none reads a value computed from another's
    result."""

    def __init__(self):
        self.members: list[fx.Node] = []
        self.downstream: set[fx.Node] = set()  # everything computed from the members
        self.nbytes = 0
        self.anchor = -1  # the position of the last member's input: where it issues
        self.first_write = float("inf")  # of an in-place write computed from a member

    def admits(self, x: fx.Node, nbytes: int, reach: set, position: dict) -> bool:
        """Whether a collective of input ``x`` and downstream ``reach`` may join: it reads
        no member's result, the bucket stays under the cap, and no in-place write computed
        from a member would move after the bucket (past reads of what it writes)."""
        return x not in self.downstream and self.nbytes + nbytes <= BUCKET_CAP_BYTES and \
            min(self.first_write, _first_write(reach, position)) > \
            max(self.anchor, position[x])

    def add(self, node: fx.Node, nbytes: int, reach: set, position: dict) -> None:
        self.members.append(node)
        self.nbytes += nbytes
        self.downstream |= reach
        self.anchor = max(self.anchor, position[collective_args(node)["x"]])
        self.first_write = min(self.first_write, _first_write(reach, position))

    def emit(self, graph: fx.Graph) -> None:
        """Issue the bucket right after the last of its inputs; what reads the members'
        results before that point moves after it, in order."""
        fn = self.members[0].target
        members = [collective_args(node) for node in self.members]
        xs = [args["x"] for args in members]
        position = {n: i for i, n in enumerate(graph.nodes)}
        anchor = max(xs, key=position.__getitem__)
        if anchor.op == "placeholder":
            anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]
        late = sorted((n for n in self.downstream if position[n] < position[anchor]),
                      key=position.__getitem__)
        extra = {k: members[0][k] for k in _SHARED[fn]}
        if "dim" in members[0]:
            extra["dims"] = [args["dim"] for args in members]
        with graph.inserting_after(anchor):
            cursor = graph.call_function(C.BUCKETS[fn], (xs,), extra)
        cursor.meta[COLLECTIVE] = f"{fn.__name__}_bucket"
        call = cursor
        for i, node in enumerate(self.members):
            with graph.inserting_after(cursor):
                cursor = graph.call_function(operator.getitem, (call, i))
            cursor.meta.update(node.meta)
            node.replace_all_uses_with(cursor)
            graph.erase_node(node)
        for node in late:
            if node not in self.members:
                cursor.append(node)
                cursor = node


def _downstream(node: fx.Node) -> set:
    """Every node computed from ``node``'s result."""
    found, todo = set(), [node]
    while todo:
        for user in todo.pop().users:
            if user not in found:
                found.add(user)
                todo.append(user)
    return found


def _first_write(nodes: set, position: dict) -> float:
    """The position of the first of ``nodes`` that writes a tensor in place."""
    return min((position[n] for n in nodes if written_roots(n)), default=float("inf"))


def _may_need_grad(node: fx.Node, value) -> bool:
    """A parameter that requires gradients, or a floating-point input (fake values of
    activations do not say whether they will require them)."""
    return isinstance(value, torch.Tensor) and (
        value.requires_grad or node.op == "placeholder" and value.is_floating_point())


def _value(node) -> Optional[torch.Tensor]:
    """The (fake) tensor a node computes, if it is one."""
    v = val(node)
    return v if isinstance(v, torch.Tensor) else None
