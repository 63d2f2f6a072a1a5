"""``derive_plan``: a tensor-parallel plan read off a model's traced program.

The model is traced once. Its linears are paired as Megatron pairs them
(:mod:`fxtp.planning.projections`): the linears whose outputs alone feed another (not the
residual stream) are column-wise, that one row-wise. A linear whose output is the
program's (the head) is column-wise, its logits gathered, or kept sharded by class where
the program computes the cross-entropy (loss parallel). Any other linear (a router, an
adaptive norm's modulation) is column-wise with its output gathered. The embedding is
vocabulary- or feature-parallel, whichever sends less. Embeddings, heads, gathered
linears, pairs and columns of pairs stay whole where that sends less and keeps a rank's
parameter bytes within ``memory_slack`` of Megatron's full sharding (less what would
gather), the units searched one at a time and together. Each candidate plan is placed by fxtp's own
passes (seed and place, no process group) and costed by its cost model
(:func:`~fxtp.passes.program_cost.program_cost`): a pair or head whose layout would make
the program gather where no rule serves it (a fallback) is left replicated, and the report
says why.
"""
from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

from ..edges.materialize import fake_tensors, meta_tensors, swapped
from ..frontend.trace import trace
from ..passes.context import PassContext
from ..passes.decompose import decompose_unruled
from ..passes.graph import FALLBACKS, HELD_WHOLE, PLACEMENT, boundary_nodes, calls_of
from ..passes.errors import PlanError
from ..passes.place import place
from ..passes.placement import is_replicate
from ..passes.program_cost import program_cost
from ..passes.seed import seed
from ..passes.snapshot import Snapshot
from ..passes.unused import drop_unused
from ..plans.resolution import resolve_plan, tied_names
from ..plans.styles import (ColwiseParallel, ExpertTensorParallel, ParallelStyle,
                            RowwiseParallel, SequenceParallel)
from .projections import Projection, projections, reduced_between


@dataclass(frozen=True)
class Placed:
    """What a candidate plan makes of the program: its fallbacks, what it sends per rank
    forward and backward (bytes plus a fixed cost per collective, fxtp's cost model), the
    bytes of parameters each rank holds, and those of them the plan shards that every rank
    holds whole (``HELD_WHOLE``)."""

    fallbacks: tuple
    sent: float
    held: int
    held_whole: tuple = ()  # (parameter FQN, bytes over its shard) the plan shards, held whole


class DerivedPlan(dict):
    """A plan (FQN pattern -> style) with what was left replicated and why (``report``:
    FQN -> reason), what the plan makes of the program (``placed``) and what Megatron's full
    sharding makes of it, less the groups whose sharding would gather (``megatron``: the
    base of ``memory_slack``)."""

    def __init__(self, plan: dict, report: dict, placed: Placed, megatron: Placed,
                 world: int):
        super().__init__(plan)
        self.report, self.placed, self.megatron, self.world = report, placed, megatron, world

    def __str__(self):
        width = max((len(k) for k in self), default=0)
        lines = [f"{k:<{width}}  {short(style)}" for k, style in self.items()]
        lines += [f"{k:<{width}}  (replicated: {why})" for k, why in self.report.items()]
        lines.append(f"at world {self.world}, per rank: communication cost "
                     f"{self.placed.sent / 2 ** 20:.2f} MiB a training step (bytes sent plus "
                     f"a fixed cost per collective), {self.placed.held / 2 ** 20:.2f} MiB of "
                     f"parameters ({self.placed.held / self.megatron.held:.3f}x Megatron's "
                     f"full sharding), {len(self.placed.fallbacks)} fallbacks")
        if self.placed.held_whole:
            names = dict.fromkeys(_INDEX.sub("*", fqn) for fqn, _ in self.placed.held_whole)
            lines.append(f"of which {sum(b for _, b in self.placed.held_whole) / 2 ** 20:.2f} "
                         f"MiB over their shards in parameters the plan shards and every rank "
                         f"holds whole (gm.fxtp.held_whole says why): {', '.join(names)}")
        return "\n".join(lines)


