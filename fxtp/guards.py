"""Guards: misuse that would hang, or silently compute something else, becomes an error.

* :func:`check_fresh`: ``parallelize`` takes a single-device model, not its own result.
* :func:`check_same_on_every_rank`: every rank must plan the same program. Digests of the
  plan, the traced graph and the model's tensor shapes are all-gathered once at
  ``parallelize`` time; any difference fails on every rank (instead of a hang or a
  shape error in the first collective).
* :func:`guard_inputs`: the returned module checks each call's inputs (metadata only)
  against what was traced: tensor shapes (local shapes for sharded root inputs; dims
  declared dynamic are free) and dtypes, and the values of non-tensor inputs, which the
  graph has baked in as constants.
"""
from __future__ import annotations

import hashlib
from typing import Optional

import torch
import torch.distributed as dist
import torch.fx as fx

from .passes.graph import PLACEMENT
from .passes.placement import describe, is_sharded

from .passes.errors import InputError, PlanError

_ITEMS = ("plan", "model parameters and buffers", "traced graph")


def check_fresh(model) -> None:
    if type(getattr(model, "fxtp", None)).__name__ == "ParallelInfo":
        raise PlanError(
            f"this {type(model).__name__} is already the result of fxtp.parallelize (it holds "
            f"rank {model.fxtp.rank}'s shards); call parallelize once, on the original "
            f"single-device model")


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
    everyone = mine.repeat(group.world)  # a fake process group leaves it as it is
    # all_gather_single is torch >= 2.13's name, all_gather_into_tensor the older one
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(
        everyone, mine, group=group.pg)
    everyone = everyone.view(group.world, -1).tolist()
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
        follow_order(gm, keys, order[0])
    return int(everyone[0][3])


def structure_keys(graph: fx.Graph) -> list[str]:
    """Each node's key, in graph order: a digest of its op, target and constant arguments
    and of the keys of the nodes it reads. Two graphs are the same program, whatever the
    order of their independent nodes and whatever their names, when their keys are the same
    multiset."""
    keys: dict[fx.Node, str] = {}
    for node in graph.nodes:
        target = node.target if isinstance(node.target, str) else \
            str(node.target) if isinstance(node.target, torch._ops.OpOverload) else \
            f"{getattr(node.target, '__module__', '')}." \
            f"{getattr(node.target, '__qualname__', node.target)}"
        reads = fx.map_arg((node.args, node.kwargs), lambda a: _Key(keys[a]))
        keys[node] = hashlib.sha256(f"{node.op} {target} {reads!r}".encode()).hexdigest()[:24]
    return list(keys.values())


class _Key(str):
    __repr__ = str.__str__


def follow_order(gm: fx.GraphModule, keys: list[str], order: list[str]) -> None:
    """Reorder ``gm``'s nodes (``keys``: theirs, by :func:`structure_keys`) as ``order``
    lists their keys; equal keys are taken in graph order."""
    pools: dict[str, list[fx.Node]] = {}
    for node, key in zip(list(gm.graph.nodes), keys):
        pools.setdefault(key, []).append(node)
    output = gm.graph.output_node()
    for key in order:
        node = pools[key].pop(0)
        if node is not output:
            output.prepend(node)
    try:
        gm.graph.lint()
    except RuntimeError as e:
        raise PlanError(f"fxtp.parallelize traced the same program on every rank, its "
                        f"independent nodes in other orders, and could not order this "
                        f"rank's as rank 0's ({e}); make the model's forward run its ops "
                        f"in one order (iterate a sorted list, not a set)") from e
    gm.recompile()


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
    gm.graph.lint()


def _expected(node: fx.Node, world: int) -> tuple:
    """``(name, shape, dtype, note)`` for a tensor input (``None`` in ``shape`` for a
    dynamic dim; ``note`` says when it is a shard), ``(name, value)`` for any other."""
    value = node.meta.get("val")
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


def _text(shape) -> str:
    return "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"


def check_inputs(spec: tuple, *inputs) -> None:
    """Raise :class:`InputError` naming the first input that differs from ``spec``."""
    for expected, x in zip(spec, inputs):
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
