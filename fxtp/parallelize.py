"""``parallelize``: trace -> (same on every rank?) -> seed -> propagate -> strided, heads
dealt whole (re-propagate) -> rewrite -> localize -> (materialize meta tensors) -> guard inputs ->
checkpoint regions, each stage's result optionally dumped to files (:mod:`fxtp.dump`)."""
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

from .passes.aliases import pin_written_aliases
from .passes.collectives import allow_in_dynamo_graphs
from .passes.decompose import (decompose_sharded_norms, decompose_sharded_unruled,
                               decompose_unruled)
from .passes.buffers import shard_written_buffers
from .passes.localize import localize
from .passes.modules import generate_code, outline_modules, scope_of, stamp_modules
from .passes.gather_early import gather_early
from .passes.graph import PLACEMENT, REGION, STAMPED, calls_of, keep_on_copy
from .passes.posing import copy_data_attributes, give_parameter_properties
from .passes.propagate import propagate
from .passes.rehearse import rehearse
from .passes.recompute import copy_written_collectives, outline_checkpoints
from .passes.rewrite import rewrite
from .passes.seed import seed
from .passes.strided import stride_fused_splits
from .passes.unfuse import unfuse_splits
from .passes.units import deal_consumers, deal_sources
from .passes.unpin import unpin_layouts
from .passes.unused import drop_unused

from .dump import Dumper
from .dtensor_outputs import dtensor_positions, hand_out_dtensors
from .dtensor_params import as_dtensors
from .local_reads import follow_parameters
from .passes.errors import InputError, PlanError, ShardingError, StampMismatch
from .guards import (check_fresh, check_same_on_every_rank, every_rank_or_none,
                     guard_arguments, guard_casts, guard_inputs)
from .materialize import fake_tensors, materialize, meta_tensors, swapped
from .mesh import resolve_group
from .first_call import agree_until_first_success
from .mode_regions import restore_modes_on_error
from .modes import keep_programs, meta_copy
from .plan import Plan, block_fqns, module_fqns, resolve_plan, tied_names
from .stamping import copied_fallbacks
from .trace import trace
from .unplanned_outputs import unplanned_sharded_outputs


@dataclass
class ParallelInfo:
    """What fxtp did, attached to the result as ``gm.fxtp``."""

    plan: dict
    group: str
    rank: int
    world_size: int
    fallbacks: list[str] = field(default_factory=list)
    output_placements: tuple = ()
    param_placements: dict = field(default_factory=dict)
    param_shapes: dict = field(default_factory=dict)  # FQN -> global shape
    mesh: Optional[DeviceMesh] = None
    state_keys: tuple = ()  # the model's state_dict() keys, in order
    inlined: tuple = ()  # FQNs of modules kept in their parent's graph, not as submodules
    dtensor_outputs: tuple = ()  # positions of the flat outputs returned as DTensors
    unplanned_outputs: list[str] = field(default_factory=list)  # sharded by no layout
    uncalled: dict = field(default_factory=dict)  # planned modules forward never called


def info_of(gm: nn.Module) -> ParallelInfo:
    """``gm.fxtp``, or a :class:`PlanError` for a module parallelize did not return."""
    info = getattr(gm, "fxtp", None)
    if not isinstance(info, ParallelInfo):
        raise PlanError(f"expected the result of fxtp.parallelize, got a "
                        f"{type(gm).__name__} without gm.fxtp")
    return info


