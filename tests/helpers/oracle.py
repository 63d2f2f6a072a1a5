"""A one-process, multi-rank simulation of fxtp's sharding rules (the rule oracle).

:func:`record` exports a program the way fxtp traces models (``torch.export``'s pre-dispatch
ATen IR) and keeps every node's value. :func:`check_strategies` runs every strategy the rule
of a node offers on simulated ranks: each rank gets its part of every tensor input
(``Shard``: its chunk; ``_StridedShard``, ``BlockShard``: its chunk of every block;
``UnitShard``: its whole units, or its group's unit; ``Replicate`` or unread: the full tensor;
``Partial``: a random
split that sums to it), runs the rule's localized op, and the per-rank results must
reassemble the single-device result (``Shard``, ``UnitShard``: concatenate, one rank per
unit, a group's ranks equal; ``Partial``: sum; ``Replicate``: every rank equal). With
``backward`` the input gradients are
checked too: each rank gets the output gradient in the output's placement (its chunk of a
sharded output's gradient, the full gradient of a replicated or partial one), and its input
gradients reassemble by the input's placement (``Shard``: concatenate; ``Partial``: every
rank holds the full gradient; ``Replicate``: every rank equal when the whole strategy is
replicated, else summed over ranks, as fxtp's rewrite all-reduces the gradient of a
replicated value read by ops on sharded or partial values). A unit held by a group of ranks
has its output gradient on the group's first rank (zero on the others) and its input
gradient summed over the group. Every input the single-device gradient reaches must be
reached on every rank: a rank whose local op cuts the graph (fresh zeros where it holds
nothing) would skip the backward of what computed that input, and the collectives there
the other ranks wait for. No process group is needed.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._pytree import tree_map

from fxtp.plans.mesh import Group
from fxtp.passes.graph import INTO_PARTIAL, tensor_inputs
from fxtp.passes.placement import BlockShard, UnitShard
from fxtp.passes.rules import replicated_into_partial, rule_for
from tests.helpers.parity import local_part

SEED = 1234  # every run of an op (reference and each rank) starts from it: dropout agrees
R = Replicate()


def record(fn, args):
    """The exported program of ``fn(*args)`` and every node's value (tensors copied as they
    were when computed: later in-place ops do not change them)."""
    class M(torch.nn.Module):
        def forward(self, *xs):
            return fn(*xs)
    gm = torch.export.export(M(), tuple(args), strict=False).module()
    return gm, record_values(gm, args)


def _snapshot(value):
    return tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, value)


def record_values(gm: fx.GraphModule, args) -> dict:
    """Every node's value when ``gm`` runs on ``args``."""
    values = {}

    class Record(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            values[n] = _snapshot(out)
            return out
    Record(gm).run(*args)
    return values


def ops_with_rules(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes
            if n.op == "call_function" and rule_for(n.target) is not None]


def assemble(parts, placement, sum_groups: bool = False):
    """The global tensor whose per-rank parts under ``placement`` (sharded) are ``parts``;
    a unit held by a group of ranks is its first rank's part (``sum_groups``: the sum of
    the group's parts)."""
    if isinstance(placement, UnitShard):
        return _assemble_units(parts, placement, sum_groups)
    if isinstance(placement, _StridedShard):
        d, k = placement.dim, placement.split_factor
        return torch.cat([torch.cat([p.chunk(k, d)[j] for p in parts], d) for j in range(k)], d)
    if isinstance(placement, BlockShard):
        d, local = placement.dim, [b // len(parts) for b in placement.blocks]
        pieces = [p.split(local, d) for p in parts]
        return torch.cat([torch.cat([mine[j] for mine in pieces], d)
                          for j in range(len(local))], d)
    return torch.cat(parts, dim=placement.dim)


def _assemble_units(parts, p, sum_groups):
    world = len(parts)
    if p.units == 1:  # held whole by every rank
        return sum(parts) if sum_groups else parts[0]
    if p.units >= world:
        return torch.cat(parts, dim=p.dim)
    per = world // p.units
    groups = [parts[g * per:(g + 1) * per] for g in range(p.units)]
    return torch.cat([sum(g) if sum_groups else g[0] for g in groups], dim=p.dim)


def random_like(value: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    if value.dtype.is_floating_point or value.dtype.is_complex:
        return torch.randn(value.shape, generator=gen, dtype=value.dtype)
    return torch.randint(-5, 6, value.shape, generator=gen).to(value.dtype)


def split_partial(value: torch.Tensor, world: int, gen: torch.Generator) -> list:
    """A random split of ``value`` into ``world`` parts that sum to it."""
    parts = [random_like(value, gen) for _ in range(world - 1)]
    return parts + [value - sum(parts)]


def is_sharded(p) -> bool:
    return isinstance(p, (Shard, _StridedShard, BlockShard, UnitShard))


def describe(p) -> str:
    if p is None:
        return "-"
    if isinstance(p, (tuple, list)):
        return "(" + ", ".join(map(describe, p)) + ")"
    if isinstance(p, _StridedShard):
        return f"S({p.dim})/{p.split_factor}"
    if isinstance(p, UnitShard):
        return f"S({p.dim})~{p.units}"
    if isinstance(p, BlockShard):
        return f"S({p.dim})/" + "+".join(map(str, p.blocks))
    if isinstance(p, Shard):
        return f"S({p.dim})"
    return "P" if isinstance(p, Partial) else "R"


def strategy_name(ins, outs) -> str:
    return f"{describe(ins)} -> {describe(outs)}"


def _differentiable(t) -> bool:
    return isinstance(t, torch.Tensor) and (t.dtype.is_floating_point or t.dtype.is_complex)


def _as_list(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _run(target, args, kwargs):
    torch.manual_seed(SEED)
    return target(*args, **kwargs)


def _uninitialized(target) -> bool:
    """``empty_like`` / ``new_empty``: only the output's metadata is defined."""
    return "empty" in str(target)


def all_strategies(node: fx.Node, world: int, actual=(), strided: bool = False,
                   units: bool = False) -> list:
    """The node's strategies, without those whose local op communicates (they are checked on
    real process groups). With ``strided``, also the strided form of every sharded strategy
    (offered when its sharded inputs arrive as ``_StridedShard(d, 2)``). With ``units``,
    also the unit-sharded forms offered when a sharded input arrives as
    ``UnitShard(d, n)``, for every ``n`` the dim's size allows (:func:`unit_counts`)."""
    rule = rule_for(node.target)
    communicating = set()
    node.meta[INTO_PARTIAL] = True  # every strategy a rule offers, also where a pass asks

    def strategies(arrive):
        if rule.communicates:
            communicating.update(rule.extra(node, world, arrive))
        return rule.strategies(node, world, arrive)
    found = dict.fromkeys(strategies(actual))
    inputs = tensor_inputs(node)
    for ins, _ in list(found):
        if strided and any(type(p) is Shard for p in ins):
            arrive = tuple(_StridedShard(p.dim, split_factor=2) if type(p) is Shard else p
                           for p in ins)
            for s in strategies(arrive):
                if any(isinstance(p, _StridedShard) for p in s[0] + s[1]):
                    found.setdefault(s)
    for i, p in enumerate(() if not units else actual or (None,) * len(inputs)):
        shape = getattr(inputs[i].meta.get("val"), "shape", ())
        for d in range(len(shape)):
            for n in unit_counts(shape[d], world):
                arrive = tuple(UnitShard(d, n) if j == i else R for j in range(len(inputs)))
                for s in strategies(arrive):
                    if any(isinstance(q, UnitShard) for q in s[0] + s[1]):
                        found.setdefault(s)
    return [s for s in found if s not in communicating]


def unit_counts(size, world: int) -> list[int]:
    """Unit counts a dim of ``size`` can be dealt in without being an even ``Shard``: a
    count that does not divide by ``world`` (uneven), or one dividing it (groups)."""
    if not isinstance(size, int) or size == 0:
        return []
    return [n for n in range(1, size + 1) if size % n == 0 and n % world and
            (n >= world or world % n == 0)][:3]


def check_strategies(node: fx.Node, values: dict, world: int, actual=(), *,
                     backward: bool = False, strided: bool = False, units: bool = False,
                     seed: int = 0,
                     tol: dict | None = None, errors: list | None = None) -> list[str]:
    """Check every strategy of ``node`` (see the module docstring) on ``world`` simulated
    ranks; return the names of the strategies checked (a ``Partial`` bool input is none).
    With ``errors``, a failing strategy appends ``(strategy, why)`` to it and the others
    are still checked; else the first failure raises."""
    inputs = tensor_inputs(node)
    gen = torch.Generator().manual_seed(seed)
    reference = _Reference(node, values, inputs, gen, backward)
    checked = []
    for ins, outs in all_strategies(node, world, actual, strided, units):
        if any(isinstance(p, Partial) and values[a].dtype == torch.bool
               for a, p in zip(inputs, ins)):
            continue
        name = strategy_name(ins, outs)
        try:
            _check_one(node, values, world, inputs, ins, outs, reference, gen, tol)
        except Exception as e:  # noqa: BLE001 - a local op that fails is a wrong strategy
            if errors is None:
                raise
            errors.append((name, f"{type(e).__name__}: {e}".replace("\n", " ")[:600]))
        checked.append(name)
    return checked


# torch's default tolerances of the least precise floating dtype an op reads or writes
# (a Partial split of an fp32 value sums back to it only to fp32 precision)
_TOLERANCES = {torch.float32: dict(rtol=1.3e-6, atol=1e-5),
               torch.float16: dict(rtol=1e-3, atol=1e-5),
               torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5)}


def _tolerance(tensors) -> dict:
    dtypes = {t.dtype for t in tensors if isinstance(t, torch.Tensor)}
    dtypes |= {torch.float32 for d in dtypes if d == torch.complex64}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        if dtype in dtypes:
            return _TOLERANCES[dtype]
    return {}


def _check_one(node, values, world, inputs, ins, outs, reference, gen, tol):
    rule = rule_for(node.target)
    tol = tol or _tolerance([values[a] for a in inputs] + list(reference.outputs))
    name = strategy_name(ins, outs)
    parts = {i: split_partial(values[a], world, gen) for i, (a, p) in
             enumerate(zip(inputs, ins)) if isinstance(p, Partial)}
    ranks = [_RankRun(node, rule, values, inputs, ins, outs, parts, rank, world, reference)
             for rank in range(world)]
    for j, (p, exp) in enumerate(zip(outs, reference.outputs)):
        if not isinstance(exp, torch.Tensor) or p is None:
            continue
        got = [r.outputs[j] for r in ranks]
        msg = f"{name}: output {j}"
        if _uninitialized(node.target):
            got = [torch.zeros_like(t) for t in got]
            exp = torch.zeros_like(exp)
        whole = _combine(got, p, msg, tol)
        torch.testing.assert_close(whole, exp, equal_nan=True, **tol,
                                   msg=lambda m: f"{msg}: {m}")
    if reference.grads is None:
        return
    replicated = all(p is None or isinstance(p, Replicate) for p in ins + outs)
    for i, (p, exp) in enumerate(zip(ins, reference.grads)):
        if exp is None:
            continue
        # a rank whose outputs do not reach an input would skip the backward of what
        # computed it, and the collectives there that the other ranks wait for
        unreached = [r for r, run in enumerate(ranks) if run.grads[i] is None]
        assert i not in reference.reached or not unreached, \
            f"{name}: input {i} unreached by autograd on ranks {unreached}"
        got = [r.grads[i] if r.grads[i] is not None else torch.zeros_like(r.leaves[i])
               for r in ranks]
        msg = f"{name}: gradient of input {i}"
        if is_sharded(p):
            whole = assemble(got, p, sum_groups=True)
        elif isinstance(p, Partial) or replicated or \
                i == replicated_into_partial(node.target, ins, outs):
            whole = _combine(got, R, msg, tol)
        else:
            whole = sum(got)
        torch.testing.assert_close(whole, exp, equal_nan=True, **tol,
                                   msg=lambda m: f"{msg}: {m}")


def _combine(got, p, what, tol):
    """Per-rank values under placement ``p`` -> the global value."""
    if isinstance(p, UnitShard) and p.units < len(got):  # a group's ranks agree
        per = len(got) // p.units
        for r, other in enumerate(got):
            torch.testing.assert_close(other, got[r - r % per], equal_nan=True, **tol,
                                       msg=lambda m: f"{what} differs within a group: {m}")
    if is_sharded(p):
        return assemble(got, p)
    if isinstance(p, Partial):
        return sum(got)
    for r, other in enumerate(got[1:], 1):
        torch.testing.assert_close(other, got[0], equal_nan=True, **tol,
                                   msg=lambda m: f"{what} differs on rank {r}: {m}")
    return got[0]


class _Reference:
    """The single-device outputs of ``node`` and, with ``backward``, one random output
    gradient and the input gradients it gives (``grads`` is ``None`` when the op is not
    differentiable here)."""

    def __init__(self, node, values, inputs, gen, backward):
        self.grads = self.grads_out = None
        self.reached = set()
        self.with_grad = {i for i, a in enumerate(inputs) if _differentiable(values[a])} \
            if backward else set()
        try:
            leaves, outputs = self._forward(node, values, inputs, self.with_grad)
        except RuntimeError:  # an argument without a derivative (a mask, a weight), or none
            self.with_grad = {i for i in self.with_grad
                              if self._differentiable_in(node, values, inputs, i)}
            try:
                leaves, outputs = self._forward(node, values, inputs, self.with_grad)
            except RuntimeError:
                self.with_grad = set()
                leaves, outputs = self._forward(node, values, inputs, self.with_grad)
        self.outputs = [o.detach() if isinstance(o, torch.Tensor) else o for o in outputs]
        outs = [j for j, o in enumerate(outputs)
                if isinstance(o, torch.Tensor) and o.requires_grad]
        if not self.with_grad or not outs:
            return
        grads_out = [random_like(o, gen) if j in outs else None
                     for j, o in enumerate(self.outputs)]
        wanted = sorted(self.with_grad)
        try:
            grads = torch.autograd.grad([outputs[j] for j in outs],
                                        [leaves[i] for i in wanted],
                                        [grads_out[j] for j in outs], allow_unused=True)
        except (RuntimeError, NotImplementedError):  # no derivative formula
            return
        self.grads_out = grads_out
        self.grads = [None] * len(leaves)
        self.reached = {i for i, g in zip(wanted, grads) if g is not None}
        for i, g in zip(wanted, grads):
            self.grads[i] = g if g is not None else torch.zeros_like(leaves[i])

    @staticmethod
    def _forward(node, values, inputs, with_grad):
        leaves = [_leaf(values[a], i in with_grad) for i, a in enumerate(inputs)]
        args, kwargs = _bind(node.args, node.kwargs, inputs, leaves, values)
        with torch.set_grad_enabled(bool(with_grad)):
            return leaves, _as_list(_run(node.target, args, kwargs))

    @classmethod
    def _differentiable_in(cls, node, values, inputs, i) -> bool:
        try:
            cls._forward(node, values, inputs, {i})
        except RuntimeError:
            return False
        return True


def _leaf(value: torch.Tensor, grad: bool) -> torch.Tensor:
    return value.detach().clone().requires_grad_(grad)


def _bind(args, kwargs, inputs, tensors, values):
    """``(args, kwargs)`` with the i-th tensor input occurrence replaced by ``tensors[i]``
    (a clone of a leaf: in-place ops write the clone) and other graph values by theirs."""
    pending: dict = {}
    for i, a in enumerate(inputs):
        pending.setdefault(a, []).append(i)

    def local(a):
        if not isinstance(a, fx.Node):
            return a
        if pending.get(a):
            t = tensors[pending[a].pop(0)]
            return t.clone() if t.requires_grad else t
        if a not in values and a.op == "get_attr":  # made by the local form (a subgraph)
            return getattr(a.graph.owning_module, a.target)
        return values[a]
    return fx.node.map_aggregate((args, kwargs), local)


class _RankRun:
    """One simulated rank's run of the localized op (and its input gradients)."""

    def __init__(self, node, rule, values, inputs, ins, outs, parts, rank, world, reference):
        grads_out = reference.grads_out
        backward = grads_out is not None
        target, args, kwargs = rule.localize(node, ins, outs[0], Group("sim", rank, world),
                                             node.graph)
        self.leaves = []
        for i, (a, p) in enumerate(zip(inputs, ins)):
            part = parts[i][rank] if i in parts else local_part(values[a], p or R, rank, world)
            self.leaves.append(_leaf(part, backward and i in reference.with_grad))
        args, kwargs = _bind(args, kwargs, inputs, self.leaves, values)
        with torch.set_grad_enabled(backward):
            outputs = _as_list(_run(target, args, kwargs))
        self.outputs = [o.detach() if isinstance(o, torch.Tensor) else o for o in outputs]
        self.grads = [None] * len(inputs)
        if not backward:
            return
        pairs = [(o, _local_grad(g, p, rank, world)) for o, g, p in zip(outputs, grads_out, outs)
                 if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
        wanted = [i for i, x in enumerate(self.leaves) if x.requires_grad]
        if pairs and wanted:
            grads = torch.autograd.grad([o for o, _ in pairs], [self.leaves[i] for i in wanted],
                                        [g for _, g in pairs], allow_unused=True)
            for i, g in zip(wanted, grads):
                self.grads[i] = g


def _local_grad(g, p, rank, world):
    """A rank's part of an output gradient: a unit's on its group's first rank only."""
    if isinstance(p, UnitShard) and p.units < world and rank % (world // p.units):
        return torch.zeros_like(local_part(g, p, rank, world))
    return local_part(g, p, rank, world) if is_sharded(p) else g
