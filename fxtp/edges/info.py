"""``gm.fxtp``: what fxtp did to a model, as the edges and the user read it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..passes.errors import PlanError


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
    held_whole: dict = field(default_factory=dict)  # FQN -> why the plan's shard is not held
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
