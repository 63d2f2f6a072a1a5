"""Tracing each distinct block once.

A model's blocks (the elements of its ``ModuleList`` s and ``ModuleDict`` s) are mostly
copies of one another. While ``torch.export`` traces the model, the first call of each
kind of block is traced as usual (its *reference*), and every later call of an
equivalent block becomes one ``fxtp::stamp`` node standing for it. After tracing, either

* :meth:`Stamper.keep` keeps each stamp node as the block's call (``meta[STAMP]``, a
  :class:`~fxtp.passes.graph.Stamp`): the passes place, rewrite and localize the
  reference's nodes once, and the block becomes a copy of the reference's module holding
  its own tensors (:func:`fxtp.passes.modules.stamp_modules`); or
* :meth:`Stamper.expand` replaces each stamp node by a copy of the reference's nodes that
  reads the block's own parameters and buffers, so the graph is the one a full trace
  gives and every pass sees every block (where a stamp cannot run its reference's
  program as the passes leave it: :class:`~fxtp.passes.errors.StampMismatch`).

Blocks are equivalent when nothing a trace depends on differs:

* the same class, parameters and buffers (names, shapes, dtypes, ``requires_grad``, ties),
  submodules (names and classes), plan styles, checkpointed and kept modules (relative to
  the block), and no hooks on its submodules;
* the attributes of their own (``__dict__`` entries, ``__slots__`` slots, ``training``)
  that the reference's forward *read* (``layer_idx``, ``sliding_window``, a config
  object) are equal: plain values and ``functools.partial`` s by value, other objects by
  identity;
* the call's arguments have the same structure, tensor metadata (symbolic sizes compared
  as expressions) and non-tensor values, under the same grad mode and autocast state. An
  argument is one wherever it comes from: a root buffer or parameter passed as it is (a
  rotary table), a slice of one or a tensor the caller computed; by position, by keyword
  or inside a tuple.

A call that matches no reference of its kind is traced in full and becomes another
reference (Gemma-2's sliding-window and global layers alternate: each stamps its own).
Blocks nested in a block that is traced (PEFT's adapters, in ``ModuleDict`` s inside each
layer) trace with it, and are stamped with the blocks holding them. A
reference whose nodes do not form a closed region (a value kept on ``self`` and read
outside; a graph input or another module's state read other than through its arguments; a
higher-order op with subgraphs; a gradient hook, whose closure is that call's) makes its
kind traced again without stamping (:class:`Unstampable`). A size it reads from outside
(under a dynamic length, the one ``torch.export`` took from the model's input) it takes
from its own argument of that size instead, where it has one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
from typing import Iterable, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from ..kernels.torch_compat import pytree
from ..passes.graph import FALLBACK, REGION, STAMP, Stamp, attr, module_fqn, stamp_edge
from ..passes.modules import hold, moved_stack
from .hooks import GradientHooks

_OUTPUTS: dict[str, list[tuple]] = {}  # stamp key -> the reference's output tensor metadata
# nn.Module's bookkeeping (``training`` is an attribute a forward reads)
_MODULE_STATE = frozenset(nn.Module().__dict__) - {"training"}
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
          torch.memory_format)


@torch.library.custom_op("fxtp::stamp", mutates_args=())
def _stamp(inputs: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    """Stands for a call of a block equivalent to the reference ``key`` while tracing;
    never left in a traced graph."""
    raise RuntimeError("fxtp::stamp only exists while tracing")


@_stamp.register_fake
def _(inputs, key):
    return [torch.empty_strided(shape, stride, dtype=dtype, device=device)
            for shape, stride, dtype, device, _ in _OUTPUTS[key.rpartition(":")[0]]]


_stamp.register_autograd(lambda ctx, grads: (None, None))


class Shown(Exception):
    """Block ``fqn``, whose tensors were held back from the trace, has to be traced: the
    trace starts over with them."""

    def __init__(self, fqn: str):
        super().__init__(f"block '{fqn}' is traced")
        self.fqn = fqn


class _Held(dict):
    """An empty ``_parameters`` / ``_buffers`` of a module of block ``fqn`` whose tensors
    are held back: reading one of them (``module.weight``, which looks here) raises
    :class:`Shown`. Code outside the block may read them without calling it (PEFT's LoRA
    layers read their adapters' ``weight`` to cast inputs)."""

    def __init__(self, fqn: str, held):
        super().__init__()
        self.fqn, self.held = fqn, frozenset(held)

    def __contains__(self, name):
        if name in self.held:
            raise Shown(self.fqn)
        return False


class Unstampable(Exception):
    """Block ``fqn``'s traced nodes cannot be copied for other blocks (``why``): its kind
    is traced again without stamping."""

    def __init__(self, fqn: str, why: str):
        super().__init__(f"block '{fqn}' {why}")
        self.fqn = fqn


@dataclasses.dataclass
class _Reference:
    fqn: str
    kind: int
    module: nn.Module
    in_spec: pytree.TreeSpec
    in_leaves: list  # non-tensor leaves as they are, tensors as their metadata
    modes: tuple  # grad mode and autocast state at the call
    out_spec: Optional[pytree.TreeSpec] = None
    out_leaves: list = dataclasses.field(default_factory=list)
    reads: dict[str, set[str]] = dataclasses.field(default_factory=dict)  # path -> attrs


class Stamper:
    """Stamps equivalent blocks of ``model`` while it is traced (:meth:`tracing`), then
    expands the stamps in the traced graph (:meth:`expand`). ``blocks``: candidate FQNs;
    ``plan``: FQN -> style; ``kept``: FQNs of modules whose calls must stay marked."""

    def __init__(self, model: nn.Module, blocks: Iterable[str], plan: dict,
                 kept: Iterable[str], shown: Iterable[str] = ()):
        self.model = model
        self.key = f"{id(self)}"
        kept = set(kept)
        kinds: dict[tuple, list[str]] = {}
        for fqn in dict.fromkeys(blocks):
            signature = _signature(model, fqn, plan, kept)
            if signature is not None:
                kinds.setdefault(signature, []).append(fqn)
        self.kind = {fqn: i for i, fqns in enumerate(kinds.values()) if len(fqns) > 1
                     for fqn in fqns}
        self.references: list[_Reference] = []  # the first call of each variant of a kind
        self.stamped: dict[str, str] = {}  # block FQN -> its reference's FQN
        self._depth = 0  # > 0 inside a reference's forward: nested blocks trace in full
        first: dict[int, str] = {}  # a tensor's first name: the one a trace reads it by
        self.canonical = {fqn: first.setdefault(id(t), fqn) for fqn, t in
                          [*model.named_parameters(remove_duplicate=False),
                           *model.named_buffers(remove_duplicate=False)]}
        firsts = set({kind: fqn for fqn, kind in reversed(self.kind.items())}.values())
        traced = tuple(f + "." for f in {*firsts, *shown})  # nested blocks trace with them
        self.hidden = _hideable(model, [f for f in self.kind if f not in firsts and
                                        f not in set(shown) and not f.startswith(traced)])
        self.held_back: list[tuple] = []  # (FQN, tensor, persistent?)

    def same_kind(self, fqn: str) -> list[str]:
        """The blocks stamped from one trace with ``fqn``."""
        return [f for f, kind in self.kind.items() if kind == self.kind.get(fqn)]

    @contextlib.contextmanager
    def tracing(self):
        """Stamp while tracing. The tensors of the blocks expected to be stamped (all but
        the first of each kind) are held back from the trace meanwhile (so the exported
        program does not lift them; :meth:`hand_back` registers them in the result); one
        that has to be traced after all raises :class:`Shown`."""
        patched = []
        for fqn in self.kind:
            module = self.model.get_submodule(fqn)
            if "forward" not in module.__dict__:
                module.forward = self._forward(fqn, module, module.forward)
                patched.append(module)
        stashed = {}
        for fqn in self.hidden:
            for path, module in self.model.get_submodule(fqn).named_modules(
                    remove_duplicate=False):
                prefix = f"{fqn}.{path}." if path else f"{fqn}."
                self.held_back += [(prefix + name, t, True)
                                   for name, t in module._parameters.items() if t is not None]
                self.held_back += [(prefix + name, t,
                                    name not in module._non_persistent_buffers_set)
                                   for name, t in module._buffers.items() if t is not None]
                if id(module) not in stashed:
                    stashed[id(module)] = (module, module._parameters, module._buffers)
                    module.__dict__.update(_parameters=_Held(fqn, module._parameters),
                                           _buffers=_Held(fqn, module._buffers))
        try:
            yield self
        finally:
            for module, parameters, buffers in stashed.values():
                module.__dict__.update(_parameters=parameters, _buffers=buffers)
            for module in patched:
                del module.forward
            for index in range(len(self.references)):
                _OUTPUTS.pop(f"{self.key}:{index}", None)

    def _forward(self, fqn: str, module: nn.Module, forward):
        kind = self.kind[fqn]

        @functools.wraps(forward)
        def call(*args, **kwargs):
            if self._depth:
                if fqn in self.hidden:  # traced after all: its tensors are needed
                    raise Shown(fqn)
                return forward(*args, **kwargs)
            index = next((i for i, r in enumerate(self.references) if r.kind == kind and
                          r.out_spec is not None and self._matches(r, module, args, kwargs)),
                         None)
            if index is None:  # a variant of its kind (a sliding-window layer): traced
                if fqn in self.hidden:
                    raise Shown(fqn)
                if any(r.fqn == fqn for r in self.references):  # a later call: as usual
                    return forward(*args, **kwargs)
                return self._trace_reference(kind, fqn, module, forward, args, kwargs)
            reference = self.references[index]
            self.stamped[fqn] = reference.fqn
            flat, _ = pytree.tree_flatten((args, kwargs))
            outs = iter(torch.ops.fxtp.stamp(
                [x for x in flat if isinstance(x, torch.Tensor)], f"{self.key}:{index}:{fqn}"))
            return pytree.tree_unflatten(
                [next(outs) if isinstance(leaf, _Meta) else leaf
                 for leaf in reference.out_leaves], reference.out_spec)
        call.stamper_patch = True
        return call

    def _trace_reference(self, kind, fqn, module, forward, args, kwargs):
        flat, spec = pytree.tree_flatten((args, kwargs))
        reference = _Reference(fqn, kind, module, spec, [_meta_or_value(x) for x in flat],
                               _modes())
        self.references.append(reference)
        index = len(self.references) - 1
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        if not tensors:
            return forward(*args, **kwargs)  # no region to mark: never stamped
        marks = iter(range(len(tensors)))
        args, kwargs = pytree.tree_unflatten(
            [torch.ops.fxtp.boundary(x, fqn, "stamp-in", str(next(marks)))
             if isinstance(x, torch.Tensor) else x for x in flat], spec)
        self._depth += 1
        try:
            with _recording_reads(module, reference.reads):
                out = forward(*args, **kwargs)
        finally:
            self._depth -= 1
        leaves, out_spec = pytree.tree_flatten(out)
        if UNRECORDED in reference.reads or not any(isinstance(x, torch.Tensor)
                                                    for x in leaves):
            return out  # never stamped (its input marks are removed after tracing)
        reference.out_spec = out_spec
        reference.out_leaves = [_meta_or_value(x) for x in leaves]
        _OUTPUTS[f"{self.key}:{index}"] = [m for m in reference.out_leaves
                                           if isinstance(m, _Meta)]
        marks = iter(range(len(leaves)))
        return pytree.tree_unflatten(
            [torch.ops.fxtp.boundary(x, fqn, "stamp-out", str(next(marks)))
             if isinstance(x, torch.Tensor) else x for x in leaves], out_spec)

    def _matches(self, reference: _Reference, module: nn.Module, args, kwargs) -> bool:
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != reference.in_spec or _modes() != reference.modes:
            return False
        if not all(_same(_meta_or_value(x), r) for x, r in zip(flat, reference.in_leaves)):
            return False
        for path, names in reference.reads.items():
            mine, theirs = module.get_submodule(path), reference.module.get_submodule(path)
            if not all(_same(_own(mine, n), _own(theirs, n)) for n in names):
                return False
        return True

    # --- after tracing ---------------------------------------------------------------------

    def keep(self, gm: fx.GraphModule) -> dict[str, str]:
        """Keep every stamp node in ``gm`` as its block's call (``meta[STAMP]``: a
        :class:`~fxtp.passes.graph.Stamp`), for the passes to treat as that block and
        :mod:`fxtp.passes.modules` to make a copy of the reference's module; the
        reference's arguments and results pass through :func:`stamp_edge` nodes. Return
        block FQN -> reference FQN of the blocks stamped."""
        graph = gm.graph
        stamps = [n for n in graph.nodes if n.target is torch.ops.fxtp.stamp.default]
        kept: dict[str, Stamp] = {}
        for fqn, nodes in (self._regions(graph) if stamps else {}).items():
            ends: dict[str, dict[int, fx.Node]] = {"stamp-in": {}, "stamp-out": {}}
            for node in nodes:
                if _stamp_mark(node):
                    with graph.inserting_before(node):
                        edge = graph.call_function(stamp_edge, (node.args[0],))
                    edge.meta = dict(node.meta)
                    node.replace_all_uses_with(edge)
                    graph.erase_node(node)
                    ends[node.args[2]][int(node.args[3])] = edge
            kept[fqn] = Stamp(fqn, *[[found[i] for i in range(len(found))]
                                     for found in ends.values()])
        for stamp in stamps:
            _, index, fqn = stamp.args[1].split(":", 2)
            reference = self.references[int(index)]
            stamp.meta[STAMP] = kept[reference.fqn]
            stamp.args = (stamp.args[0], fqn)  # the same on every rank
            for user in stamp.users:
                out = kept[reference.fqn].outputs[user.args[1]]
                if _requires_grad(out) != _requires_grad(user):
                    raise Unstampable(reference.fqn, f"output {user.args[1]} of '{fqn}': "
                                      f"gradient flags differ")
        self._unmark(graph)
        graph.lint()
        return dict(self.stamped)

    def hand_back(self, gm: fx.GraphModule) -> None:
        """Register in ``gm`` the tensors held back from the trace, at their FQNs."""
        for fqn, t, persistent in self.held_back:
            hold(gm, fqn, t, persistent)

    def drop_unread(self, gm: fx.GraphModule) -> None:
        """Remove the reads of the tensors of blocks kept as stamps, which no node uses
        (``gm`` still holds the tensors)."""
        inner = tuple(f + "." for f in self.stamped)
        for node in list(gm.graph.nodes):
            if node.op == "get_attr" and not node.users and node.target.startswith(inner):
                gm.graph.erase_node(node)

    def expand(self, gm: fx.GraphModule, shapes: dict, regions: dict) -> dict[str, str]:
        """Replace every stamp node in ``gm`` by a copy of its reference's nodes; extend
        ``shapes`` (marked module calls) and ``regions`` (checkpoint regions) for the copies;
        return block FQN -> reference FQN of the blocks stamped."""
        graph = gm.graph
        stamps = [n for n in graph.nodes if n.target is torch.ops.fxtp.stamp.default]
        if not stamps:
            self._unmark(graph)
            return {}
        spans = self._regions(graph)
        attrs = {n.target: n for n in graph.nodes if n.op == "get_attr"}
        first = next(iter(graph.nodes))
        for stamp in stamps:
            _, index, fqn = stamp.args[1].split(":", 2)
            reference = self.references[int(index)]
            self._copy(graph, stamp, fqn, reference, spans[reference.fqn], attrs, first,
                       shapes, regions)
        self._unmark(graph)
        graph.lint()
        return dict(self.stamped)

    def _regions(self, graph: fx.Graph) -> dict[str, list[fx.Node]]:
        """Each stamped reference's nodes, from its first input mark to its last output
        mark; a :class:`Unstampable` unless they form a closed region."""
        order = {n: i for i, n in enumerate(graph.nodes)}
        marks: dict[str, list[fx.Node]] = {}
        for node in graph.nodes:
            if _stamp_mark(node):
                marks.setdefault(node.args[1], []).append(node)
        spans = {}
        for reference in self.references:
            if reference.fqn not in marks or reference.fqn not in self.stamped.values():
                continue
            found = marks[reference.fqn]
            begin = min(order[n] for n in found if _stamp_mark(n) == "stamp-in")
            end = max(order[n] for n in found if _stamp_mark(n) == "stamp-out")
            nodes = [n for n in graph.nodes if begin <= order[n] <= end]
            if _own_sizes(graph, nodes):
                order = {n: i for i, n in enumerate(graph.nodes)}
                nodes = [n for n in graph.nodes if order[nodes[0]] <= order[n] <= order[nodes[-1]]]
            inside = set(nodes)
            prefix = reference.fqn + "."
            for node in nodes:
                mark = _stamp_mark(node)
                if mark and node.args[1] != reference.fqn:
                    raise Unstampable(reference.fqn, f"overlaps '{node.args[1]}'")
                if isinstance(node.target, GradientHooks):  # closures of this block's call
                    raise Unstampable(reference.fqn, "registers a gradient hook")
                for arg in node.all_input_nodes:
                    if arg.op == "get_attr" and isinstance(attr(graph.owning_module,
                                                                arg.target), fx.GraphModule):
                        raise Unstampable(reference.fqn, "calls a higher-order op")
                    if arg not in inside and mark != "stamp-in" and arg.op != "get_attr":
                        raise Unstampable(reference.fqn, f"reads '{arg.name}', which is "
                                          f"not among its arguments")
                    if arg.op == "get_attr" and mark != "stamp-in" and \
                            not arg.target.startswith(prefix) and arg.target in self.canonical:
                        raise Unstampable(reference.fqn, f"reads '{arg.target}', another "
                                          f"module's state")
                if mark != "stamp-out":
                    for user in node.users:
                        if user not in inside:
                            raise Unstampable(reference.fqn, f"leaves '{node.name}' to be "
                                              f"read outside its outputs")
            spans[reference.fqn] = nodes
        return spans

    def _copy(self, graph, stamp, fqn, reference, nodes, attrs, first, shapes, regions):
        """Put a copy of ``nodes`` (the reference's) in place of ``stamp`` (block ``fqn``)."""
        inputs = stamp.args[0]
        env: dict[fx.Node, object] = {}
        outs: list = []
        marked: set[str] = set()  # modules whose first call this copy marks
        prefix = reference.fqn + "."
        outer = _region(next(n for n in nodes if _stamp_mark(n) == "stamp-in"))
        fresh: dict = {outer: _region(stamp)}

        def outside(arg: fx.Node) -> fx.Node:
            if arg.op != "get_attr" or not arg.target.startswith(prefix) or \
                    arg.target not in self.canonical:  # a constant the trace made
                return arg  # (``lifted_tensor_*``): the same for every equivalent block
            target = self.canonical[fqn + "." + arg.target[len(prefix):]]
            if target not in attrs:
                with graph.inserting_before(first):
                    attrs[target] = graph.get_attr(target)
                attrs[target].meta = dict(arg.meta)
            return attrs[target]

        with graph.inserting_before(stamp):
            for node in nodes:
                if node.target is torch.ops.fxtp.boundary.default:
                    value, owner, kind, key = node.args
                    if kind == "stamp-in":
                        env[node] = inputs[int(key)]
                        continue
                    if kind == "stamp-out":
                        outs.append(env[value] if value in env else outside(value))
                        continue
                    mine = fqn + owner[len(reference.fqn):]
                    if mine in shapes and mine not in marked:  # a later call: unmarked
                        env[node] = env[value] if value in env else outside(value)
                        continue
                    shapes[mine] = shapes[owner]
                    marked.add(mine)
                copy = graph.node_copy(node, lambda a: env[a] if a in env else outside(a))
                if copy.target is torch.ops.fxtp.boundary.default:
                    copy.args = (copy.args[0], fqn + owner[len(reference.fqn):], *copy.args[2:])
                copy.meta = self._meta(node.meta, stamp, reference.fqn, fqn, fresh, regions)
                env[node] = copy
        for user in list(stamp.users):
            out = outs[user.args[1]]
            if _requires_grad(out) != _requires_grad(user):
                raise Unstampable(reference.fqn, f"output {user.args[1]} of '{fqn}': "
                                  f"gradient flags differ")
            user.replace_all_uses_with(out)
            graph.erase_node(user)
        graph.erase_node(stamp)

    def _meta(self, meta: dict, stamp: fx.Node, reference: str, fqn: str, fresh: dict,
              regions: dict) -> dict:
        """A copied node's meta: its module stack moved under ``fqn``, its checkpoint
        region the stamp's own (the reference's outer region) or a new one per copy."""
        meta = dict(meta)
        stack = list((stamp.meta.get("nn_module_stack") or {}).items())
        inner = list((meta.get("nn_module_stack") or {}).items())
        at = next((i for i, (_, (path, _)) in enumerate(inner) if path == reference), None)
        if at is not None:
            meta["nn_module_stack"] = {**dict(stack),
                                       **moved_stack(dict(inner[at + 1:]), reference, fqn)}
        custom = meta.get("custom")
        if custom and REGION in custom:
            region = custom[REGION]
            if region not in fresh:
                fresh[region] = len(regions)
                regions[fresh[region]] = regions[region]
            meta["custom"] = {**custom, REGION: fresh[region]}
            if fresh[region] is None:
                del meta["custom"][REGION]
        return meta

    @staticmethod
    def _unmark(graph: fx.Graph) -> None:
        for node in list(graph.nodes):
            if _stamp_mark(node):
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)


