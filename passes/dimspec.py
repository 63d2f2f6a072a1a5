"""Dim specs: a compact, einsum-like statement of how an op's tensor dims relate.

``"... k+, n k+ -> ... n"`` (linear) reads: dims with the same label correspond; sharding a
label shards every tensor that has it on that dim and leaves the others replicated. A label
marked ``+`` is summed over: sharding it makes the output ``Partial``. A label marked ``!`` is
never sharded (a softmax or normalized dim). ``...`` stands for leading batch dims, aligned
from the right as in broadcasting. ``_`` is a dim that is never sharded.

Both sharding propagation (the candidate strategies) and shape localization derive from it.
A label whose dim has the same size on every tensor carrying it may also be blocked
(``_StridedShard``, :class:`~fxtp.passes.placement.BlockShard`) when its inputs arrive so:
the op maps the dim index for index, so every rank's blocks line up.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

from torch.distributed.tensor import Placement, Shard

from .placement import P, R, UnitShard, blocks, is_blocked, with_dim

Labels = tuple[str, ...]
_fresh = itertools.count()


def fixed_label() -> str:
    """A label that names a dim no strategy may shard."""
    return f"_{next(_fresh)}!"


@dataclass(frozen=True)
class DimSpec:
    """How each tensor input's and output's dims relate.

    ``inputs[i]`` labels the dims of the i-th tensor input, or is ``None`` when the op reads
    only its shape/dtype (any placement is accepted as is). ``partial`` says how the op
    passes Partial values through: ``"sum"`` (linear in the inputs ``partial_args``, default
    all, jointly: those Partial and the rest, such as indices, Replicate -> Partial),
    ``"product"`` (linear in each input: one Partial input among ``partial_args``, the rest
    Replicate -> Partial) or ``"none"`` (the default: no Partial value passes).
    """

    inputs: tuple[Optional[Labels], ...]
    outputs: tuple[Labels, ...]
    partial: str = "none"
    partial_args: Optional[tuple[int, ...]] = None

    def labels(self) -> list[str]:
        seen: dict[str, None] = {}
        for labels in itertools.chain(self.inputs, self.outputs):
            for label in labels or ():
                seen.setdefault(label)
        return list(seen)


def parse(spec: str, ranks: Sequence[Optional[int]], out_ranks: Sequence[int] = (),
          partial: str = "none", partial_args=None) -> DimSpec:
    """Build a :class:`DimSpec` from ``"a b, b c+ -> a c"``; ``ranks`` gives each input's
    ndim to expand ``...`` (``None`` for an unread input, written ``?``)."""
    lhs, rhs = (side.strip() for side in spec.split("->"))
    in_terms = [t.strip() for t in lhs.split(",")] if lhs else []
    out_terms = [t.strip() for t in rhs.split(",")] if rhs else []
    if len(in_terms) != len(ranks):
        raise ValueError(f"spec {spec!r} has {len(in_terms)} inputs, op has {len(ranks)}")
    batch = max([r - (len(t.split()) - 1) for t, r in zip(in_terms, ranks)
                 if r is not None and "..." in t] + [0])

    def expand(term: str, rank: Optional[int]) -> Optional[Labels]:
        if term == "?":
            return None
        words = term.split()
        if "..." not in words:
            return tuple(fixed_label() if w == "_" else w for w in words)
        n = (rank if rank is not None else batch + len(words) - 1) - (len(words) - 1)
        dots = tuple(f"b{batch - n + i}" for i in range(n))
        i = words.index("...")
        return tuple(words[:i]) + dots + tuple(words[i + 1:])

    inputs = tuple(expand(t, r) for t, r in zip(in_terms, ranks))
    outs = list(out_ranks) + [None] * (len(out_terms) - len(out_ranks))
    outputs = tuple(expand(t, r) for t, r in zip(out_terms, outs))
    return DimSpec(inputs, outputs, partial, partial_args)


def label_base(label: str) -> str:
    return label.rstrip("+!")


def strategies(spec: DimSpec, in_shapes: Sequence, out_shapes: Sequence, world: int,
               actual: Sequence = (), unit_actual: Sequence = ()
               ) -> Iterator[tuple[tuple[Optional[Placement], ...], tuple[Placement, ...]]]:
    """Yield every valid ``(input placements, output placements)`` for the op: all
    Replicate, one strategy per shardable label whose dims divide evenly by ``world`` (and
    its blocked form, see :func:`_blocked`, given the inputs' ``actual`` placements), the
    unit-sharded forms of :func:`_units` (given ``unit_actual``), and the Partial
    pass-through strategies."""
    n_in = len(spec.inputs)
    yield tuple(None if s is None else R for s in spec.inputs), (R,) * len(spec.outputs)
    labels = spec.labels()
    out_bases = {label_base(label) for labels in spec.outputs for label in labels}
    fixed = {label_base(label) for label in labels if label.endswith("!")}
    summed_bases = {label_base(label) for label in labels if label.endswith("+")}
    for base in dict.fromkeys(map(label_base, labels)):
        summed = base in summed_bases
        if base in fixed or (not summed and base not in out_bases):
            continue
        found = _sharding(spec, base, summed, in_shapes, out_shapes,
                          lambda d, size: False if isinstance(size, int) and size % world
                          else Shard(d))
        if found is not None:
            ins, outs = found
            yield ins, outs
            blocked = _blocked(ins, outs, actual, in_shapes, out_shapes, world)
            if blocked is not None:
                yield blocked
    yield from _units(spec, in_shapes, out_shapes, world, unit_actual)
    yield from _whole(spec, unit_actual)
    partial_outs = (P,) * len(spec.outputs)
    if spec.partial == "sum":
        yield tuple(None if s is None else P if spec.partial_args is None or i in
                    spec.partial_args else R for i, s in enumerate(spec.inputs)), partial_outs
    elif spec.partial == "product":
        for i in spec.partial_args or range(n_in):
            if spec.inputs[i] is not None:
                yield tuple(P if j == i else (None if s is None else R)
                            for j, s in enumerate(spec.inputs)), partial_outs


def _blocked(ins, outs, actual, in_shapes, out_shapes, world):
    """``(ins, outs)`` with every ``Shard(d)`` cut in the blocks the inputs sharded by it
    arrive in (``_StridedShard`` or ``BlockShard``, one layout for all), when the label's
    dim has one static size, which the blocks divide, on every tensor carrying it; else
    ``None``."""
    layouts = {blocks(a) for a, p in zip(actual, ins)
               if isinstance(p, Shard) and is_blocked(a) and a.dim == p.dim}
    if len(layouts) != 1:
        return None
    (cut,) = layouts
    sizes = [shape[p.dim] for p, shape in zip(ins + outs, list(in_shapes) + list(out_shapes))
             if isinstance(p, Shard)]
    if not all(isinstance(s, int) for s in sizes) or len(set(sizes)) != 1:
        return None
    if sizes[0] % (cut * world) if isinstance(cut, int) else \
            (sum(cut) != sizes[0] or any(b % world for b in cut)):
        return None
    template = next(a for a in actual if is_blocked(a) and blocks(a) == cut)

    def block(p):
        return with_dim(template, p.dim) if isinstance(p, Shard) else p
    return tuple(map(block, ins)), tuple(map(block, outs))


def _units(spec, in_shapes, out_shapes, world, actual):
    """For each input arriving ``UnitShard(d, n)``, the strategy sharding the label of its
    dim ``d`` in ``n`` units on every tensor carrying it, when each such dim has a static
    size divisible by ``n``. A summed label gives ``Partial``, but only when the units are
    dealt to distinct ranks (a group of ranks holding one unit would add it several
    times)."""
    out_bases = {label_base(label) for labels in spec.outputs for label in labels}
    seen = set()
    for labels, a in zip(spec.inputs, actual):
        if not isinstance(a, UnitShard) or labels is None or a.dim >= len(labels):
            continue
        label = labels[a.dim]
        base, summed = label_base(label), label.endswith("+")
        if a.units == 1 or label.endswith("!") or (base, a.units) in seen or \
                (summed and a.units < world) or (not summed and base not in out_bases):
            continue
        seen.add((base, a.units))
        found = _sharding(spec, base, summed, in_shapes, out_shapes,
                          lambda d, size, n=a.units: UnitShard(d, n)
                          if isinstance(size, int) and size % n == 0 else False)
        if found is not None:
            yield found


def _sharding(spec, base, summed, in_shapes, out_shapes, shard):
    """``(input placements, output placements)`` sharding label ``base`` on every tensor
    carrying it as ``shard(dim, size)`` (``False``: it cannot) and replicating the others
    (a summed label's outputs ``Partial``), or ``None``."""
    def place(labels, shape):
        if labels is None:
            return None
        dims = [d for d, lab in enumerate(labels) if label_base(lab) == base]
        if not dims:
            return R
        return False if len(dims) > 1 else shard(dims[0], shape[dims[0]])

    ins = tuple(place(lab, s) for lab, s in zip(spec.inputs, in_shapes))
    outs = tuple(P if summed else place(lab, s) for lab, s in zip(spec.outputs, out_shapes))
    return (ins, outs) if False not in ins and False not in outs else None


def _whole(spec, actual):
    """Inputs held whole by every rank with per-rank partial gradients (a single unit, see
    ``UnitShard``) compute anything as replicated inputs would: the outputs are held so."""
    def whole(a):
        return isinstance(a, UnitShard) and a.units == 1
    if not any(map(whole, actual)):
        return
    yield (tuple(None if labels is None else a if whole(a) else R
                 for labels, a in zip(spec.inputs, actual)),
           (UnitShard(0, 1),) * len(spec.outputs))


def indivisible(spec: DimSpec, in_shapes: Sequence, out_shapes: Sequence, input_index: int,
                dim: int, world: int) -> list[str]:
    """Why the label of dim ``dim`` of input ``input_index`` has no sharded strategy, when
    the reason is size: every tensor dim carrying it whose size does not divide by
    ``world``, as ``"dim 2 of output 0 (size 6)"``."""
    labels = spec.inputs[input_index]
    if labels is None or dim >= len(labels) or labels[dim].endswith("!"):
        return []
    base = label_base(labels[dim])
    found = []
    for side, specs, shapes in (("input", spec.inputs, in_shapes),
                                ("output", spec.outputs, out_shapes)):
        for i, (labs, shape) in enumerate(zip(specs, shapes)):
            for d, label in enumerate(labs or ()):
                size = shape[d] if shape is not None else None
                if label_base(label) == base and isinstance(size, int) and size % world:
                    found.append(f"dim {d} of {side} {i} (size {size})")
    return found
