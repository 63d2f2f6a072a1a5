"""The projections of a traced program and the values that flow between them: what
Megatron's layout pairs column-wise then row-wise.

A *projection* is a module whose weight one op of the program multiplies by (``linear``,
``x @ w.T`` as Falcon's linears multiply, Hugging Face's transposed ``Conv1D`` as ``addmm``,
``embedding``). A value's *sources* are
the linears whose outputs reach it, and whether it is also computed from the *stream*: an
embedding of the program's inputs (tokens) or a floating-point input of the program
(constants such as rotary tables, masks and T5's position bias, computed from buffers and
positions, are neither). A linear whose input
comes from other linears and not from the stream is the second of a pair: those linears
are column-wise and it is row-wise. Whether the ops between them keep the features split
(pointwise ops, views, attention: *carriers*) or need them whole (a norm over them) is
left to fxtp's placement: a pair it cannot shard without a fallback is dropped
(:mod:`fxtp.planning.derive`). The head is found through carriers alone.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional

import torch
import torch.fx as fx
import torch.nn as nn

from ..passes.effects import returns_alias
from ..passes.graph import module_fqns, transposed_matrix, val
from ..passes.rules import is_tagged_pointwise

aten = torch.ops.aten

_CARRIERS = {
    aten.scaled_dot_product_attention, aten._scaled_dot_product_flash_attention_for_cpu,
    aten.matmul, aten.bmm, aten._softmax, aten.softmax, aten._log_softmax, aten.log_softmax,
    aten.cat, aten.stack, aten.clone, aten.contiguous, aten._to_copy, aten.to, aten.type_as,
    aten.dropout, aten.native_dropout, aten.masked_fill, aten.where, aten.reshape, aten.repeat,
    aten.repeat_interleave, aten.flatten, aten.unflatten, aten.split, aten.chunk,
    aten.unbind, aten.einsum, aten.baddbmm, aten.view_as_complex, aten.view_as_real,
}
_NORMS = {aten.layer_norm, aten.native_layer_norm, aten.rms_norm, aten._fused_rms_norm,
          aten.group_norm, aten.native_group_norm}
_LOSSES = {aten.cross_entropy_loss, aten.nll_loss, aten.nll_loss_forward, aten.nll_loss2d}


@dataclass
class Projection:
    """A module the program multiplies by its weight: ``kind`` ``"linear"`` (``nn.Linear``
    or a transposed ``Conv1D``) or ``"embedding"``."""

    fqn: str
    kind: str
    nodes: list = field(default_factory=list)  # its calls in the graph
    feeds: set = field(default_factory=set)  # linears whose outputs reach its input
    from_stream: bool = False  # its input is also computed from the stream
    to_output: bool = False  # its output reaches the program's output through carriers
    to_loss: bool = False  # ... or a cross-entropy computed in the program


def projections(gm: fx.GraphModule, model: nn.Module, aliases: Optional[dict] = None
                ) -> tuple[dict[str, Projection], "Sources"]:
    """FQN -> :class:`Projection` of every projection ``gm`` (traced from ``model``) calls,
    in the order of first call, and the :class:`Sources` of the program's values.
    ``aliases``: parameter FQN -> every FQN of the same tensor (a head tied to the
    embedding reads one tensor under either name)."""
    modules = dict(model.named_modules())
    found: dict[str, Projection] = {}
    at: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        kind, fqn = _projection_of(node, modules, aliases or {})
        if fqn is not None:
            found.setdefault(fqn, Projection(fqn, kind)).nodes.append(node)
            at[node] = fqn
    sources = Sources(gm.graph, at, {f for f, p in found.items() if p.kind == "linear"})
    for fqn, p in found.items():
        if p.kind == "linear":
            for node in p.nodes:
                feeds, stream = sources.of(node.args[0])
                p.feeds |= feeds
                p.from_stream |= stream
        p.to_output, p.to_loss = _reaches_output(p.nodes)
    return found, sources


def _projection_of(node: fx.Node, modules: dict, aliases: dict
                   ) -> tuple[Optional[str], Optional[str]]:
    """``(kind, module FQN)`` where ``node`` multiplies by a module's own weight (under any
    of the weight's names)."""
    if node.op != "call_function":
        return None, None
    if node.target is aten.linear.default:
        weight = node.args[1]
    elif node.target in (aten.matmul.default, aten.mm.default):
        weight = transposed_matrix(node.args[1])
    elif node.target is aten.addmm.default:
        weight = node.args[2]
    elif node.target is aten.embedding.default:
        weight = node.args[0]
    else:
        return None, None
    if not isinstance(weight, fx.Node) or weight.op != "get_attr":
        return None, None
    called = set(module_fqns(node))  # a tied weight: the name of the module called first
    names = sorted(aliases.get(weight.target, [weight.target]),
                   key=lambda fqn: fqn.rpartition(".")[0] not in called)
    for fqn in names:
        owner, _, name = fqn.rpartition(".")
        module = modules.get(owner)
        if name != "weight" or module is None:
            continue
        if node.target is aten.embedding.default and isinstance(module, nn.Embedding):
            return "embedding", owner
        if node.target is not aten.embedding.default and node.target is not \
                aten.addmm.default and isinstance(module, nn.Linear):
            return "linear", owner
        if node.target is aten.addmm.default and type(module).__name__ == "Conv1D":
            return "linear", owner
    return None, None