def parallelize(model: nn.Module, plan: Plan, mesh=None, *, example_inputs: Sequence = (),
                example_kwargs: Optional[dict] = None, dynamic_shapes=None,
                strict: bool = False, init_fn: Optional[Callable[[nn.Module], None]] = None,
                device: Union[str, torch.device, None] = None,
                dump_dir: Optional[str] = None,
                checkpoint: Sequence[str] = (), modules: Sequence[str] = (),
                dtensor_params: bool = True, param_dtype: Optional[torch.dtype] = None,
                stamp_blocks: bool = True) -> fx.GraphModule:
    """Return this rank's tensor-parallel ``GraphModule`` for ``model`` under ``plan``: a
    style, a dict of FQN patterns to styles (or Hugging Face plan strings), or ``"auto"``
    (a Hugging Face model's own plan, :mod:`fxtp.hf_plans`).

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
    ``reset_parameters()`` (:mod:`fxtp.materialize`); with ``device="meta"`` they stay on
    the meta device: shapes only (plan checks, :mod:`fxtp.cli`), or to be sharded further
    by ``fully_shard`` before ``gm.to_empty(device=...)`` and :func:`fxtp.init_weights`
    allocate and initialize them (each rank then holds only its dp x tp share). The program
    is then traced for the group's device (``cuda`` for NCCL, ``cpu`` for gloo), which
    ``to_empty`` must allocate on.

    ``dump_dir`` (or the environment variable ``FXTP_DUMP_DIR``) writes every stage's
    result, :func:`fxtp.explain`'s report and an HTML view there (:mod:`fxtp.dump`).

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
    one's module holding its own shards (:mod:`fxtp.stamping`; where one's inputs arrive
    placed otherwise, copies of the first one's traced nodes analysed anew); ``False``
    traces every block (the same program, slower to get).

    ``dtensor_params``: parameters are ``DTensor`` s on the mesh (global shape, this rank's
    shard inside), so ``torch.nn.utils.clip_grad_norm_``, ``state_dict()`` with DCP and
    FSDP2 see the global model, while the program computes on plain local tensors and
    optimizers step them locally (:mod:`fxtp.local_reads`, :mod:`fxtp.local_steps`).
    ``False`` makes each parameter this rank's shard itself, a plain tensor: for code that
    differentiates with respect to the parameters (``torch.autograd.grad(loss,
    gm.parameters())``), which the reads do not pass through. torch's own tools then see
    one rank's shard (``fxtp.clip_grad_norm_`` and ``fxtp.state_dict`` still give global
    results).
    """
    if not example_inputs and not example_kwargs:
        raise InputError(f"parallelize({type(model).__name__}) traces the model on example "
                         "inputs: pass example_inputs=(...) and / or example_kwargs={...} "
                         "as the model is called")
    allow_in_dynamo_graphs()  # the result may be compiled: its collectives stay calls
    check_fresh(model)
    shardings = resolve_plan(model, plan, strict, lambda: resolve_group(mesh).device_mesh())
    checkpointed = module_fqns(model, checkpoint, "checkpoint pattern")
    repeated = block_fqns(model)
    blocks = [*repeated, *checkpointed, *module_fqns(model, modules, "modules pattern")]
    kept = [*shardings, *blocks]
    group = resolve_group(mesh)
    device = _device(device, group, model)
    meta = meta_tensors(model)
    recast = _recast(model, param_dtype)
    def passes(keep_stamps: bool) -> fx.GraphModule:
        with Dumper(dump_dir, group) as dump:
            # a trace records the devices its factory calls ask for (HF's position ids: the
            # embeddings' device): traced for the device the tensors will have, which for
            # shards kept on meta is the group's (where to_empty is expected to allocate them)
            runs_on = _device(None, group) if device.type == "meta" else device
            with every_rank_or_none(group, "tracing the model"):
                with swapped(model, fake_tensors({**meta, **recast}, runs_on)):
                    gm, calls = trace(model, _cast(example_inputs, param_dtype), example_kwargs,
                                      shardings, dynamic_shapes, checkpointed,
                                      repeated if stamp_blocks else (),
                                      {k: s.style for k, s in shardings.items()}, keep_stamps)
                boundaries = [n for c in calls.values()
                              for n in (*c.args, *c.kwargs.values(), *c.outputs)]
                if drop_unused(gm.graph, boundaries):
                    gm.recompile()
                decompose_unruled(gm)  # composite ops without a rule of their own
                for fqn in recast.keys() - meta.keys():  # the model's own, not the recast
                    owner, _, name = fqn.rpartition(".")
                    gm.get_submodule(owner)._parameters[name] = model.get_parameter(fqn)
                dump.code("traced", gm)
                stamped = gm.meta[STAMPED] if keep_stamps else {}
                outside = _outside(shardings, stamped)
                tied = tied_names(model)  # a tied weight read is no sign of its own module's
                read = {n.target for n in gm.graph.nodes if n.op == "get_attr" and n.users} - \
                    tied.keys()
                uncalled = _uncalled(outside, calls, strict, read)
                called = {k: s for k, s in shardings.items() if k not in uncalled}
                handed_on = dtensor_positions(gm, calls, called)
            draw = int(torch.randint(2 ** 62, (), device="cpu")) if meta else 0  # init seed
            init_seed = check_same_on_every_rank(group, _device(None, group), shardings,
                                                 model, gm, draw)
            with every_rank_or_none(group, "placing and rewriting the program"):
                seed(gm, outside, calls, group.world, tied)
                def place() -> list:
                    fallbacks = propagate(gm, group.world)
                    # layouts that serve what would be gathered: ops without a rule as torch
                    # decomposes them, fused projections strided, heads that do not divide by
                    # the world size dealt whole (and their consumers alike), buffers written
                    # in place (KV caches) placed as what is written into them, norms over
                    # sharded dims taken as partial sums, and values written through views
                    # that take them redistributed made whole
                    for relayout in (decompose_sharded_unruled, stride_fused_splits,
                                     deal_sources, deal_consumers, shard_written_buffers,
                                     decompose_sharded_norms, pin_written_aliases):
                        if relayout(gm, group.world):
                            fallbacks = propagate(gm, group.world)
                    return fallbacks
                fallbacks = place()
                # fused projections whose parts cannot be sharded together, part by part
                unfused = unfuse_splits(gm, group.world, place)
                fallbacks = fallbacks if unfused is None else unfused
                unpinned = unpin_layouts(gm, group.world, place)
                fallbacks = fallbacks if unpinned is None else unpinned
                gathered = gather_early(gm, group.world)  # last: propagation would undo it
                fallbacks = fallbacks if gathered is None else gathered
                fallbacks += copied_fallbacks(gm, stamped)
                if strict and fallbacks:  # raises on the first
                    propagate(gm, group.world, strict=True)
                unplanned = unplanned_sharded_outputs(gm, calls, called)
                dump.placements(gm)
                outlined = frozenset(blocks)
                rewrite(gm, group.name, group.rank, group.world, lambda n: scope_of(n, outlined))
                dump.code("rewritten", gm)
                copies = _copied_tensors(gm, stamped)
                localize(gm, group, copies)
                rehearse(gm, group)
            attrs = [n for n in gm.graph.nodes if n.op == "get_attr" and PLACEMENT in n.meta]
            placements = {n.target: n.meta[PLACEMENT] for n in attrs}
            shapes = {n.target: tuple(n.meta["val"].shape) for n in attrs}
            placements.update({t: placements[like] for t, like in copies.items()})
            shapes.update({t: shapes[like] for t, like in copies.items()})
            device_mesh = group.device_mesh(device.type)
            if meta:  # on the meta device: shapes only, for init_weights after to_empty
                materialize(gm, model, meta, placements, group, device_mesh, device, init_fn,
                            init_seed)
            guard_inputs(gm, group.world)
            if gm.meta[REGION]:
                copy_written_collectives(gm)
            inlined = outline_modules(gm, kept, model, stamped)
            if dtensor_params:
                as_dtensors(gm, placements, shapes, device_mesh, group.world)
            recomputed: set[int] = set()  # modules a region of their caller recomputes whole
            for module in [m for m in gm.modules() if isinstance(m, fx.GraphModule)]:
                if id(module) not in recomputed:
                    for called in outline_checkpoints(module, gm.meta[REGION]):
                        recomputed.update(id(m) for m in called.modules())
            generate_code(gm)
            stamp_modules(gm, stamped, model)
            copy_data_attributes(gm, model)
            give_parameter_properties(gm, model)
            dump.code("localized", gm)
            gm.fxtp = _info(gm, model, shardings, group, fallbacks, placements, shapes,
                            device_mesh)
            gm.fxtp.inlined = tuple(inlined)
            gm.fxtp.dtensor_outputs = handed_on
            gm.fxtp.unplanned_outputs = unplanned
            gm.fxtp.uncalled = uncalled
            keep_on_copy(gm, "fxtp")
            dump.report(gm)
        return gm

    gm = None
    with _collector_paused():
        if stamp_blocks:
            try:  # stamped blocks kept as one call each through the passes
                gm = passes(keep_stamps=True)
            except StampMismatch:  # one cannot run its reference's program: each is copied
                pass
            except ShardingError:  # placed each on its own, blocks traced in full may need
                pass  # no fallback (an unplanned patch embedding held sharded for block 0)
        gm = gm or passes(keep_stamps=False)
    for message in [*gm.fxtp.fallbacks, *gm.fxtp.unplanned_outputs, *gm.fxtp.uncalled.values()]:
        warnings.warn("fxtp: " + message, stacklevel=2)
    try:
        shadow, unbuildable = meta_copy(model), ""
    except Exception as e:  # noqa: BLE001 - said when the other mode is asked for
        shadow, unbuildable = None, f"copying the model failed ({type(e).__name__}: {e})"

    def other_mode(training: bool) -> fx.GraphModule:
        with torch.random.fork_rng(devices=[]):  # a meta model's init seed draws one number
            return parallelize(shadow.train(training), plan, mesh,
                               example_inputs=example_inputs, example_kwargs=example_kwargs,
                               dynamic_shapes=dynamic_shapes, strict=strict, device="meta",
                               checkpoint=checkpoint, modules=modules,
                               dtensor_params=dtensor_params, param_dtype=param_dtype,
                               stamp_blocks=stamp_blocks)
    keep_programs(gm, model.training, other_mode if shadow is not None else None, unbuildable)
    guard_casts(gm, param_dtype)
    guard_arguments(gm, model)
    restore_modes_on_error(gm)
    agree_until_first_success(gm, group)
    hand_out_dtensors(gm)
    follow_parameters(gm)
    return gm


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