def short(style: ParallelStyle) -> str:
    """``style`` with the arguments that differ from its defaults."""
    default = vars(type(style)())
    args = ", ".join(f"{k}={v!r}" for k, v in vars(style).items() if default.get(k) != v)
    return f"{type(style).__name__}({args})"


def derive_plan(model: nn.Module, *, example_inputs=(), example_kwargs=None,
                world_size: Optional[int] = None, sequence_parallel: bool = False,
                loss_parallel: Optional[bool] = None, memory_slack: float = 0.02
                ) -> DerivedPlan:
    """The Megatron plan of ``model`` at ``world_size`` ranks (default: the process group's),
    traced on ``example_inputs`` / ``example_kwargs`` as it is called. ``loss_parallel``:
    the head's logits stay sharded by class (``None``: where the traced program computes
    a cross-entropy of them). ``memory_slack``: how many more parameter bytes a rank may
    hold than under Megatron's full sharding (every block projection, the embeddings and
    the head sharded), to send less: an embedding, head or other linear whose sharding
    costs more collectives than the bytes it saves are worth is left whole where that stays
    within (``memory_slack=0.1``: 10% more; ``0``: fully sharded). The result is a dict FQN
    pattern -> style, deterministic for a model and world size, to print, edit and pass to
    :func:`fxtp.parallelize`."""
    world = world_size or (dist.get_world_size() if dist.is_initialized() else None)
    if not world:
        raise PlanError("derive_plan needs world_size=... (or an initialized process group)")
    program = _Program(model, example_inputs, example_kwargs, world)
    roles, report = _megatron_roles(program.projections), {}
    _unsplittable(roles, model, world, report)
    megatron = _Megatron(program, roles, sequence_parallel, loss_parallel, report)
    plan = _cheapest_within(program, megatron, memory_slack, report)
    plan, placed = _without_fallbacks(program, plan, megatron.groups, report)
    order = {fqn: i for i, (fqn, _) in enumerate(model.named_modules())}
    plan = dict(sorted(plan.items(), key=lambda kv: order[kv[0]]))  # as the model lists them
    return DerivedPlan(_patterns(plan, model), _patterns(report, model), placed,
                       program.place(megatron.plan), world)


