"""The result's outputs as ``DTensor`` s where the plan's style asks for them.

torch's styles hand a module's outputs on as ``DTensor`` s when built with
``use_local_output=False`` (``SequenceParallel``'s default; torchtitan's head under loss
parallel, whose sharded logits torch's ``loss_parallel()`` then takes). A root output that
is such a module's output comes back from the result the same way: this rank's local
tensor wrapped in a ``DTensor`` of its placement on the plan's mesh, which
``loss_parallel()``, ``full_tensor()`` and DTensor's ops read as the global value. Its
gradient comes back into the program as the local gradient. Every other output is a plain
local tensor (replicated, or this rank's shard).
"""
from __future__ import annotations

import warnings

import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..kernels.torch_compat import pytree
from ..passes.graph import calls_of
from ..plans.styles import returns_dtensors


def dtensor_positions(gm: fx.GraphModule, calls: dict, shardings: dict) -> tuple[int, ...]:
    """Positions among the traced root's flat outputs of the values that are a planned
    module's outputs handed on as DTensors by its style (read before any pass rewrites
    the graph's outputs)."""
    handed_on = {node for fqn, sharding in shardings.items()
                 if returns_dtensors(sharding.style) for call in calls_of(calls, fqn)
                 for node in call.outputs if node is not None}
    outputs = next(iter(reversed(gm.graph.nodes))).args[0]
    return tuple(i for i, node in enumerate(outputs) if node in handed_on)


def hand_out_dtensors(gm: nn.Module) -> None:
    """Have ``gm`` return its outputs at ``gm.fxtp.dtensor_outputs`` as DTensors of the
    placements ``gm.fxtp.output_placements`` gives them; one whose layout DTensor cannot
    describe (whole heads dealt unevenly, unequal blocks) stays local, with a warning, and
    leaves ``dtensor_outputs``."""
    info = gm.fxtp
    placements = {i: info.output_placements[i] for i in info.dtensor_outputs}
    kept = {i: p for i, p in placements.items() if type(p) in (Shard, Replicate)}
    for i in placements.keys() - kept.keys():
        warnings.warn(f"fxtp: output {i} is laid out {placements[i]}, which a DTensor cannot "
                      f"describe; it is returned as this rank's local tensor although its "
                      f"style has use_local_output=False", stacklevel=3)
    info.dtensor_outputs = tuple(sorted(kept))
    if kept:
        gm.register_forward_hook(_as_dtensors)


def _as_dtensors(gm: nn.Module, args, output):
    info = gm.fxtp
    leaves, spec = pytree.tree_flatten(output)
    for i in info.dtensor_outputs:
        leaves[i] = DTensor.from_local(leaves[i], info.mesh, (info.output_placements[i],),
                                       run_check=False)
    return pytree.tree_unflatten(leaves, spec)
