"""What an op does to memory, as its ATen schema says: the arguments it writes in place and
whether its result shares memory with an input; and, over a graph, the values that share
memory through chains of views (an alias set) and whether any of them is written. Imports
no pass: the rule table, propagation and the alias pass all ask these questions."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..kernels.torch_compat import OpOverload
from .graph import COLLECTIVE, MODE_REGION, tensor_inputs

aten = torch.ops.aten


def returns_alias(target) -> bool:
    """Whether an ATen op's result shares memory with an input, as its schema says (a view
    such as ``slice``, ``split``'s results, an in-place op's return)."""
    return isinstance(target, OpOverload) and \
        any(r.alias_info is not None for r in target._schema.returns)


# ops that update their running statistics in training, which their schemas do not mark
_UNMARKED_WRITES = {aten.native_batch_norm.default: (3, 4), aten.batch_norm.default: (3, 4)}


def written_args(target) -> tuple[int, ...]:
    """The positions of the arguments an ATen op writes in place (``add_``'s first,
    ``native_batch_norm``'s running statistics, 3 and 4): those inputs must keep their
    placements, so the op writes the caller's tensors, not redistributed copies."""
    if not isinstance(target, OpOverload):
        return ()
    return _UNMARKED_WRITES.get(target) or tuple(
        i for i, a in enumerate(target._schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write)


def is_pure(target) -> bool:
    """The op draws no random numbers and writes nothing (``getitem`` of a result too)."""
    if not isinstance(target, OpOverload):
        return target is operator.getitem
    return torch.Tag.nondeterministic_seeded not in target.tags and not written_args(target)


def made_of_held_tensors(nodes, through_collectives: bool = False) -> set:
    """Of ``nodes`` (in graph order): reads of held tensors, and what ops that draw no
    random numbers and write nothing (with ``through_collectives``, also collectives: a
    gradient sync's bucket) compute of those alone, outside autocast and no-grad regions.
    Such values may be computed anywhere before their readers."""
    found: set[fx.Node] = set()
    for node in nodes:
        if node.op == "get_attr" or node.op == "call_function" and node.all_input_nodes and \
                all(a in found for a in node.all_input_nodes) and \
                not node.meta.get(MODE_REGION) and \
                (is_pure(node.target) or through_collectives and COLLECTIVE in node.meta):
            found.add(node)
    return found


def writes_first_input(target) -> bool:
    """Whether an ATen op writes its first argument in place (``add_``, ``index_put_``)."""
    return 0 in written_args(target)


def written_inputs(node: fx.Node) -> list[int]:
    """The indices, among ``tensor_inputs(node)``, of the tensors ``node`` writes in place."""
    inputs = tensor_inputs(node)
    return [inputs.index(node.args[p]) for p in written_args(node.target)
            if p < len(node.args) and node.args[p] in inputs]


def aliases_first_input(node: fx.Node) -> bool:
    """Whether ``node``'s result shares memory with its first argument, as its schema says
    (a view, an in-place op's return, a part of a ``split``)."""
    if node.op != "call_function" or not node.args:
        return False
    if node.target is operator.getitem:
        return aliases_first_input(node.args[0])
    return returns_alias(node.target)


def alias_root(node: fx.Node) -> fx.Node:
    """The value ``node`` is a view of, through any chain of views."""
    while aliases_first_input(node) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def alias_set(root: fx.Node) -> list[fx.Node]:
    """Every op whose result shares memory with ``root`` through views of it (``root``
    itself not included)."""
    found, stack, reached = [], [root], {root}
    while stack:
        for user in stack.pop().users:
            if user not in reached and aliases_first_input(user) and user.args[0] in reached:
                found.append(user)
                reached.add(user)
                stack.append(user)
    return found


def written_through(node: fx.Node) -> bool:
    """Whether an in-place op writes into ``node``'s value or into a view of it."""
    return any(tensor_inputs(user)[i] is value for value in (node, *alias_set(node))
               for user in value.users for i in written_inputs(user))