class _Megatron:
    """Megatron's full sharding of a program (``plan``): every pair, the heads, the word
    embedding, the experts (and the stream's norms under sequence parallelism), less each
    group whose sharding would gather (``report`` says why); the heads and embeddings whose
    layout is chosen by cost; the units kept or dropped whole."""

    def __init__(self, program: "_Program", roles: dict, sequence_parallel: bool,
                 loss_parallel: Optional[bool], report: dict):
        found, model = program.projections, program.model
        self.heads = {fqn: found[fqn].to_loss if loss_parallel is None else loss_parallel
                      for fqn, role in roles.items() if role == "head"}
        self.gathered = _by_pattern(fqn for fqn, role in roles.items() if role == "gathered")
        self.pairs = [sorted({f for row in rows for f in (*found[row].feeds, row)})
                      for rows in _by_pattern(f for f, role in roles.items() if role == "row")]
        self.columns = [*_by_pattern(f for f, role in roles.items() if role == "col"),
                        *_column_groups(self.pairs, roles)]
        self.embeddings = [fqn for fqn, p in found.items() if p.kind == "embedding"]
        self.word = _word_embedding(model, self.embeddings, program.aliases)
        self.sequence_parallel = sequence_parallel
        experts = [fqn for fqn, m in model.named_modules() if _holds_experts(fqn, m)]
        plan = {fqn: _style(role, self.heads.get(fqn), sequence_parallel)
                for fqn, role in roles.items()}
        norms = program.stream_norms(roles) if sequence_parallel else []
        plan.update({fqn: SequenceParallel() for fqn in norms})
        plan.update({fqn: ExpertTensorParallel() for fqn in experts})
        if self.word is not None:
            plan[self.word] = _embedding_styles(sequence_parallel)[0]
        self.groups = [*_groups(roles, found, self.embeddings), *([f] for f in experts)]
        self.plan, _ = _without_fallbacks(program, plan, self.groups, report)
        kept = lambda fqns: all(f in self.plan for f in fqns)  # noqa: E731
        self.heads = {fqn: lp for fqn, lp in self.heads.items() if fqn in self.plan}
        self.gathered, self.pairs, self.columns, self.experts = (
            [fqns for fqns in units if kept(fqns)]
            for units in (self.gathered, self.pairs, self.columns, _by_pattern(experts)))
        if self.word not in self.plan:
            self.embeddings = [fqn for fqn in self.embeddings if fqn != self.word]
            self.word = None
        self.pairs_gathered = {} if sequence_parallel else {  # pair -> its gathered layout
            tuple(fqns): layout for fqns in self.pairs
            if (layout := self._gathered_pair(fqns, found)) is not None}

    def _gathered_pair(self, fqns: list, found: dict) -> Optional[dict]:
        """The pair ``fqns`` laid out with the same bytes as sharded, its column-wise
        outputs gathered and its row-wise linear slicing its whole input, where that may
        send less: where an op between them sums over the features (a norm over every
        head), which sharded by features needs sums of its own. ``None`` elsewhere."""
        rows = [f for f in fqns if isinstance(self.plan[f], RowwiseParallel)]
        columns = [f for f in fqns if f not in rows]
        if not reduced_between(found, columns, rows):
            return None
        return {**{f: ColwiseParallel(output_layouts=Replicate()) for f in columns},
                **{f: RowwiseParallel(input_layouts=Replicate()) for f in rows}}

    def options(self, fqn: str, plan: dict) -> list:
        """The layouts to weigh for a head, an embedding or a gathered linear (``None``:
        whole), the one ``plan`` gives it first."""
        if fqn in self.heads or fqn not in self.embeddings:
            layouts = [self.plan[fqn], None]
        else:
            styles = _embedding_styles(self.sequence_parallel and fqn == self.word)
            layouts = [*styles, None] if fqn == self.word else [None, *styles]
        return sorted(layouts, key=lambda style: repr(style) != repr(plan.get(fqn)))


def _cheapest_within(program: "_Program", megatron: _Megatron, memory_slack: float,
                     report: dict) -> dict:
    """Megatron's plan with each embedding, head, gathered linear, pair, column of a pair
    and mixture's experts in the layout that sends least while a rank holds at most
    ``1 + memory_slack`` times the parameter bytes of Megatron's (a tie keeps Megatron's).
    A column whole leaves its pair's row-wise linear sharded, slicing its input for free: a
    column that feeds more than its pair (an indexer's projections beside attention) may
    send less so. Gathered linears, pairs, columns and experts are weighed per pattern of
    equal blocks (``layers.*.router``, ``layers.*.attn.{wq,wk,wv,wo}``).

    First each embedding and head takes its sharded layout that sends least. Then two
    searches, the better kept: one unit at a time (the embeddings and heads, then the
    others, the smallest first); and the units whole that together save most within the
    budget, each weighed alone (:func:`_most_saved`). Each is then swept again, one unit at
    a time, until a sweep changes nothing, and a swap is tried where one unit's move cannot
    get past the budget (:func:`_swapped`). A unit whose bytes whole would not fit the
    budget is not placed to find out."""
    plan = megatron.plan
    budget = math.floor(program.place(plan).held * (1 + memory_slack) + 1e-6)  # whole bytes
    rank = lambda trial: program.rank(trial, budget)  # noqa: E731
    firsts = [[fqn] for fqn in [*megatron.embeddings, *megatron.heads]]
    for fqns in firsts:
        trials = _trials(program, megatron, plan, fqns, False, budget)
        plan = min([t for t in trials if fqns[0] in t] if fqns[0] in plan else trials,
                   key=rank)
    wholes = [*megatron.pairs, *megatron.columns, *megatron.experts]  # as they are, or whole
    units = [*firsts, *sorted([*megatron.gathered, *wholes],
                              key=lambda fqns: program.numel(fqns))]
    found = [_swept(program, megatron, start, units, wholes, budget)
             for start in (plan, _most_saved(program, plan, units, budget))]
    plan = min(found, key=rank)
    report.update({fqn: f"sharding it sends more, and whole it stays within "
                        f"memory_slack={memory_slack}"
                   for fqns in units for fqn in fqns if fqn not in plan})
    return plan