def copied_fallbacks(gm: fx.GraphModule, stamped: dict[str, str]) -> list[str]:
    """The fallbacks of the blocks kept as stamps (block FQN -> reference FQN): their
    references', each naming the block's own module."""
    found = []
    for node in gm.graph.nodes:
        message, module = node.meta.get(FALLBACK), module_fqn(node)
        for fqn, reference in stamped.items() if message else ():
            if module == reference or module.startswith(reference + "."):
                found.append(message.replace(f"in module '{module}'",
                                             f"in module '{fqn}{module[len(reference):]}'"))
    return found


def _requires_grad(node: fx.Node):
    return getattr(node.meta.get("val"), "requires_grad", None)


def _region(node: fx.Node):
    return (node.meta.get("custom") or {}).get(REGION)


def _own_sizes(graph: fx.Graph, nodes: list[fx.Node]) -> bool:
    """Have the reference's ``nodes`` compute each size they read from outside (a symbol
    the trace took once from the model's input, as a block's ``x.shape`` gives) from
    their own arguments, where one has a dim of that size: a copy for another block then
    takes it from its own. Whether any was."""
    inside = set(nodes)
    arguments = [n for n in nodes if _stamp_mark(n) == "stamp-in"]
    after = set(nodes[nodes.index(arguments[-1]) + 1:])
    changed = False
    for size in {a for n in after for a in n.all_input_nodes if a not in inside and
                 isinstance(a.meta.get("val"), torch.SymInt)}:
        if any(user in inside and user not in after for user in size.users):
            continue
        expr = size.meta["val"].node.expr
        at = next(((arg, d) for arg in arguments if isinstance(arg.meta.get("val"), torch.Tensor)
                   for d, s in enumerate(arg.meta["val"].shape)
                   if isinstance(s, torch.SymInt) and s.node.expr == expr), None)
        if at is None:
            continue
        with graph.inserting_after(arguments[-1]):
            own = graph.call_function(torch.ops.aten.sym_size.int, at)
        inner = ("nn_module_stack", "custom")  # the block's module and region, not the root's
        own.meta = {k: v for k, v in size.meta.items() if k not in inner}
        own.meta.update({k: arguments[-1].meta[k] for k in inner if k in arguments[-1].meta})
        size.replace_all_uses_with(own, delete_user_cb=lambda user: user in inside)
        changed = True
    return changed


