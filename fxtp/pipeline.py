"""``parallelize``: a model and a plan in, this rank's program out, in six stages over one
:class:`Build` (each stage's files, with ``dump_dir``: :mod:`fxtp.inspection.dump`):

============  =================================================================================
trace         the model to one graph, equal blocks stamped (:mod:`fxtp.frontend.trace`), and every
              rank holding the same plan, model and graph
seed          the plan's layouts at module boundaries (:mod:`fxtp.passes.seed`)
place         placements propagated over every op, with the relayouts that spare a gather
              (:mod:`fxtp.passes.place`)
rewrite       collectives where placements change (:mod:`fxtp.passes.rewrite`)
localize      global shapes made local, checked on fake tensors (:mod:`fxtp.passes.localize`)
assemble      tensors in, inputs guarded, modules and checkpoint regions outlined, parameters
              as ``DTensor`` s, ``gm.fxtp`` (:class:`ParallelInfo`)
============  =================================================================================

What the stages write on nodes and on the graph module is listed in :mod:`fxtp.passes.graph`.
Blocks are kept stamped where they can stand for themselves; where they cannot
(:func:`_program` says so), every block is traced in full.
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate

from .edges.dtensor_outputs import dtensor_positions, hand_out_dtensors
from .edges.dtensor_params import as_dtensors
from .edges.info import ParallelInfo
from .edges.local_reads import follow_parameters
from .edges.materialize import fake_tensors, materialize, meta_tensors, swapped
from .edges.unplanned_outputs import unplanned_sharded_outputs
from .frontend.meta_copy import meta_copy
from .frontend.mode_regions import restore_modes_on_error
from .frontend.stamping import copied_fallbacks
from .frontend.trace import trace
from .inspection.dump import Dumper
from .kernels.collectives import allow_in_dynamo_graphs
from .passes.context import PassContext
from .passes.decompose import decompose_unruled
from .passes.errors import InputError, PlanError, ShardingError, StampMismatch
from .passes.graph import (FALLBACKS, HELD_WHOLE, INLINED, PLACEMENT, RECOMPUTED, REGION, STAMPED,
                           boundary_nodes, calls_of, keep_on_copy)
from .passes.localize import localize
from .passes.modules import generate_code, outline_modules, scope_of, stamp_modules
from .passes.place import place
from .passes.posing import copy_data_attributes, give_parameter_properties
from .passes.propagate import propagate
from .passes.recompute import copy_written_collectives, outline_checkpoints
from .passes.rehearse import rehearse
from .passes.rewrite import rewrite
from .passes.seed import seed
from .passes.unused import drop_unused
from .planning.derive import derive_plan
from .plans.mesh import resolve_group
from .plans.resolution import Plan, block_fqns, module_fqns, resolve_plan, tied_names
from .runtime.first_call import agree_until_first_success
from .runtime.guards import (check_fresh, check_same_on_every_rank, every_rank_or_none,
                             guard_arguments, guard_casts, guard_inputs)
from .runtime.modes import keep_programs


def parallelize(model: nn.Module, plan: Plan, mesh=None, *, example_inputs: Sequence = (),
                example_kwargs: Optional[dict] = None, dynamic_shapes=None,
                strict: bool = False, init_fn: Optional[Callable[[nn.Module], None]] = None,
                device: Union[str, torch.device, None] = None,
                dump_dir: Optional[str] = None,
                checkpoint: Sequence[str] = (), modules: Sequence[str] = (),
                dtensor_params: bool = True, param_dtype: Optional[torch.dtype] = None,
                stamp_blocks: bool = True) -> fx.GraphModule:
    """Return this rank's tensor-parallel ``GraphModule`` for ``model`` under ``plan``: a
    style, a dict of FQN patterns to styles (or Hugging Face plan strings), ``"auto"``
    (a Hugging Face model's own plan, :mod:`fxtp.plans.huggingface`) or ``"derive"`` (the
    plan :func:`fxtp.derive_plan` reads off the model's program at the group's size).

    ``example_inputs`` / ``example_kwargs`` are full (single-device) inputs used for
    tracing, positional and by keyword as the model is called (either may be left out,
    not both). At run time every rank passes the same full inputs, except root inputs whose
    plan layout is ``Shard``: those are passed as local shards. Outputs come back
    replicated, or as local shards where the plan leaves them sharded. Parameters keep
    their FQNs and hold local shards. ``model`` is not modified.

    ``strict``: what would be a warning is an error: a fallback (a gather fxtp had to add,
    :class:`ShardingError`) or a plan key that matches no module (:class:`PlanError`).

    ``dynamic_shapes`` (``torch.export``'s format, e.g. ``{"x": {0: Dim("batch"),
    1: Dim("seq")}}``) marks dims that may change between calls: the result then serves
    every size without retracing.

    A model built on the meta device gets only its local shards, allocated on ``device``
    (default: the group's device) and initialized by ``init_fn(module)`` or the modules'
    ``reset_parameters()`` (:mod:`fxtp.edges.materialize`); with ``device="meta"`` they stay on
    the meta device: shapes only (plan checks, :mod:`fxtp.cli`), or to be sharded further
    by ``fully_shard`` before ``gm.to_empty(device=...)`` and :func:`fxtp.init_weights`
    allocate and initialize them (each rank then holds only its dp x tp share). The program
    is then traced for the group's device (``cuda`` for NCCL, ``cpu`` for gloo), which
    ``to_empty`` must allocate on.

    ``dump_dir`` (or the environment variable ``FXTP_DUMP_DIR``) writes every stage's
    result, :func:`fxtp.explain`'s report and an HTML view there (:mod:`fxtp.inspection.dump`).

    Activation checkpointing: the model's own non-reentrant ``torch.utils.checkpoint``
    regions are kept (:mod:`fxtp.passes.recompute`), and ``checkpoint`` names modules (plan
    key patterns, e.g. ``["layers.*"]``) whose every call is checkpointed as if wrapped,
    without editing the model.

    The module tree survives (:mod:`fxtp.passes.modules`): every module the plan names,
    every element of an ``nn.ModuleList`` / ``ModuleDict`` (a model's blocks), every module
    ``checkpoint`` or ``modules`` (plan key patterns) names, and the modules calling them
    are submodules of the result at their FQNs, each running its part of the program, so
    ``fully_shard``, ``checkpoint_wrapper``, hooks and ``torch.compile`` apply per block.
    Replicated parameters' gradient syncs (sequence-parallel norm weights) are bucketed
    per block (and one bucket for the rest), so each block reads only its own parameters.

    ``param_dtype``: the dtype floating parameters (and floating inputs) will have when the
    program runs, where it differs from theirs: FSDP2's
    ``MixedPrecisionPolicy(param_dtype=...)`` casts them before every forward. The model is
    traced as if cast (a trace records the casts its dtypes call for, and drops those that
    are no-ops), while the result keeps the model's parameters in their own dtype.

    ``stamp_blocks``: blocks (elements of ``ModuleList`` s / ``ModuleDict`` s) with the same
    code, shapes and plan are traced and analysed once, and each is a copy of the first
    one's module holding its own shards (:mod:`fxtp.frontend.stamping`; where one's inputs arrive
    placed otherwise, copies of the first one's traced nodes analysed anew); ``False``
    traces every block (the same program, slower to get).

    ``dtensor_params``: parameters are ``DTensor`` s on the mesh (global shape, this rank's
    shard inside), so ``torch.nn.utils.clip_grad_norm_``, ``state_dict()`` with DCP and
    FSDP2 see the global model, while the program computes on plain local tensors and
    optimizers step them locally (:mod:`fxtp.edges.local_reads`, :mod:`fxtp.edges.local_steps`).
    ``False`` makes each parameter this rank's shard itself, a plain tensor: for code that
    differentiates with respect to the parameters (``torch.autograd.grad(loss,
    gm.parameters())``), which the reads do not pass through. torch's own tools then see
    one rank's shard (``fxtp.clip_grad_norm_`` and ``fxtp.state_dict`` still give global
    results).
    """
    options = Options(example_inputs, example_kwargs, dynamic_shapes, strict, init_fn, device,
                      dump_dir, checkpoint, modules, dtensor_params, param_dtype, stamp_blocks)
    job = _resolve(model, plan, mesh, options)
    with _collector_paused():  # blocks stamped where they can be, else traced in full
        gm = (stamp_blocks and _program(job, keep_stamps=True)) or \
            _program(job, keep_stamps=False)
    for message in [*gm.fxtp.fallbacks, *gm.fxtp.unplanned_outputs, *gm.fxtp.uncalled.values()]:
        warnings.warn("fxtp: " + message, stacklevel=2)
    _attach_run_time(gm, job)
    return gm


@dataclass(frozen=True)
class Options:
    """``parallelize``'s keyword arguments, as given."""

    example_inputs: Sequence
    example_kwargs: Optional[dict]
    dynamic_shapes: object
    strict: bool
    init_fn: Optional[Callable[[nn.Module], None]]
    device: Union[str, torch.device, None]
    dump_dir: Optional[str]
    checkpoint: Sequence[str]
    modules: Sequence[str]
    dtensor_params: bool
    param_dtype: Optional[torch.dtype]
    stamp_blocks: bool


@dataclass
class Job:
    """What every attempt at the program starts from: the inputs, resolved once."""

    model: nn.Module
    plan: Plan
    mesh: object
    options: Options
    shardings: dict  # FQN -> ModuleSharding
    checkpointed: list  # FQNs of modules checkpointed as if wrapped
    repeated: list  # FQNs of blocks (elements of ModuleLists / ModuleDicts)
    blocks: list  # FQNs kept as submodules: blocks, checkpointed and named modules
    group: object  # the resolved process group (fxtp.plans.mesh)
    device: torch.device  # where the result's tensors live
    meta: dict  # FQN -> the model's meta-device tensors
    recast: dict  # FQN -> meta stand-ins of param_dtype


@dataclass
class Build:
    """One attempt at the program: what each stage leaves for the next."""

    job: Job
    keep_stamps: bool
    dump: Optional[Dumper] = None
    gm: Optional[fx.GraphModule] = None
    calls: dict = field(default_factory=dict)  # module FQN -> its traced calls
    stamped: dict = field(default_factory=dict)  # block FQN -> its reference's FQN
    outside: dict = field(default_factory=dict)  # the plan's modules outside stamped blocks
    tied: dict = field(default_factory=dict)
    uncalled: dict = field(default_factory=dict)
    called: dict = field(default_factory=dict)
    dtensor_outputs: tuple = ()
    init_seed: int = 0
    fallbacks: list = field(default_factory=list)
    unplanned: list = field(default_factory=list)
    ctx: Optional[PassContext] = None  # what the passes are given besides the graph
    copies: dict = field(default_factory=dict)  # a stamped block's tensor -> its reference's
    placements: dict = field(default_factory=dict)  # tensor FQN -> placement
    shapes: dict = field(default_factory=dict)  # tensor FQN -> global shape
    held_whole: dict = field(default_factory=dict)  # parameter FQN -> why, against the plan


def _resolve(model: nn.Module, plan: Plan, mesh, options: Options) -> Job:
    if not options.example_inputs and not options.example_kwargs:
        raise InputError(f"parallelize({type(model).__name__}) traces the model on example "
                         "inputs: pass example_inputs=(...) and / or example_kwargs={...} "
                         "as the model is called")
    allow_in_dynamo_graphs()  # the result may be compiled: its collectives stay calls
    check_fresh(model)
    if isinstance(plan, str) and plan == "derive":
        plan = derive_plan(model, example_inputs=options.example_inputs,
                           example_kwargs=options.example_kwargs,
                           world_size=resolve_group(mesh).world)
    shardings = resolve_plan(model, plan, options.strict,
                             lambda: resolve_group(mesh).device_mesh())
    checkpointed = module_fqns(model, options.checkpoint, "checkpoint pattern")
    repeated = block_fqns(model)
    blocks = [*repeated, *checkpointed, *module_fqns(model, options.modules, "modules pattern")]
    group = resolve_group(mesh)
    return Job(model, plan, mesh, options, shardings, checkpointed, repeated, blocks, group,
               _device(options.device, group, model), meta_tensors(model),
               _recast(model, options.param_dtype))


def _program(job: Job, keep_stamps: bool) -> Optional[fx.GraphModule]:
    """This rank's program: trace -> seed -> place -> rewrite -> localize -> assemble.
    With ``keep_stamps``, ``None`` where the stamped blocks cannot stand for themselves (a
    block whose inputs arrive placed unlike its reference's, or that its reference's
    module cannot run: :class:`StampMismatch`; under ``strict``, a fallback, which blocks
    placed each on its own may not need): the caller then traces every block in full."""
    build = Build(job, keep_stamps)
    group = job.group
    try:
        with Dumper(job.options.dump_dir, group) as build.dump:
            with every_rank_or_none(group, "tracing the model"):
                _trace(build)
            _agree(build)
            with every_rank_or_none(group, "placing and rewriting the program"):
                _seed(build)
                _place(build)
                _rewrite(build)
                _localize(build)
            _assemble(build)
    except (StampMismatch, ShardingError):
        if keep_stamps:
            return None
        raise
    return build.gm


def _trace(b: Build) -> None:
    """The model traced to one graph (:mod:`fxtp.frontend.trace`), its blocks stamped, unused and
    composite ops dropped; what the plan's modules were called with."""
    job, options = b.job, b.job.options
    # a trace records the devices its factory calls ask for (HF's position ids: the
    # embeddings' device): traced for the device the tensors will have, which for shards
    # kept on meta is the group's (where to_empty is expected to allocate them)
    runs_on = _device(None, job.group) if job.device.type == "meta" else job.device
    with swapped(job.model, fake_tensors({**job.meta, **job.recast}, runs_on)):
        gm, b.calls = trace(job.model, _cast(options.example_inputs, options.param_dtype),
                            options.example_kwargs, job.shardings, options.dynamic_shapes,
                            job.checkpointed, job.repeated if options.stamp_blocks else (),
                            {k: s.style for k, s in job.shardings.items()}, b.keep_stamps)
    b.ctx = PassContext(job.group.world, job.group, kept=boundary_nodes(b.calls),
                        model=job.model, regions=gm.meta[REGION])
    decompose_unruled(drop_unused(gm, b.ctx), b.ctx)  # composite ops without a rule
    for fqn in job.recast.keys() - job.meta.keys():  # the model's own, not the recast
        owner, _, name = fqn.rpartition(".")
        gm.get_submodule(owner)._parameters[name] = job.model.get_parameter(fqn)
    b.dump.code("traced", gm)
    b.gm, b.stamped = gm, gm.meta[STAMPED] if b.keep_stamps else {}
    b.outside = _outside(job.shardings, b.stamped)
    b.tied = tied_names(job.model)  # a tied weight read is no sign of its own module's
    read = {n.target for n in gm.graph.nodes if n.op == "get_attr" and n.users} - b.tied.keys()
    held = {name for name, _ in job.model.named_parameters(remove_duplicate=False)}
    b.uncalled = _uncalled(b.outside, b.calls, options.strict, read, b.tied, held)
    b.called = {k: s for k, s in job.shardings.items() if k not in b.uncalled}
    b.dtensor_outputs = dtensor_positions(gm, b.calls, b.called)


def _agree(b: Build) -> None:
    """Every rank holds the same plan, model and graph; rank 0's seed for initializing a
    meta-device model."""
    job = b.job
    draw = int(torch.randint(2 ** 62, (), device="cpu")) if job.meta else 0
    b.init_seed = check_same_on_every_rank(job.group, _device(None, job.group), job.shardings,
                                           job.model, b.gm, draw)


def _seed(b: Build) -> None:
    outlined = frozenset(b.job.blocks)
    b.ctx = b.ctx.but(shardings=b.outside, calls=b.calls, aliases=b.tied,
                      scope=lambda n: scope_of(n, outlined))
    seed(b.gm, b.ctx)


def _place(b: Build) -> None:
    """Placements propagated from the seeds, with the relayouts and trials that spare a
    gather (:mod:`fxtp.passes.place`); the fallbacks left."""
    gm = place(b.gm, b.ctx)
    b.fallbacks = gm.meta[FALLBACKS] + copied_fallbacks(gm, b.stamped)
    if b.job.options.strict and b.fallbacks:  # raises on the first
        propagate(gm, b.ctx.but(strict=True))
    b.unplanned = unplanned_sharded_outputs(gm, b.calls, b.called)
    b.dump.placements(gm)


def _rewrite(b: Build) -> None:
    rewrite(b.gm, b.ctx)
    b.dump.code("rewritten", b.gm)


def _localize(b: Build) -> None:
    """Local shapes, checked by running the program once on fake tensors."""
    b.copies = _copied_tensors(b.gm, b.stamped)
    localize(b.gm, b.ctx.but(copies=b.copies))
    rehearse(b.gm, b.ctx)


def _assemble(b: Build) -> None:
    """The per-rank module: tensors materialized or moved in, inputs guarded, modules and
    checkpoint regions outlined, parameters as DTensors, ``gm.fxtp`` (:class:`ParallelInfo`)
    filled in."""
    job, gm, options = b.job, b.gm, b.job.options
    attrs = [n for n in gm.graph.nodes if n.op == "get_attr" and PLACEMENT in n.meta]
    b.placements = {n.target: n.meta[PLACEMENT] for n in attrs}
    b.shapes = {n.target: tuple(n.meta["val"].shape) for n in attrs}
    b.placements.update({t: b.placements[like] for t, like in b.copies.items()})
    b.shapes.update({t: b.shapes[like] for t, like in b.copies.items()})
    b.held_whole = {n.target: n.meta[HELD_WHOLE] for n in attrs if HELD_WHOLE in n.meta}
    b.held_whole.update({t: b.held_whole[like] for t, like in b.copies.items()
                         if like in b.held_whole})
    device_mesh = job.group.device_mesh(job.device.type)
    if job.meta:  # on the meta device: shapes only, for init_weights after to_empty
        materialize(gm, job.model, job.meta, b.placements, job.group, device_mesh, job.device,
                    options.init_fn, b.init_seed)
    guard_inputs(gm, job.group.world)
    ctx = b.ctx.but(outline=(*job.shardings, *job.blocks), stamped=b.stamped)
    if gm.meta[REGION]:
        copy_written_collectives(gm, ctx)
    inlined = outline_modules(gm, ctx).meta[INLINED]
    if options.dtensor_params:
        as_dtensors(gm, b.placements, b.shapes, device_mesh, job.group.world)
    recomputed: set[int] = set()  # modules a region of their caller recomputes whole
    for module in [m for m in gm.modules() if isinstance(m, fx.GraphModule)]:
        if id(module) not in recomputed:
            for called in outline_checkpoints(module, ctx).meta[RECOMPUTED]:
                recomputed.update(id(m) for m in called.modules())
    for pass_ in (generate_code, stamp_modules, copy_data_attributes,
                  give_parameter_properties):
        pass_(gm, ctx)
    b.dump.code("localized", gm)
    gm.fxtp = _info(b, device_mesh, inlined)
    keep_on_copy(gm, "fxtp")
    for module in gm.modules():  # fx's copy registers every buffer its graph reads persistent
        if isinstance(module, fx.GraphModule) and module._non_persistent_buffers_set:
            keep_on_copy(module, "_non_persistent_buffers_set")
    b.dump.report(gm)


def _attach_run_time(gm: fx.GraphModule, job: Job) -> None:
    """What runs around the program on every call: the other mode's program on demand,
    guards on casts and arguments, modes restored on errors, the ranks' agreement until a
    first call succeeds, DTensor outputs, and parameter reads that follow the parameters."""
    options = job.options
    try:
        shadow, unbuildable = meta_copy(job.model), ""
    except Exception as e:  # noqa: BLE001 - said when the other mode is asked for
        shadow, unbuildable = None, f"copying the model failed ({type(e).__name__}: {e})"

    # the same options, shapes only: its shards come from this program's (fxtp.runtime.modes)
    same = {**vars(options), "device": "meta", "init_fn": None, "dump_dir": None}

    def other_mode(training: bool) -> fx.GraphModule:
        with torch.random.fork_rng(devices=[]):  # a meta model's init seed draws one number
            return parallelize(shadow.train(training), job.plan, job.mesh, **same)
    keep_programs(gm, job.model.training, other_mode if shadow is not None else None,
                  unbuildable)
    guard_casts(gm, options.param_dtype)
    guard_arguments(gm, job.model)
    restore_modes_on_error(gm)
    agree_until_first_success(gm, job.group)
    hand_out_dtensors(gm)
    follow_parameters(gm)


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off: tracing and the passes make many small
    objects that live until they end, which its full collections would walk again and
    again (about a tenth of the time at 126 layers)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _outside(shardings: dict, stamped: dict) -> dict:
    """The plan's modules that are not inside a stamped block (whose modules have no call
    of their own: their reference's is planned alike)."""
    inner = tuple(f + "." for f in stamped)
    return {k: s for k, s in shardings.items() if not (k + ".").startswith(inner)}


def _uncalled(shardings: dict, calls: dict, strict: bool, read: set, tied: dict,
              held: set) -> dict[str, str]:
    """The plan's modules that ``forward`` did not call (an embedding, where the model was
    traced with ``inputs_embeds``), each with what it means: the program never reads their
    parameters, held as their styles split them. Under ``strict``, a :class:`PlanError`.
    A module whose parameters the program reads without calling it (Mamba's
    ``dt_proj.weight @ x``) is not one: its parameters are placed as its style says and
    read so; nor is one whose split parameters are all tied to modules forward calls
    (BART's ``shared`` embedding, called as ``encoder.embed_tokens``). ``read``: the tensors
    the program reads, by FQN (tied ones left out: the reader may be the module sharing
    it); ``tied``: parameter FQN -> every FQN of the same tensor; ``held``: the model's
    parameter FQNs."""
    found = {fqn: f"module '{fqn}' is named by the plan but forward did not call it while "
                  f"tracing (a model traced with inputs_embeds does not call its input "
                  f"embedding): the program never reads its parameters, which each rank "
                  f"holds as its style splits them. Leave it out of the plan, or trace the "
                  f"call that uses it"
             for fqn, sharding in shardings.items() if fqn and not calls_of(calls, fqn) and
             not any(t.startswith(fqn + ".") for t in read) and
             not _called_as_another(fqn, sharding, calls, tied, held)}
    if strict and found:
        raise PlanError(next(iter(found.values())) + " (strict=True)")
    return found


def _called_as_another(fqn: str, sharding, calls: dict, tied: dict, held: set) -> bool:
    """Is every parameter ``sharding`` splits (of those the module has: an embedding has no
    bias) also another module's, one forward calls?"""
    names = [f"{fqn}.{name}" for name in sharding.params if f"{fqn}.{name}" in held]
    return bool(names) and all(
        any(calls_of(calls, other.rpartition(".")[0]) for other in tied.get(name, ())
            if other != name) for name in names)


def _copied_tensors(gm: fx.GraphModule, stamped: dict) -> dict[str, str]:
    """A stamped block's tensor -> the one its reference's nodes read at the same path."""
    names = {*dict(gm.named_parameters(remove_duplicate=False)),
             *dict(gm.named_buffers(remove_duplicate=False))}
    read = [n.target for n in gm.graph.nodes if n.op == "get_attr" and PLACEMENT in n.meta]
    return {fqn + t[len(ref):]: t for fqn, ref in stamped.items() for t in read
            if t.startswith(ref + ".") and fqn + t[len(ref):] in names}


def _info(b: Build, device_mesh: DeviceMesh, inlined) -> ParallelInfo:
    """``gm.fxtp``: what the attempt that made the program found and did."""
    job, gm = b.job, b.gm
    outputs = next(iter(reversed(gm.graph.nodes))).args[0]
    params = dict(gm.named_parameters(remove_duplicate=False))
    for fqn, p in params.items():  # unread: held whole
        b.placements.setdefault(fqn, Replicate())
        b.shapes.setdefault(fqn, tuple(p.shape))
    return ParallelInfo(
        plan={k: s.style for k, s in job.shardings.items()}, group=job.group.name,
        rank=job.group.rank, world_size=job.group.world, fallbacks=b.fallbacks,
        output_placements=tuple(getattr(o, "meta", {}).get(PLACEMENT) for o in outputs),
        param_placements=b.placements, param_shapes=b.shapes, mesh=device_mesh,
        held_whole={fqn: b.held_whole[fqn] for fqn in params if fqn in b.held_whole},
        state_keys=tuple(job.model.state_dict(keep_vars=True)), inlined=tuple(inlined),
        dtensor_outputs=b.dtensor_outputs, unplanned_outputs=b.unplanned,
        uncalled=b.uncalled)


def _recast(model: nn.Module, dtype: Optional[torch.dtype]) -> dict[str, torch.Tensor]:
    """Meta stand-ins of ``dtype`` for the model's floating parameters (none if ``None``)."""
    made: dict[int, nn.Parameter] = {}  # ties stay ties
    for fqn, p in model.named_parameters(remove_duplicate=False):
        if dtype is not None and p.is_floating_point() and p.dtype != dtype and id(p) not in made:
            made[id(p)] = nn.Parameter(torch.empty_like(p, device="meta", dtype=dtype),
                                       p.requires_grad)
    return {fqn: made[id(p)] for fqn, p in model.named_parameters(remove_duplicate=False)
            if id(p) in made}


def _cast(inputs: Sequence, dtype: Optional[torch.dtype]) -> tuple:
    return tuple(x.to(dtype) if dtype is not None and isinstance(x, torch.Tensor) and
                 x.is_floating_point() else x for x in inputs)


def _device(device, group, model=None) -> torch.device:
    """Where the result's parameters live: ``device``, else the model's own (non-meta)
    tensors' device, else the group's."""
    if device is not None:
        return torch.device(device)
    for t in () if model is None else itertools.chain(model.parameters(), model.buffers()):
        if not t.is_meta:
            return t.device
    if group.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(group.device_type)