def _swept(program: "_Program", megatron: _Megatron, plan: dict, units: list, wholes: list,
           budget: float) -> dict:
    """``plan`` with each of ``units`` in turn in its layout that sends least within
    ``budget``, swept until a sweep changes nothing (at most :data:`_SWEEPS` times)."""
    for _ in range(_SWEEPS):
        start = plan
        for fqns in units:
            plan = min(_trials(program, megatron, plan, fqns, fqns in wholes, budget),
                       key=lambda trial: program.rank(trial, budget))
        if program.key(plan) == program.key(start):
            plan = _swapped(program, megatron, plan, units, wholes, budget)
            if program.key(plan) == program.key(start):
                break
    return plan


def _swapped(program: "_Program", megatron: _Megatron, plan: dict, units: list,
             wholes: list, budget: float) -> dict:
    """``plan`` with a unit it shards whole, where whole it would send less but not fit
    ``budget``, and units it holds whole sharded to make room (the few sets that free
    enough at least estimated cost, each unit's cost weighed alone, placed to find out):
    the best such swap that sends less than ``plan``. A move of one unit at a time cannot
    make it."""
    rank = lambda trial: program.rank(trial, budget)  # noqa: E731
    best, found = rank(plan), plan
    base = program.place(plan)
    freeing = []  # (what it sends more, bytes it frees, its layouts)
    for a in [u for u in units if not all(f in plan for f in u)]:
        trials = [t for t in _trials(program, megatron, plan, a, a in wholes, budget)
                  if all(f in t for f in a) and not program.place(t).fallbacks]
        if trials:
            trial = min(trials, key=rank)
            placed = program.place(trial)
            if base.held > placed.held:
                freeing.append((placed.sent - base.sent, base.held - placed.held,
                                {f: trial[f] for f in a}))
    room = sum(freed for _, freed, _ in freeing) + budget - base.held
    for b in [u for u in units if all(f in plan for f in u)]:
        if program.added_whole(b, plan) > room:  # no swap makes room: not placed
            continue
        whole = _with(plan, b, None)
        if rank(whole)[::2] >= best[::2]:  # whole, it would not send less
            continue
        for made in _making_room(freeing, program.place(whole).held - budget):
            swap = {**whole, **{f: s for layouts in made for f, s in layouts.items()}}
            if rank(swap) < best:
                best, found = rank(swap), swap
    return found


def _making_room(freeing: list, need: float, tried: int = 2) -> list[list[dict]]:
    """The ``tried`` sets of ``freeing``'s ``(cost, bytes freed, layouts)`` that free at
    least ``need`` bytes at least summed cost (every set of up to :data:`_SWAP_UNITS`
    units): their layouts."""
    sets = [c for n in range(1, min(len(freeing), _SWAP_UNITS) + 1)
            for c in itertools.combinations(range(len(freeing)), n)
            if sum(freeing[i][1] for i in c) >= need]
    sets.sort(key=lambda c: (sum(freeing[i][0] for i in c), len(c), c))
    return [[freeing[i][2] for i in c] for c in sets[:tried]]


_SWAP_UNITS = 4  # the most units held whole sharded together to make room


def _most_saved(program: "_Program", plan: dict, units: list, budget: float) -> dict:
    """``plan`` with the ``units`` whole whose savings, each weighed alone against ``plan``,
    add up to most within ``budget`` (a 0/1 knapsack over the bytes each adds whole)."""
    base = program.place(plan)
    room = budget - base.held
    items = []  # (fqns, bytes it adds whole, what it saves)
    for fqns in units:
        extra = program.added_whole(fqns, plan)
        if not any(f in plan for f in fqns) or extra > room or \
                any(_tied_to_plan(f, plan, program.aliases) for f in fqns):
            continue
        placed = program.place(_with(plan, fqns, None))
        if len(placed.fallbacks) <= len(base.fallbacks) and placed.sent < base.sent:
            items.append((fqns, extra, base.sent - placed.sent))
    for fqns in _knapsack(items, room):
        plan = _with(plan, fqns, None)
    return plan