def _stamp_mark(node: fx.Node) -> Optional[str]:
    """``"stamp-in"`` / ``"stamp-out"`` on a reference's argument / output mark."""
    if node.target is torch.ops.fxtp.boundary.default and \
            node.args[2] in ("stamp-in", "stamp-out"):
        return node.args[2]
    return None


# --- equivalence ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Meta:
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    def __iter__(self):
        return iter((self.shape, self.stride, self.dtype, self.device, self.requires_grad))


_MISSING = object()
UNRECORDED = "\0unrecorded"  # reads key: modules whose reads could not be recorded


def _meta_or_value(x):
    if isinstance(x, torch.Tensor):
        return _Meta(tuple(x.shape), tuple(x.stride()), x.dtype, x.device, x.requires_grad)
    return x


def _own(module: nn.Module, name: str):
    """``module``'s own value of attribute ``name`` (its ``__dict__`` or a slot)."""
    if name in module.__dict__:
        return module.__dict__[name]
    try:
        return object.__getattribute__(module, name)
    except AttributeError:
        return _MISSING


def _modes() -> tuple:
    """What a call traces differently under: grad mode and each device's autocast."""
    return (torch.is_grad_enabled(),) + tuple(
        (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))


def _same(a, b) -> bool:
    """Equal as a trace sees them, without guarding on symbolic sizes; objects other than
    plain values, containers of them and ``functools.partial`` s only if identical."""
    if a is b or getattr(a, "stamper_patch", False) and getattr(b, "stamper_patch", False):
        return True  # the stamper's own wrappers of equivalent nested blocks' forwards
    if isinstance(a, functools.partial) and type(a) is type(b):
        return a.func is b.func and _same(a.args, b.args) and _same(a.keywords, b.keywords)
    if isinstance(a, dict) and type(a) is type(b):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt) and \
            a.node.expr == b.node.expr
    if isinstance(a, _Meta) and isinstance(b, _Meta):
        return all(_same(x, y) for x, y in zip((a.shape, a.stride), (b.shape, b.stride))) \
            and (a.dtype, a.device, a.requires_grad) == (b.dtype, b.device, b.requires_grad)
    if isinstance(a, (tuple, list)) and type(a) is type(b):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, nn.Module) and type(a) is type(b):  # each block's own stateless helper
        return _stateless(a) and _stateless(b) and _same(_attributes(a), _attributes(b))
    return type(a) is type(b) and isinstance(a, _PLAIN) and a == b