def carries(node: fx.Node) -> bool:
    """Does ``node`` keep a feature split among ranks split (see the module docstring)?"""
    target = node.target
    if node.op != "call_function":
        return False
    if target is operator.getitem:
        return True
    packet = getattr(target, "overloadpacket", None)
    return packet in _CARRIERS or is_tagged_pointwise(target) or \
        (packet is not None and returns_alias(target) and not _is_reduction(target))


def reduced_between(found: dict[str, Projection], columns: list[str], rows: list[str]
                    ) -> bool:
    """Whether a sum (a reduction or a norm: a norm's sum over the features, across heads)
    lies between the column-wise linears ``columns`` of a pair and its row-wise ``rows``:
    sharded by features, such a pair needs sums of its own between them. Other ops that
    carry no split (an index picking heads) sum nothing."""
    ends = {i for f in rows for n in found[f].nodes for i in n.all_input_nodes}
    projected = {n for p in found.values() for n in p.nodes}
    after, stack = set(), [n for f in columns for n in found[f].nodes]
    while stack:  # what the columns' outputs reach before another projection
        for user in stack.pop().users:
            if user not in after and user not in projected:
                after.add(user)
                stack.append(user)
    stack, seen = [e for e in ends if e in after], set()
    while stack:  # of that, what reaches the row's input
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "call_function" and _sums(node.target):
            return True
        stack.extend(i for i in node.all_input_nodes if i in after)
    return False


def _sums(target) -> bool:
    return getattr(target, "overloadpacket", None) in _NORMS or _is_reduction(target)


@lru_cache(maxsize=None)
def _is_reduction(target) -> bool:
    return torch.Tag.reduction in getattr(target, "tags", ())


class Sources:
    """The linears each value of ``graph`` comes from, and whether it also comes from the
    stream (see the module docstring); ``at``: projection call -> its module's FQN."""

    def __init__(self, graph: fx.Graph, at: dict, linears: set):
        self.at, self.linears = at, linears
        self.position = {node: i for i, node in enumerate(graph.nodes)}
        self.known: dict[fx.Node, tuple[frozenset, bool, bool]] = {}
        self.of_inputs: dict[fx.Node, bool] = {}  # computed from the program's inputs

    def of(self, value) -> tuple[set, bool]:
        feeds, stream, _ = self._walk(value)
        return set(feeds), stream

    def _walk(self, value) -> tuple[frozenset, bool, bool]:
        """``(linears, stream, constant)`` for ``value``."""
        if not isinstance(value, fx.Node):
            return frozenset(), False, True
        if value in self.known:
            return self.known[value]
        stack, order = [value], set()
        while stack:  # the producers first, without recursion (deep graphs)
            node = stack.pop()
            if node in self.known or node in order:
                continue
            order.add(node)
            stack.extend(i for i in node.all_input_nodes if i not in self.known)
        for node in sorted(order, key=self.position.__getitem__):
            self.of_inputs[node] = node.op == "placeholder" or any(
                self.of_inputs[i] for i in node.all_input_nodes)
            self.known[node] = self._decide(node)
        return self.known[value]

    def _decide(self, node: fx.Node) -> tuple[frozenset, bool, bool]:
        fqn = self.at.get(node)
        inputs = [self.known[i] for i in node.all_input_nodes]
        if fqn in self.linears:  # a linear starts a chain
            return frozenset({fqn}), False, False
        if fqn is not None:  # an embedding of the inputs (tokens) is the stream; of positions
            data = self.of_inputs[node.args[1]]  # made from sizes and buffers, a constant
            return frozenset(), data, not data
        if node.op in ("placeholder", "get_attr") or not inputs or \
                all(constant for _, _, constant in inputs):
            stream = node.op == "placeholder" and _is_stream_input(node)
            return frozenset(), stream, not stream
        feeds = frozenset().union(*(f for f, _, _ in inputs))
        if carries(node) or feeds:  # an op that may need features whole (a per-head norm
            return feeds, any(s for _, s, _ in inputs), False  # may not): placing decides
        return frozenset(), True, False


def _is_stream_input(node: fx.Node) -> bool:
    """A floating-point input of the program (hidden states passed in) is computed data; an
    integer one (token ids, positions) only indexes."""
    v = val(node)
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def _reaches_output(nodes: list) -> tuple[bool, bool]:
    """Whether the outputs of ``nodes`` reach the program's output, and a loss, through
    carriers."""
    seen, stack = set(), list(nodes)
    output = loss = False
    while stack:
        node = stack.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if user.op == "output":
                output = True
            elif getattr(user.target, "overloadpacket", None) in _LOSSES:
                loss = True
            elif carries(user):
                stack.append(user)
    return output, loss