def _knapsack(items: list, room: float, steps: int = 1024) -> list:
    """The ``(key, weight, value)`` items of most value whose weights (rounded up to
    ``room / steps``) fit ``room``: their keys."""
    unit = room / steps if room > 0 else 1.0
    best = [0.0] * (steps + 1)  # most value within each capacity, by items so far
    taken = []
    for _, weight, value in items:
        w = math.ceil(weight / unit - 1e-9)
        take = [best[c - w] + value > best[c] if c >= w else False
                for c in range(steps + 1)]
        best = [best[c - w] + value if take[c] else best[c] for c in range(steps + 1)]
        taken.append(take)
    chosen, c = [], steps
    for (key, weight, _), take in zip(reversed(items), reversed(taken)):
        if take[c]:
            chosen.append(key)
            c -= math.ceil(weight / unit - 1e-9)
    return chosen[::-1]


def _trials(program: "_Program", megatron: _Megatron, plan: dict, fqns: list, whole: bool,
            budget: float) -> list[dict]:
    """``plan``, then ``plan`` with the unit ``fqns`` in each other layout it may take (a
    pair or column whole only where its bytes whole fit ``budget``)."""
    if whole:
        sharded = {**plan, **{f: megatron.plan[f] for f in fqns if f in megatron.plan}}
        fits = program.place(sharded).held + program.added_whole(fqns, sharded) <= budget
        gathered = megatron.pairs_gathered.get(tuple(fqns))
        return [plan, *[t for t in (sharded, gathered and {**plan, **gathered},
                                    _with(plan, fqns, None) if fits else None)
                         if t is not None and program.key(t) != program.key(plan)]]
    options = megatron.options(fqns[0], plan)
    if any(_tied_to_plan(fqn, plan, program.aliases) for fqn in fqns):
        options.remove(None)  # a tied weight follows the other module's layout anyway
    return [_with(plan, fqns, o) for o in options]


_SWEEPS = 3  # over the units, until a sweep changes nothing


def _without_fallbacks(program: "_Program", plan: dict, groups: list, report: dict
                       ) -> tuple[dict, Placed]:
    """``plan`` less each group (a pair, a head, an embedding, experts) whose sharding
    leaves a fallback, and what it makes of the program."""
    placed = program.place(plan)
    for group in groups:
        if not placed.fallbacks:
            break
        trial = {k: v for k, v in plan.items() if k not in group}
        tried = program.place(trial)
        if len(tried.fallbacks) < len(placed.fallbacks):
            why = f"sharded, the program would gather: {placed.fallbacks[0]}"
            report.update({fqn: why for fqn in group})
            plan, placed = trial, tried
    return plan, placed


def _column_groups(pairs: list, roles: dict) -> list[list[str]]:
    """The columns of a pair that share a module, where the pair's columns are in more than
    one (an indexer's ``wq_b`` and ``weights_proj`` beside attention's ``q_b_proj``): whole
    together they may send less, where each alone sends no less (the other, sharded, still
    splits what they compute)."""
    groups = []
    for pair in pairs:
        by_module: dict[str, list[str]] = {}
        for fqn in pair:
            if roles.get(fqn) == "col":
                by_module.setdefault(_INDEX.sub("*", fqn.rpartition(".")[0]), []).append(fqn)
        if len(by_module) > 1:
            groups += [fqns for fqns in by_module.values()
                       if len({_INDEX.sub("*", f) for f in fqns}) > 1]
    return groups


def _holds_experts(fqn: str, module: nn.Module) -> bool:
    """Does ``module`` hold a mixture's experts as 3-D weights that
    :class:`~fxtp.plans.styles.ExpertTensorParallel` shards (each expert's projections a
    column-wise / row-wise pair)?"""
    weights = [p for p in module.parameters(recurse=False) if p.dim() == 3]
    if len(weights) < 2 or len({p.shape[0] for p in weights}) != 1:
        return False
    try:
        ExpertTensorParallel().shard(fqn, module)
    except PlanError:
        return False
    return True