def _stateless(module: nn.Module) -> bool:
    """Does ``module`` hold no tensors, submodules or hooks (the function wrappers the
    ``kernels`` package gives each module of a class it decorates: ``_kernel_funcs``)?"""
    return not any(v for k, v in vars(module).items()
                   if k in _MODULE_STATE and isinstance(v, dict))


def _attributes(module: nn.Module) -> dict:
    """``module``'s own attributes beyond those every module has (``training`` kept)."""
    return {k: v for k, v in vars(module).items() if k not in _MODULE_STATE}


def _signature(model: nn.Module, fqn: str, plan: dict, kept: set) -> Optional[tuple]:
    """What two blocks must share to be stamped from one trace; ``None``: never stamped
    (hooks on its submodules, which a stamp would not run)."""
    block = model.get_submodule(fqn)
    prefix = fqn + "."
    for name, sub in block.named_modules():
        if name and (sub._forward_hooks or sub._forward_pre_hooks or
                     sub._backward_hooks or sub._backward_pre_hooks):
            return None
    if nn.modules.module._global_forward_hooks or \
            nn.modules.module._global_forward_pre_hooks:
        return None
    first: dict[int, str] = {}
    state = tuple((name, tuple(t.shape), t.dtype, t.requires_grad, type(t),
                   first.setdefault(id(t), name))
                  for name, t in [*block.named_parameters(remove_duplicate=False),
                                  *block.named_buffers(remove_duplicate=False)])
    modules = tuple((name, type(m)) for name, m in block.named_modules())
    styles = tuple(sorted((k[len(prefix):], repr(v)) for k, v in plan.items()
                          if k.startswith(prefix) or k == fqn))
    marked = tuple(sorted(k[len(prefix):] for k in kept if k.startswith(prefix) or k == fqn))
    return type(block), state, modules, styles, marked


