"""Guards: misuse that would hang, or silently compute something else, becomes an error.

* :func:`check_fresh`: ``parallelize`` takes a single-device model, not its own result.
* :func:`every_rank_or_none`: a stage of ``parallelize`` that fails on some ranks fails on
  all of them (one all-gather), instead of leaving the others waiting in a collective.
* :func:`check_same_on_every_rank`: every rank must plan the same program. Digests of the
  plan, the traced graph and the model's tensor shapes are all-gathered once at
  ``parallelize`` time; any difference fails on every rank (instead of a hang or a
  shape error in the first collective).
* :func:`guard_inputs`: the returned module checks each call's inputs (metadata only)
  against what was traced: tensor shapes (local shapes for sharded root inputs; dims
  declared dynamic are free) and dtypes, and the values of non-tensor inputs, which the
  graph has baked in as constants; numbers declared dynamic are free, of their kind. With
  dims declared ``Dim.DYNAMIC``, export's own guards on their sizes (the branch a size
  took) are checked too, on global shapes (:class:`ExportGuards`).
* :func:`guard_arguments`: the returned module takes the arguments it was traced with, by
  position or name; an argument the trace did not see is accepted at the model's own
  default for it (``attention_mask=None``), and otherwise refused, naming it and how to
  trace a program that takes it, as is a traced argument left out.
* :func:`guard_casts`: ``gm.to(dtype)`` / ``half()`` / ``bfloat16()`` would give its
  tensors another floating dtype than the program was traced for (whose casts, and the
  casts it left out as no-ops, are part of it): refused before anything changes.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import itertools
import operator
from typing import Optional

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from ..edges.local_reads import renewing_apply
from ..kernels.torch_compat import OpOverload, run_as_python
from ..passes.effects import returns_alias, writes_first_input
from ..passes.graph import EXPORT_GUARDS, PLACEMENT, keep_on_copy, own_method
from ..passes.placement import describe, is_sharded

from ..passes.errors import InputError, PlanError, RankError, ShardingError, StampMismatch

_ITEMS = ("plan", "model parameters and buffers", "traced graph")

def check_fresh(model) -> None:
    if type(getattr(model, "fxtp", None)).__name__ == "ParallelInfo":
        raise PlanError(
            f"this {type(model).__name__} is already the result of fxtp.parallelize (it holds "
            f"rank {model.fxtp.rank}'s shards); call parallelize once, on the original "
            f"single-device model")


_FAILURES = (StampMismatch, ShardingError, Exception)
"""What a stage may raise, by the precedence the ranks agree on: ``parallelize`` retries
the first two with blocks traced in full, so every rank must raise the same one."""


@contextlib.contextmanager
def every_rank_or_none(group, stage: str):
    """Run the body (``stage`` of ``parallelize``, issuing no collective) on every rank of
    ``group``, then all-gather whether it raised: where it raised on any rank, every rank
    raises, its own error where that is the kind the ranks agree on (see
    :data:`_FAILURES`), otherwise an error of that kind naming the ranks that failed."""
    error = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - raised again below, on every rank
        error = e
    kind = 0 if error is None else \
        1 + next(i for i, cls in enumerate(_FAILURES) if isinstance(error, cls))
    kinds = from_every_rank(torch.tensor([kind], device=comm_device(group)), group).tolist()
    agreed = max(kinds)  # 0: none failed
    if agreed == 0:
        return
    if kind == agreed:
        raise error
    failed = [r for r, k in enumerate(kinds) if k == agreed]
    cls = RankError if _FAILURES[agreed - 1] is Exception else _FAILURES[agreed - 1]
    raise cls(f"fxtp.parallelize failed on rank(s) {failed} of group '{group.name}' while "
              f"{stage} (their error says why); this rank stops too rather than wait in a "
              f"collective those ranks will not reach") from error


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


def check_same_on_every_rank(group, device, plan: dict, model, gm: fx.GraphModule,
                             init_seed: int = 0) -> int:
    """Raise :class:`PlanError` on every rank unless all ranks of ``group`` hold the same
    plan, model tensor shapes and traced graph; return rank 0's ``init_seed`` (so a
    meta-device model draws the same replicated values everywhere). One all-gather.

    Graphs that are the same program with independent nodes in another order (model code
    iterating a ``set`` of strings, whose order Python's string hashing varies per process:
    Gemma-4's rotary tables per layer type) pass: each rank then reorders its graph as rank
    0's, so every rank issues its collectives in the same order (one more broadcast)."""
    plan_text = repr(sorted((fqn, repr(style)) for fqn, style in plan.items()))
    tensors = [*model.named_parameters(remove_duplicate=False),
               *model.named_buffers(remove_duplicate=False)]
    shapes_text = repr([(fqn, tuple(t.shape), t.dtype) for fqn, t in tensors])
    inputs = [(n.name, _meta_text(n.meta.get("val"))) for n in gm.graph.nodes
              if n.op == "placeholder"]
    keys = structure_keys(gm.graph)
    mine = torch.tensor([_digest(plan_text), _digest(shapes_text),
                         _digest(repr(sorted(keys)) + repr(inputs)), init_seed,
                         _digest(repr(keys))], device=device)
    everyone = from_every_rank(mine, group).view(group.world, -1).tolist()
    problems = []
    for i, item in enumerate(_ITEMS):
        differ = [r for r, row in enumerate(everyone) if row[i] != everyone[0][i]]
        if differ:
            problems.append(f"the {item} on ranks {differ} differ from rank 0's")
    if problems:
        raise PlanError(
            f"fxtp.parallelize was called differently on the ranks of group "
            f"'{group.name}': {'; '.join(problems)}. Every rank must pass the same model "
            f"(same sizes), the same plan and example inputs of the same shapes: their "
            f"shards are planned together, and a mismatch would hang or corrupt the first "
            f"collective.")
    if any(row[4] != everyone[0][4] for row in everyone):
        order = [keys if group.rank == 0 else None]
        dist.broadcast_object_list(order, src=dist.get_global_rank(group.pg, 0),
                                   group=group.pg)
        followed = torch.tensor([follow_order(gm, keys, order[0])], device=device)
        every = from_every_rank(followed, group)
        if not all(every.tolist()):  # on every rank, or the others would hang
            raise PlanError(
                f"fxtp.parallelize traced the same program on every rank of group "
                f"'{group.name}', its independent ops in other orders, and could not order "
                f"ranks {[r for r, ok in enumerate(every.tolist()) if not ok]}' graphs as "
                f"rank 0's; make the model's forward run its ops in one order (iterate a "
                f"sorted list, not a set)")
    return int(everyone[0][3])


def comm_device(group) -> str:
    """The device a small tensor exchanged over ``group`` lives on: ``cuda`` for NCCL."""
    return "cuda" if group.device_type == "cuda" else "cpu"


def from_every_rank(mine: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``mine``, concatenated (a fake process group leaves ``mine`` repeated)."""
    everyone = mine.repeat(group.world)
    # all_gather_single is torch >= 2.13's name, all_gather_into_tensor the older one
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(
        everyone, mine, group=group.pg)
    return everyone


def structure_keys(graph: fx.Graph) -> list[str]:
    """Each node's key, in graph order: a digest of its op, target and constant arguments,
    of the keys of the nodes it reads and of how many in-place writes into each of them
    (or the value it views) come before it; a conversion to what its input already is has
    its input's key. Two graphs are the same program, whatever the
    order of their independent nodes and whatever their names, when their keys are the same
    multiset; nodes of equal keys compute equal values, unless they draw random numbers or
    write in place."""
    keys: dict[fx.Node, str] = {}
    writes: dict[fx.Node, int] = {}
    for node in graph.nodes:
        if _converts_nothing(node):  # ``x.to(x.dtype)``: the value it reads
            keys[node] = keys[node.args[0]]
            continue
        target = node.target if isinstance(node.target, str) else \
            str(node.target) if isinstance(node.target, OpOverload) else \
            f"{getattr(node.target, '__module__', '')}." \
            f"{getattr(node.target, '__qualname__', node.target)}"
        reads = fx.map_arg((node.args, node.kwargs), lambda a: _Key(keys[a]))
        written = tuple(writes.get(_base(a), 0) for a in node.all_input_nodes)
        keys[node] = hashlib.sha256(f"{node.op} {target} {reads!r} {written}".encode()
                                    ).hexdigest()[:24]
        if writes_first_input(node.target) and isinstance(node.args[0], fx.Node):
            writes[_base(node.args[0])] = writes.get(_base(node.args[0]), 0) + 1
    return list(keys.values())


def _converts_nothing(node: fx.Node) -> bool:
    """A ``Tensor.to`` whose result has its input's dtype, device and layout (Hugging Face's
    masks convert the cache position once or twice, by the order a ``set`` iterates)."""
    if not (isinstance(node.target, OpOverload) and
            node.target._schema.name == "aten::to" and node.args and
            isinstance(node.args[0], fx.Node)):
        return False
    out, given = node.meta.get("val"), node.args[0].meta.get("val")
    return isinstance(out, torch.Tensor) and isinstance(given, torch.Tensor) and \
        (out.dtype, out.device, out.layout) == (given.dtype, given.device, given.layout)


class _Key(str):
    __repr__ = str.__str__


def _base(node: fx.Node) -> fx.Node:
    """The value ``node`` is a view of (through views, ``getitem`` and in-place returns)."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node) \
            and (node.target is operator.getitem or returns_alias(node.target)):
        node = node.args[0]
    return node


def _pure(node: fx.Node) -> bool:
    """An op whose value its key determines: no in-place write, no random numbers."""
    return node.op == "call_function" and (node.target is operator.getitem or
        isinstance(node.target, OpOverload) and
        not writes_first_input(node.target) and
        torch.Tag.nondeterministic_seeded not in node.target.tags)


def follow_order(gm: fx.GraphModule, keys: list[str], order: list[str]) -> bool:
    """Reorder ``gm``'s nodes (``keys``: theirs, by :func:`structure_keys`) as ``order``
    lists their keys, taking for each key the first node of that key whose inputs are
    already placed. Nodes of equal keys compute equal values, so where a node's input is
    not placed yet but a pure node of the same key is, the node reads that one instead.
    Return whether every node found its place (else the graph is left in an order that is
    no program: the caller raises)."""
    pools: dict[str, list[fx.Node]] = {}
    key_of = dict(zip(gm.graph.nodes, keys))
    for node, key in key_of.items():
        pools.setdefault(key, []).append(node)
    output, placed, pure_placed = gm.graph.output_node(), set(), {}
    for key in order:
        candidates = pools.get(key, [])
        node = next((n for n in candidates if placed.issuperset(n.all_input_nodes)), None)
        for n in candidates if node is None else ():
            twins = {a: pure_placed.get(key_of[a]) for a in n.all_input_nodes
                     if a not in placed and _pure(a)}
            if all(twins.values()) and placed.issuperset(set(n.all_input_nodes) - set(twins)):
                for a, twin in twins.items():
                    n.replace_input_with(a, twin)
                node = n
                break
        if node is None:
            return False
        candidates.remove(node)
        placed.add(node)
        if _pure(node):
            pure_placed.setdefault(key, node)
        if node is not output:
            output.prepend(node)
    gm.recompile()
    return True


def _meta_text(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {value.dtype}"
    return repr(value)


def guard_inputs(gm: fx.GraphModule, world: int) -> None:
    """Make ``gm`` check its flat inputs on every call (a node before all others); edits
    ``gm.graph``, the caller recompiles."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    first = next((n for n in gm.graph.nodes if n.op != "placeholder"), None)
    if not placeholders or first is None:
        return
    for node in placeholders:  # inputs first: the check runs before anything reads them
        first.prepend(node)
    with gm.graph.inserting_before(first):
        gm.graph.call_function(check_inputs, (tuple(_expected(n, world) for n in placeholders),
                                              *placeholders))
        taken = gm.meta.get(EXPORT_GUARDS)
        by_name = {n.name: n for n in placeholders}
        if taken is not None and all(name in by_name for name in taken[1]):
            guards, names = taken
            read = [by_name[name] for name in names]
            sharded = tuple(n.meta[PLACEMENT].dim if is_sharded(n.meta.get(PLACEMENT)) else None
                            for n in read)
            gm.add_submodule("_fxtp_export_guards", ExportGuards(guards, sharded, world))
            gm.graph.call_module("_fxtp_export_guards", tuple(read))
    gm.graph.lint()


class ExportGuards(nn.Module):
    """torch.export's guards on a call's inputs (``guards``), asserted on global shapes: an
    input sharded on dim ``sharded[i]`` (this rank's shard) stands for one ``world``
    times as long there. A failed guard is an :class:`InputError`: the program computes
    what the model did for sizes that hold it (a branch taken by size) and nothing else."""

    def __init__(self, guards: nn.Module, sharded: tuple, world: int):
        super().__init__()
        self.guards, self.sharded, self.world = guards, sharded, world

    def forward(self, *inputs) -> None:
        seen = [x if d is None or not isinstance(x, torch.Tensor) else _global(x, d, self.world)
                for x, d in zip(inputs, self.sharded)]
        try:
            self.guards(*seen)
        except AssertionError as e:
            raise InputError(
                f"the inputs break what tracing found the model's program to assume of their "
                f"sizes ({str(e).removeprefix('Guard failed: ')}; a branch or op of the model "
                f"chose by it, with dims declared dynamic): pass sizes that satisfy it, or "
                f"parallelize with example inputs of the sizes you will call it with") from None


def _expected(node: fx.Node, world: int) -> tuple:
    """``(name, shape, dtype, note)`` for a tensor input (``None`` in ``shape`` for a
    dynamic dim; ``note`` says when it is a shard), ``(name, kind, "dynamic")`` for a
    number declared dynamic (any ``bool``, ``int`` or ``float``, as ``kind`` says),
    ``(name, value)`` for any other."""
    value = node.meta.get("val")
    for symbolic, kind in _DYNAMIC_NUMBERS:
        if isinstance(value, symbolic):
            return (node.name, kind, "dynamic")
    if not isinstance(value, torch.Tensor):
        return (node.name, value)
    p = node.meta.get(PLACEMENT)
    shape = [s if isinstance(s, int) else None for s in value.shape]
    note = ""
    if is_sharded(p):
        note = f" (this rank's {describe(p)} shard of {_text(shape)})"
        if shape[p.dim] is not None:
            shape[p.dim] //= world
    return (node.name, tuple(shape), value.dtype, note)


_DYNAMIC_NUMBERS = ((torch.SymBool, "bool"), (torch.SymInt, "int"), (torch.SymFloat, "float"))
"""Numbers ``dynamic_shapes`` declared dynamic (``Dim.DYNAMIC``), by the kind the graph
takes them as."""
_KINDS = {"bool": (bool, torch.SymBool), "int": (int, torch.SymInt),
          "float": (float, int, torch.SymFloat, torch.SymInt)}


def _global(shard: torch.Tensor, dim: int, world: int) -> torch.Tensor:
    """A meta tensor of the global shape ``shard`` (evenly dealt on ``dim``) is a part of."""
    shape = list(shard.shape)
    shape[dim % len(shape)] *= world
    return torch.empty(shape, dtype=shard.dtype, device="meta")


def _text(shape) -> str:
    return "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"


def check_inputs(spec: tuple, *inputs) -> None:
    """Raise :class:`InputError` naming the first input that differs from ``spec``."""
    for expected, x in zip(spec, inputs):
        if len(expected) == 3:
            kinds = _KINDS[expected[1]]
            if not isinstance(x, kinds) or (isinstance(x, bool) and bool not in kinds):
                raise InputError(f"input '{expected[0]}' must be of type {expected[1]} "
                                 f"(declared dynamic in dynamic_shapes); got {_short(x)}")
            continue
        if len(expected) == 2:
            if not _same_constant(x, expected[1]):
                raise InputError(
                    f"input '{expected[0]}' was traced as the constant {expected[1]!r} "
                    f"(fxtp's graph computes with that value); got {_short(x)}. Pass it as "
                    f"a tensor to make it an input, or parallelize again for this value")
            continue
        name, shape, dtype, note = expected
        if not isinstance(x, torch.Tensor):
            raise InputError(f"input '{name}' must be a tensor of shape {_text(shape)}{note} "
                             f"and dtype {dtype}; got {_short(x)}")
        if x.dim() != len(shape) or any(e is not None and s != e
                                        for s, e in zip(x.shape, shape)):
            raise InputError(
                f"input '{name}' has shape {tuple(x.shape)}; the graph was traced for "
                f"{_text(shape)}{note}, * marking a dynamic dim. Pass inputs of the traced "
                f"shape, or declare the dims that change in parallelize(..., "
                f"dynamic_shapes=...)")
        if x.dtype != dtype:
            raise InputError(f"input '{name}' has dtype {x.dtype}; the graph was traced "
                             f"for {dtype}. Cast it, or parallelize with inputs of this dtype")


def guard_arguments(gm: fx.GraphModule, model: nn.Module) -> None:
    """Make ``gm`` (and ``copy.deepcopy`` s of it) check the names of each call's arguments
    against its traced inputs, before its ``forward`` runs (a forward pre-hook)."""
    traced = tuple(inspect.signature(gm.forward).parameters)
    try:
        own = inspect.signature(model.forward).parameters.items()
    except (TypeError, ValueError):  # a forward without a signature: no defaults known
        own = ()
    defaults = {name: p.default for name, p in own if name not in traced and
                isinstance(p.default, (type(None), bool, int, float, str))}
    like = {n.name: _as_traced(n.name, n.meta.get("val"))
            for n in gm.graph.nodes if n.op == "placeholder"}
    hook = functools.partial(_check_arguments, traced, defaults, like)
    run_as_python(_check_arguments)  # a compiled call runs it as Python, not as a frame

    def register(module):
        module.register_forward_pre_hook(hook, with_kwargs=True)
    register(gm)
    gm._register_deepcopy_hook(register)


def _as_traced(name: str, value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{name}, a tensor of shape {tuple(value.shape)}"
    return f"{name}={value!r}"


def _check_arguments(traced: tuple, defaults: dict, like: dict, module, args, kwargs):
    """``(args, kwargs)`` without the arguments given at the model's default that the
    trace did not see; :class:`InputError` for any other the trace did not see, or a
    traced one left out."""
    if len(args) + len(kwargs) == len(traced) and all(map(traced.__contains__, kwargs)):
        return None
    takes = ", ".join(traced)
    if len(args) > len(traced):
        raise InputError(f"{len(args)} positional inputs given; the program was traced with "
                         f"{len(traced)} inputs ({takes})")
    kept = {}
    for name, value in kwargs.items():
        if name in traced:
            kept[name] = value
        elif not (name in defaults and _same_constant(value, defaults[name])):
            default = f", or leave it at its default ({defaults[name]!r})" \
                if name in defaults else ""
            raise InputError(
                f"input '{name}' was not given when parallelize traced the model, so the "
                f"program has no input for it (it takes {takes}); pass {name} in "
                f"parallelize's example_kwargs to trace a program that takes it{default}")
    given = set(traced[:len(args)]) | set(kept)
    for name in traced:
        if name not in given:
            raise InputError(f"input '{name}' is missing: the program was traced with it "
                             f"(it takes {takes}); pass {like.get(name, name)} as when "
                             f"traced")
    return args, kept


def _same_constant(x, traced) -> bool:
    if isinstance(x, bool) or isinstance(traced, bool):
        return x is traced
    if isinstance(x, (int, float)) and isinstance(traced, (int, float)):
        return x == traced
    return type(x) is type(traced) and x == traced


def _short(x: Optional[object]) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def guard_casts(gm: fx.GraphModule, traced_for: Optional[torch.dtype] = None) -> None:
    """Make ``gm`` (and ``copy.deepcopy`` s of it) refuse a cast of its floating tensors
    to another dtype than theirs or ``traced_for`` (``parallelize``'s ``param_dtype``)."""
    gm._fxtp_traced_for = traced_for
    keep_on_copy(gm, "_fxtp_traced_for")
    own_method(gm, "_apply", _apply_keeping_dtypes)


def _apply_keeping_dtypes(self, fn, recurse=True):
    dtypes = {t.dtype for t in itertools.chain(self.parameters(), self.buffers())
              if t.is_floating_point()}
    for dtype in dtypes:
        try:
            made = fn(torch.empty(0, dtype=dtype)).dtype
        except Exception:  # noqa: BLE001 - not a cast this can tell; the call says why
            continue
        if made not in (dtype, self.__dict__.get("_fxtp_traced_for")):
            raise InputError(
                f"fxtp traced this module's program for {dtype} tensors (the casts it makes, "
                f"and those it left out as no-ops, are part of it), so it cannot compute in "
                f"{made}. Parallelize a {made} model instead (model.to({made}) before "
                f"fxtp.parallelize); for FSDP2's mixed precision, pass "
                f"param_dtype={made} to fxtp.parallelize.")
    return renewing_apply(self, fn, recurse)