def _embedding_styles(sequence_sharded: bool) -> list[ParallelStyle]:
    """Vocabulary-parallel, then feature-parallel, with the output sequence-sharded (the
    word embedding under sequence parallelism) or whole."""
    out = Shard(1) if sequence_sharded else Replicate()
    return [RowwiseParallel(input_layouts=Replicate(), output_layouts=out),
            ColwiseParallel(output_layouts=out)]


def _word_embedding(model: nn.Module, embeddings: list, aliases: dict) -> Optional[str]:
    """The embedding of the tokens: the one tied to a head, else the one with most rows."""
    tied = [fqn for fqn in embeddings if f"{fqn}.weight" in aliases]
    return max(tied or embeddings, key=lambda f: model.get_submodule(f).num_embeddings,
               default=None)


def _tied_to_plan(fqn: str, plan: dict, aliases: dict) -> bool:
    """Is ``fqn``'s weight also another planned module's?"""
    return any(name.rpartition(".")[0] in plan and name.rpartition(".")[0] != fqn
               for name in aliases.get(f"{fqn}.weight", ()))


def _with(plan: dict, fqns: list, style: Optional[ParallelStyle]) -> dict:
    """``plan`` with each of ``fqns`` in ``style`` (``None``: left out, whole)."""
    others = {k: v for k, v in plan.items() if k not in fqns}
    return others if style is None else {**others, **dict.fromkeys(fqns, style)}


def _unsplittable(roles: dict, model: nn.Module, world: int, report: dict) -> None:
    """Take out of ``roles``, with the reason, the heads and gathered linears with fewer
    output features than ranks (Qwen3-Next's one-feature shared-expert gate)."""
    for fqn in [f for f, role in roles.items() if role in ("head", "gathered")]:
        features = getattr(model.get_submodule(fqn), "out_features", world)
        if features < world:
            del roles[fqn]
            report[fqn] = f"its {features} output feature(s) cannot be split among {world} ranks"


def _by_pattern(fqns) -> list[list[str]]:
    """``fqns`` grouped by the pattern of equal blocks they share, in first-seen order."""
    groups: dict[str, list[str]] = {}
    for fqn in fqns:
        groups.setdefault(_INDEX.sub("*", fqn), []).append(fqn)
    return list(groups.values())


def _megatron_roles(found: dict[str, Projection]) -> dict:
    """FQN -> ``"col"``, ``"row"``, ``"head"`` or ``"gathered"`` (a linear no linear reads:
    column-wise, its output gathered) for every linear. Pairs are taken from the program's
    end backwards, so that of a chain of linears each fed by the one before (a low-rank
    bottleneck: MLA's ``q_a_proj -> q_b_proj -> attention -> o_proj``) the outer pair is
    the one: the bottleneck's second linear is a column of the block's pair."""
    roles: dict[str, str] = {}
    for fqn, p in reversed(found.items()):
        if p.kind != "linear" or not p.feeds or p.from_stream or fqn in roles:
            continue
        if all(roles.get(f) in (None, "col") for f in p.feeds):
            roles.update(dict.fromkeys(sorted(p.feeds), "col"))
            roles[fqn] = "row"
    for fqn, p in found.items():
        if p.kind == "linear" and fqn not in roles:
            roles[fqn] = "head" if p.to_output or p.to_loss else "gathered"
    return {fqn: roles[fqn] for fqn in found if fqn in roles}  # in call order


def _style(role: str, loss_parallel: Optional[bool], sequence_parallel: bool
           ) -> ParallelStyle:
    """The style of a linear's role; under sequence parallelism a row-wise output is
    reduce-scattered to sequence shards (the column-wise inputs are gathered from them)."""
    if role == "col":
        return ColwiseParallel()
    if role == "row":
        return RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else \
            RowwiseParallel()
    return ColwiseParallel(output_layouts=Shard(-1) if loss_parallel else Replicate())


