"""Written values: a buffer written in place (a KV cache), or a fresh tensor a factory
made to be written into (``new_empty`` filled by slice assignments), takes the placement of
what is written into it.

A buffer the plan does not shard, or a factory's output, is replicated, so writing a
head-sharded ``k`` into it would gather ``k``, and every rank would hold the whole tensor.
For every such value that the program writes in place (``index_put_``, ``index_copy_``,
``copy_``, ... on the value itself or on a view of it, such as the slice a slice assignment
writes; or as the state an op updates, BatchNorm's running statistics), the placement that
lets each write keep the written value's placement is read off the rules of the writer and
of the views between it and the value; a write of a replicated value accepts any (each
rank writes its part). Where the writes of sharded values agree,
the buffer's ``get_attr`` nodes get that placement (``meta[PLACEMENT]``), and the factory
is pinned to make it (``meta[PINNED]``), so localization keeps only this rank's part of it;
propagation must then run again.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch.fx as fx
from torch.distributed.tensor import Shard

from ..kernels.torch_compat import OpOverload
from .context import PassContext, relayout
from .effects import written_args, written_inputs
from .graph import PINNED, PLACEMENT, placement_of, tensor_inputs
from .placement import is_replicate, is_sharded
from .rules import FACTORIES, rule_for


@relayout
def shard_written_buffers(gm: fx.GraphModule, ctx: PassContext) -> bool:
    """Place each replicated buffer of ``gm`` and pin each factory's replicated output that
    is written in place as its writes need; return whether any placement changed."""
    world = ctx.world
    buffers = {name for name, _ in gm.named_buffers()}
    reads: dict[object, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in buffers:
            reads.setdefault(node.target, []).append(node)
        elif node.op == "call_function" and node.target in FACTORIES:
            reads[node] = [node]
    changed = False
    for nodes in reads.values():
        if not all(is_replicate(placement_of(n)) for n in nodes):
            continue
        wanted = {_wanted(writer, views, index, world)
                  for n in nodes for writer, views, index in writes_into(n)}
        wanted.discard(ANY)
        if len(wanted) == 1 and (placement := wanted.pop()) is not None:
            for n in nodes:
                n.meta[PINNED if n.op == "call_function" else PLACEMENT] = placement
            changed = True
    return changed


ANY = "any placement"  # what a write of replicated values asks of the value written


def writes_into(node: fx.Node) -> Iterator[tuple[fx.Node, tuple[fx.Node, ...], int]]:
    """``(writer, views, index)``: each in-place write into ``node``'s tensor, the views
    (in order) from ``node`` to the tensor it writes, and that tensor's index among the
    writer's tensor inputs (0, but for state an op updates: BatchNorm's statistics)."""
    stack = [(node, ())]
    while stack:
        source, views = stack.pop()
        for user in source.users:
            if not isinstance(user.target, OpOverload) or not user.args:
                continue
            inputs = tensor_inputs(user)
            written = [i for i in written_inputs(user) if inputs[i] is source]
            if written:
                yield user, views, written[0]
            elif user.args[0] is source and user.target.is_view and \
                    not written_args(user.target):
                stack.append((user, views + (user,)))


def _wanted(writer: fx.Node, views: tuple[fx.Node, ...], index: int, world: int
            ) -> Optional[object]:
    """The placement of the written value (``writer``'s tensor input ``index``) under
    which ``writer`` keeps every other input as it is placed, or else as a local slice of
    its replicated self (a BatchNorm's weight and its other statistic, read on channel
    shards), and at least one of them sharded; :data:`ANY` where they are all replicated;
    else ``None``."""
    rule = rule_for(writer.target)
    inputs = tensor_inputs(writer)
    actual = [placement_of(a) for a in inputs]
    others = [j for j in range(len(inputs)) if j != index]
    if rule is not None and all(is_replicate(actual[j]) for j in others):
        return ANY
    if rule is None or not any(is_sharded(actual[j]) for j in others):
        return None
    strategies = [ins for ins, _ in rule.strategies(writer, world, actual)
                  if is_sharded(ins[index])]
    as_placed = [ins for ins in strategies
                 if all(ins[j] is None or ins[j] == actual[j] for j in others)]
    sliced = [ins for ins in strategies if all(
        ins[j] is None or ins[j] == actual[j] or is_replicate(actual[j]) and type(ins[j]) is Shard
        for j in others)]
    needed = (as_placed or sliced or [[None] * len(inputs)])[0][index]
    for view in reversed(views):
        if needed is None:
            return None
        view_rule = rule_for(view.target)
        if view_rule is None:
            return None
        needed = next((ins[0] for ins, outs in view_rule.strategies(view, world)
                       if outs[0] == needed and is_sharded(ins[0])), None)
    return needed
