"""``parallelize``: trace -> seed -> propagate -> strided (re-propagate) -> rewrite ->
localize, each stage's result optionally dumped to files (:mod:`fxtp.dump`)."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch.fx as fx
import torch.nn as nn

from passes.localize import localize
from passes.meta import PLACEMENT
from passes.propagate import propagate
from passes.rewrite import rewrite
from passes.seed import seed
from passes.strided import stride_fused_splits

from .dump import Dumper
from .mesh import resolve_group
from .plan import Plan, resolve_plan
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


def parallelize(model: nn.Module, plan: Plan, mesh=None, *, example_inputs: Sequence,
                example_kwargs: Optional[dict] = None, dynamic_shapes=None,
                strict: bool = False, dump_dir: Optional[str] = None) -> fx.GraphModule:
    """Return this rank's tensor-parallel ``GraphModule`` for ``model`` under ``plan``.

    ``example_inputs`` / ``example_kwargs`` are full (single-device) inputs used for
    tracing. At run time every rank passes the same full inputs, except root inputs whose
    plan layout is ``Shard``: those are passed as local shards. Outputs come back
    replicated, or as local shards where the plan leaves them sharded. Parameters keep
    their FQNs and hold local shards. ``model`` is not modified.

    ``dynamic_shapes`` (``torch.export``'s format, e.g. ``{"x": {0: Dim("batch"),
    1: Dim("seq")}}``) marks dims that may change between calls: the result then serves
    every size without retracing.

    ``dump_dir`` (or the environment variable ``FXTP_DUMP_DIR``) writes every stage's
    result, :func:`fxtp.explain`'s report and an HTML view there (:mod:`fxtp.dump`).
    """
    shardings = resolve_plan(model, plan)
    group = resolve_group(mesh)
    with Dumper(dump_dir, group) as dump:
        gm, calls = trace(model, tuple(example_inputs), example_kwargs, shardings,
                          dynamic_shapes)
        dump.code("traced", gm)
        seed(gm, shardings, calls, group.world, _tied_names(model))
        fallbacks = propagate(gm, group.world, strict=strict)
        if stride_fused_splits(gm, group.world):
            fallbacks = propagate(gm, group.world, strict=strict)
        dump.placements(gm)
        for message in fallbacks:
            warnings.warn("fxtp: " + message, stacklevel=2)
        rewrite(gm, group.name, group.rank, group.world)
        dump.code("rewritten", gm)
        localize(gm, group)
        dump.code("localized", gm)
        gm.fxtp = _info(gm, shardings, group, fallbacks)
        dump.report(gm)
    return gm


def _info(gm: fx.GraphModule, shardings: dict, group, fallbacks: list[str]) -> ParallelInfo:
    outputs = next(iter(reversed(gm.graph.nodes))).args[0]
    return ParallelInfo({k: s.style for k, s in shardings.items()}, group.name, group.rank,
                        group.world, fallbacks,
                        tuple(getattr(o, "meta", {}).get(PLACEMENT) for o in outputs),
                        {n.target: n.meta[PLACEMENT] for n in gm.graph.nodes
                         if n.op == "get_attr"})

def _tied_names(model: nn.Module) -> dict[str, list[str]]:
    """Parameter FQN -> all FQNs of that tensor, for tensors registered under several."""
    names: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(fqn)
    return {fqn: group for group in names.values() if len(group) > 1 for fqn in group}
