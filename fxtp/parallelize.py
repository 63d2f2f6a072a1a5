"""``parallelize``: trace -> (same on every rank?) -> seed -> propagate -> strided, heads
dealt whole (re-propagate) -> rewrite -> localize -> (materialize meta tensors) -> guard inputs ->
checkpoint regions, each stage's result optionally dumped to files (:mod:`fxtp.dump`)."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .passes.localize import localize
from .passes.graph import PLACEMENT
from .passes.propagate import propagate
from .passes.recompute import REGION, outline_checkpoints
from .passes.rewrite import rewrite
from .passes.seed import seed
from .passes.strided import stride_fused_splits
from .passes.units import deal_consumers, deal_sources

from .dump import Dumper
from .passes.errors import PlanError
from .guards import check_fresh, check_same_on_every_rank, guard_inputs
from .materialize import fake_tensors, materialize, meta_tensors, swapped
from .mesh import resolve_group
from .plan import Plan, module_fqns, resolve_plan, tied_names
from .trace import trace


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


def info_of(gm: nn.Module) -> ParallelInfo:
    """``gm.fxtp``, or a :class:`PlanError` for a module parallelize did not return."""
    info = getattr(gm, "fxtp", None)
    if not isinstance(info, ParallelInfo):
        raise PlanError(f"expected the result of fxtp.parallelize, got a "
                        f"{type(gm).__name__} without gm.fxtp")
    return info


def parallelize(model: nn.Module, plan: Plan, mesh=None, *, example_inputs: Sequence,
                example_kwargs: Optional[dict] = None, dynamic_shapes=None,
                strict: bool = False, init_fn: Optional[Callable[[nn.Module], None]] = None,
                device: Union[str, torch.device, None] = None,
                dump_dir: Optional[str] = None,
                checkpoint: Sequence[str] = ()) -> fx.GraphModule:
    """Return this rank's tensor-parallel ``GraphModule`` for ``model`` under ``plan``: a
    style, a dict of FQN patterns to styles (or Hugging Face plan strings), or ``"auto"``
    (a Hugging Face model's own plan, :mod:`fxtp.hf_plans`).

    ``example_inputs`` / ``example_kwargs`` are full (single-device) inputs used for
    tracing. At run time every rank passes the same full inputs, except root inputs whose
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
    the meta device (shapes only: plan checks, :mod:`fxtp.cli`).

    ``dump_dir`` (or the environment variable ``FXTP_DUMP_DIR``) writes every stage's
    result, :func:`fxtp.explain`'s report and an HTML view there (:mod:`fxtp.dump`).

    Activation checkpointing: the model's own non-reentrant ``torch.utils.checkpoint``
    regions are kept (:mod:`fxtp.passes.recompute`), and ``checkpoint`` names modules (plan
    key patterns, e.g. ``["layers.*"]``) whose every call is checkpointed as if wrapped,
    without editing the model.
    """
    check_fresh(model)
    shardings = resolve_plan(model, plan, strict)
    checkpointed = module_fqns(model, checkpoint, "checkpoint pattern")
    group = resolve_group(mesh)
    device = _device(device, group)
    meta = meta_tensors(model)
    with Dumper(dump_dir, group) as dump:
        with swapped(model, fake_tensors(meta, device)):
            gm, calls = trace(model, tuple(example_inputs), example_kwargs, shardings,
                              dynamic_shapes, checkpointed)
        dump.code("traced", gm)
        draw = int(torch.randint(2 ** 62, (), device="cpu")) if meta else 0  # init seed
        init_seed = check_same_on_every_rank(group, _device(None, group), shardings, model,
                                             gm, draw)
        seed(gm, shardings, calls, group.world, tied_names(model))
        fallbacks = propagate(gm, group.world)
        # layouts that serve what would be gathered: fused projections strided, heads that
        # do not divide by the world size dealt whole (and their consumers alike)
        for relayout in (stride_fused_splits, deal_sources, deal_consumers):
            if relayout(gm, group.world):
                fallbacks = propagate(gm, group.world)
        if strict and fallbacks:  # raises on the first
            propagate(gm, group.world, strict=True)
        dump.placements(gm)
        for message in fallbacks:
            warnings.warn("fxtp: " + message, stacklevel=2)
        rewrite(gm, group.name, group.rank, group.world)
        dump.code("rewritten", gm)
        localize(gm, group)
        attrs = [n for n in gm.graph.nodes if n.op == "get_attr" and PLACEMENT in n.meta]
        placements = {n.target: n.meta[PLACEMENT] for n in attrs}
        shapes = {n.target: tuple(n.meta["val"].shape) for n in attrs}
        device_mesh = group.device_mesh()
        if meta and device.type != "meta":
            materialize(gm, model, meta, placements, group, device_mesh, device, init_fn,
                        init_seed)
        guard_inputs(gm, group.world)
        outline_checkpoints(gm, gm.meta[REGION])
        dump.code("localized", gm)
        gm.fxtp = _info(gm, model, shardings, group, fallbacks, placements, shapes,
                        device_mesh)
        dump.report(gm)
    return gm


def _info(gm, model, shardings, group, fallbacks, placements, shapes, device_mesh
          ) -> ParallelInfo:
    outputs = next(iter(reversed(gm.graph.nodes))).args[0]
    return ParallelInfo({k: s.style for k, s in shardings.items()}, group.name, group.rank,
                        group.world, fallbacks,
                        tuple(getattr(o, "meta", {}).get(PLACEMENT) for o in outputs),
                        placements, shapes, device_mesh,
                        tuple(model.state_dict(keep_vars=True)))


def _device(device, group) -> torch.device:
    if device is not None:
        return torch.device(device)
    if group.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(group.device_type)