def _hideable(model: nn.Module, fqns: list[str]) -> list[str]:
    """The blocks of ``fqns`` whose modules appear nowhere else in ``model`` (a module
    shared with another place would lose its tensors there too)."""
    inside = tuple(f + "." for f in fqns)
    elsewhere = {id(m) for name, m in model.named_modules(remove_duplicate=False)
                 if not (name + ".").startswith(inside)}
    return [f for f in fqns
            if not any(id(m) in elsewhere for m in model.get_submodule(f).modules())]


def _recording_class(cls: type, get) -> type:
    """A subclass of ``cls`` whose ``__getattribute__`` is ``get`` and nothing else: what a
    base class's ``__init_subclass__`` adds to it is taken off again (Hugging Face's
    checkpointed layers wrap each subclass's ``forward``, and checkpoint only in the
    outermost wrapper: the recording class's would have made the layer's own call skip
    checkpointing)."""
    sub = type(cls.__name__, (cls,), {"__getattribute__": get, "__module__": cls.__module__,
                                      "__qualname__": cls.__qualname__})
    for name in [n for n in vars(sub) if not n.startswith("__")]:
        delattr(sub, name)
    return sub


@contextlib.contextmanager
def _recording_reads(block: nn.Module, reads: dict[str, set[str]]):
    """Record, per submodule path, the attributes of their own (``__dict__`` entries and
    ``__slots__`` slots) read on ``block``'s modules; a module whose class cannot be
    swapped for the recording one (a scripted module) is listed under
    ``reads[UNRECORDED]``."""
    swapped = []
    for path, module in block.named_modules():
        cls = type(module)
        seen = reads.setdefault(path, set())

        def get(self, name, _cls=cls, _seen=seen):
            if name not in _MODULE_STATE and (
                    name in object.__getattribute__(self, "__dict__") or
                    isinstance(getattr(_cls, name, None), types.MemberDescriptorType)):
                _seen.add(name)  # an attribute of its own, or a __slots__ slot
            return _cls.__getattribute__(self, name)
        try:
            module.__class__ = _recording_class(cls, get)
        except TypeError:
            reads.setdefault(UNRECORDED, set()).add(path)
            continue
        swapped.append((module, cls))
    try:
        yield
    finally:
        for module, cls in swapped:
            module.__class__ = cls