def _groups(roles: dict, found: dict, embeddings: list) -> list[list[str]]:
    """The units a plan keeps or drops whole: each row-wise linear with the column-wise
    ones feeding it, each head, each embedding."""
    groups = [[*sorted(found[fqn].feeds), fqn] for fqn, role in roles.items() if role == "row"]
    groups += [[fqn] for fqn, role in roles.items() if role in ("head", "gathered")]
    return groups + [[fqn] for fqn in embeddings]


def place_plans(model: nn.Module, plans: dict, *, example_inputs=(), example_kwargs=None,
                world_size: int) -> dict[str, Placed]:
    """Name -> :class:`Placed` for each of ``plans`` (name -> plan, ``"auto"`` included):
    what each makes of ``model``'s program at ``world_size`` ranks, placed by fxtp's passes
    on one trace (no process group)."""
    program = _Program(model, example_inputs, example_kwargs, world_size)
    return {name: program.place(plan) for name, plan in plans.items()}


def compared(placed: dict[str, Placed]) -> str:
    """``placed`` (name -> :class:`Placed`) as a table, one plan a row."""
    width = max(len(name) for name in placed)
    rows = [f"{'plan':<{width}}  {'fallbacks':>9}  {'comm cost MiB':>15}  "
            f"{'MiB of parameters':>17}"]
    rows += [f"{name:<{width}}  {len(p.fallbacks):>9}  {p.sent / 2 ** 20:>15.2f}  "
             f"{p.held / 2 ** 20:>17.2f}" for name, p in placed.items()]
    return "\n".join(rows)


class _Program:
    """The model traced once, placed under candidate plans."""

    def __init__(self, model: nn.Module, args, kwargs, world: int):
        self.model, self.world = model, world
        boundaries = [fqn for fqn, m in model.named_modules()
                      if isinstance(m, (nn.Linear, nn.Embedding)) or
                      type(m).__name__ == "Conv1D" or is_norm(m)]
        meta = meta_tensors(model)
        with swapped(model, fake_tensors(meta, torch.device("cpu"))):
            self.gm, self.calls = trace(model, tuple(args), dict(kwargs or {}) or None,
                                        boundaries)
        ctx = PassContext(world, kept=boundary_nodes(self.calls), model=model)
        decompose_unruled(drop_unused(self.gm, ctx), ctx)  # the program parallelize places
        self.aliases = tied_names(model)
        self.projections, self.sources = projections(self.gm, model, self.aliases)
        self.placed: dict[tuple, Placed] = {}  # a plan's styles -> what it makes

    def numel(self, fqns: list) -> int:
        """The parameters' elements of the modules ``fqns``."""
        return sum(p.numel() for f in fqns for p in self.model.get_submodule(f).parameters())

    def added_whole(self, fqns: list, plan: dict) -> float:
        """How many more parameter bytes a rank holds with the modules of ``fqns`` that
        ``plan`` shards whole (at most: a row-wise bias is whole already)."""
        return sum(p.numel() * p.element_size() for f in fqns if f in plan
                   for p in self.model.get_submodule(f).parameters()) * (1 - 1 / self.world)

    def stream_norms(self, roles: dict) -> list[str]:
        """The norms applied to the residual stream (not to a column-wise output: a q / k
        norm over heads), which sequence parallelism runs on sequence shards."""
        cols = {fqn for fqn, role in roles.items() if role == "col"}
        found = []
        for fqn, m in self.model.named_modules():
            calls = calls_of(self.calls, fqn) if is_norm(m) else []
            if calls and all(not (self.sources.of(c.args[0])[0] & cols) for c in calls
                             if c.args):
                found.append(fqn)
        return found

    def rank(self, plan: dict, budget: float) -> tuple:
        """How good ``plan`` is, least first: fewer fallbacks, then within the parameter
        bytes ``budget``, then sending less (a tie keeps the earlier plan: ``min``)."""
        try:
            placed = self.place(plan)
        except PlanError:  # a layout the plan cannot give (a tied weight split two ways)
            return math.inf, True, math.inf
        return len(placed.fallbacks), placed.held > budget, placed.sent

    def place(self, plan: dict) -> Placed:
        """What ``plan`` (a dict, or ``"auto"``) makes of the program (each plan placed
        once)."""
        key = self.key(plan)
        if key not in self.placed:
            self.placed[key] = self._place(plan)
        return self.placed[key]

    @staticmethod
    def key(plan) -> tuple:
        """``plan`` as a value (a style's ``repr`` holds all its arguments)."""
        return plan if isinstance(plan, str) else \
            tuple(sorted((fqn, repr(style)) for fqn, style in plan.items()))

    def _place(self, plan: dict) -> Placed:
        gm = self.gm
        before, meta = Snapshot(gm.graph), dict(gm.meta)
        try:
            ctx = PassContext(self.world, shardings=resolve_plan(self.model, plan),
                              calls=self.calls, aliases=self.aliases)
            place(seed(gm, ctx), ctx)
            fallbacks = tuple(gm.meta[FALLBACKS])
            sent, _ = program_cost(gm, self.world)
            attrs = [n for n in gm.graph.nodes if n.op == "get_attr" and PLACEMENT in n.meta]
            held = sum(_held_bytes(n, self.world) for n in attrs)
            whole = tuple((n.target, _held_bytes(n, self.world, True) -
                           _held_bytes(n, self.world, False))
                          for n in attrs if HELD_WHOLE in n.meta)
        finally:
            before.restore()
            gm.meta.clear()
            gm.meta.update(meta)
        return Placed(fallbacks, sent, held, whole)