def _uncalled(shardings: dict, calls: dict, strict: bool, read: set) -> dict[str, str]:
    """The plan's modules that ``forward`` did not call (an embedding, where the model was
    traced with ``inputs_embeds``), each with what it means: the program never reads their
    parameters, held as their styles split them. Under ``strict``, a :class:`PlanError`.
    A module whose parameters the program reads without calling it (Mamba's
    ``dt_proj.weight @ x``) is not one: its parameters are placed as its style says and
    read so. ``read``: the tensors the program reads, by FQN (tied ones left out: the
    reader may be the module sharing it)."""
    found = {fqn: f"module '{fqn}' is named by the plan but forward did not call it while "
                  f"tracing (a model traced with inputs_embeds does not call its input "
                  f"embedding): the program never reads its parameters, which each rank "
                  f"holds as its style splits them. Leave it out of the plan, or trace the "
                  f"call that uses it"
             for fqn in shardings if fqn and not calls_of(calls, fqn) and
             not any(t.startswith(fqn + ".") for t in read)}
    if strict and found:
        raise PlanError(next(iter(found.values())) + " (strict=True)")
    return found


def _copied_tensors(gm: fx.GraphModule, stamped: dict) -> dict[str, str]:
    """A stamped block's tensor -> the one its reference's nodes read at the same path."""
    names = {*dict(gm.named_parameters(remove_duplicate=False)),
             *dict(gm.named_buffers(remove_duplicate=False))}
    read = [n.target for n in gm.graph.nodes if n.op == "get_attr" and PLACEMENT in n.meta]
    return {fqn + t[len(ref):]: t for fqn, ref in stamped.items() for t in read
            if t.startswith(ref + ".") and fqn + t[len(ref):] in names}


def _info(gm, model, shardings, group, fallbacks, placements, shapes, device_mesh
          ) -> ParallelInfo:
    outputs = next(iter(reversed(gm.graph.nodes))).args[0]
    for fqn, p in gm.named_parameters(remove_duplicate=False):  # unread: held whole
        placements.setdefault(fqn, Replicate())
        shapes.setdefault(fqn, tuple(p.shape))
    return ParallelInfo({k: s.style for k, s in shardings.items()}, group.name, group.rank,
                        group.world, fallbacks,
                        tuple(getattr(o, "meta", {}).get(PLACEMENT) for o in outputs),
                        placements, shapes, device_mesh,
                        tuple(model.state_dict(keep_vars=True)))


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