def is_norm(module: nn.Module) -> bool:
    """A layer norm or RMS norm (torch's, or a model's own ``...Norm`` class with 1-D
    parameters only)."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or (
        type(module).__name__.endswith("Norm") and
        all(p.dim() == 1 for p in module.parameters(recurse=False)))


def _held_bytes(node: fx.Node, world: int, whole: Optional[bool] = None) -> int:
    """The bytes of the tensor ``node`` reads that each rank holds, as it is placed (or
    ``whole``, or not)."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return 0
    size = value.numel() * value.element_size()
    whole = is_replicate(node.meta[PLACEMENT]) if whole is None else whole
    return size if whole else -(-size // world)


_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)")


def _patterns(entries: dict, model: nn.Module) -> dict:
    """``entries`` (FQN -> value) with the FQNs that differ only in list indices written as
    one pattern, ``*`` where they differ, where every module the pattern matches has the
    same value; failing that, with the outer index alone as ``*`` (``blocks.*.0``,
    ``blocks.*.2`` for the linears of a ``Sequential`` in each block)."""
    modules = [fqn.split(".") for fqn, _ in model.named_modules()]
    out = {}
    for fqns in _grouped(entries, lambda fqn: _INDEX.sub("*", fqn)).values():
        pattern = _one_pattern(fqns, entries, modules)
        if pattern is not None:
            out[pattern] = entries[fqns[0]]
            continue
        for inner in _grouped(fqns, lambda fqn: _INDEX.sub("*", fqn, count=1)).values():
            pattern = _one_pattern(inner, entries, modules)
            out.update({pattern: entries[inner[0]]} if pattern is not None else
                       {f: entries[f] for f in inner})
    return out


def _grouped(fqns, key) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for fqn in fqns:
        groups.setdefault(key(fqn), []).append(fqn)
    return groups


def _one_pattern(fqns: list, entries: dict, modules: list) -> Optional[str]:
    """The pattern of ``fqns`` (``*`` where they differ) if they are more than one, share
    one value and are every module it matches."""
    parts = [p[0] if len(set(p)) == 1 else "*" for p in zip(*(f.split(".") for f in fqns))]
    matching = [m for m in modules if len(m) == len(parts) and
                all(a in ("*", b) for a, b in zip(parts, m))]
    if len(fqns) > 1 and len({repr(entries[f]) for f in fqns}) == 1 and \
            len(matching) == len(fqns):
        return ".".join(parts)
    return None
