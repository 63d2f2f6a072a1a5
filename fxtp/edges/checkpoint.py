"""Checkpoints of an fxtp module, under the single-device model's state-dict keys.

* :func:`state_dict`: ``DTensor`` s on the module's mesh, for
  ``torch.distributed.checkpoint`` (DCP), which saves them once and loads them back at any
  world size, or into the single-device model. They share memory with the module's
  tensors, except a fused projection's ``_StridedShard`` weight, which DCP cannot describe
  as one chunk per rank: it is handed out re-laid as ``Shard(d)`` (an all-gather), and
  :func:`load_state_dict` lays it back. ``dcp.load`` into the dict, then
  ``load_state_dict`` copies whatever did not load in place.
* :func:`full_state_dict` / :func:`load_full_state_dict`: plain full tensors on every rank
  (one all-gather per sharded tensor to save, none to load), for ``torch.save`` and
  ``model.load_state_dict``.
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Replicate

from ..frontend.names import named_tensors
from ..passes.errors import PlanError
from ..passes.placement import local_part
from .dtensor_params import (checkpoint_view, full_tensor, local_shard, tp_shard,
                             write_tp_shard)
from .info import info_of


def _entries(gm: fx.GraphModule):
    """``(key, tensor, placement, global shape)`` for each state-dict key: every parameter
    and buffer of ``gm`` under all its model FQNs (compiled or checkpoint-wrapped blocks
    too; a tied tensor under each name, one object), as the module holds it (a
    ``DTensor`` parameter, FSDP2's where data parallelism sharded it further)."""
    info, tensors = info_of(gm), dict(named_tensors(gm))
    placed = {id(tensors[fqn]): (p, info.param_shapes[fqn])
              for fqn, p in info.param_placements.items() if p}
    for key in info.state_keys:
        t = tensors[key]
        yield (key, t, *placed.get(id(t), (Replicate(), tuple(t.shape))))


@torch.no_grad()
def state_dict(gm: fx.GraphModule) -> dict[str, DTensor]:
    """The model's state as ``DTensor`` s on ``gm.fxtp.mesh`` (see the module docstring)."""
    info, out, made = info_of(gm), {}, {}
    for key, t, placement, shape in _entries(gm):
        if id(t) not in made:  # tied names share one DTensor
            made[id(t)] = checkpoint_view(tp_shard(t.detach(), info.mesh), placement,
                                          info.mesh, shape)
        out[key] = made[id(t)]
    return out


@torch.no_grad()
def load_state_dict(gm: fx.GraphModule, sd: Mapping[str, DTensor]) -> None:
    """Copy ``DTensor`` s (any placement on ``gm``'s mesh, e.g. those :func:`state_dict`
    returned, after ``dcp.load``) into ``gm``'s shards."""
    info = info_of(gm)

    def local(key, value, placement):
        if not isinstance(value, DTensor):
            raise PlanError(f"state_dict['{key}'] is a {type(value).__name__}, not a "
                            f"DTensor; use fxtp.load_full_state_dict for full tensors")
        return local_shard(value, placement, info.mesh)
    _load(gm, sd, local)


@torch.no_grad()
def full_state_dict(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """The model's state as full tensors, the same on every rank: what the single-device
    model's ``state_dict()`` would hold."""
    info, out, made = info_of(gm), {}, {}
    for key, t, placement, shape in _entries(gm):
        if id(t) not in made:
            made[id(t)] = full_tensor(tp_shard(t.detach(), info.mesh), placement, info.mesh,
                                      shape)
        out[key] = made[id(t)]
    return out


@torch.no_grad()
def load_full_state_dict(gm: fx.GraphModule, sd: Mapping[str, torch.Tensor]) -> None:
    """Load full tensors (a single-device model's ``state_dict()``) into ``gm``: each rank
    keeps its part. No communication."""
    info = info_of(gm)
    _load(gm, sd, lambda key, value, placement:
          local_part(value, placement, info.rank, info.world_size))


def _load(gm, sd: Mapping, local_of) -> None:
    """Copy ``local_of(key, sd[key], placement)`` into each of ``gm``'s tensors; every key
    must be present and no other."""
    info = info_of(gm)
    missing = [k for k in info.state_keys if k not in sd]
    unexpected = [k for k in sd if k not in info.state_keys]
    if missing or unexpected:
        raise PlanError(f"state dict keys differ from the model's: missing {missing}, "
                        f"unexpected {unexpected}")
    for key, t, placement, shape in _entries(gm):
        value = local_of(key, sd[key], placement)
        mine = local_part(torch.empty(shape, device="meta"), placement, info.rank,
                          info.world_size).shape
        if value.shape != mine:
            raise PlanError(f"state_dict['{key}'] gives this rank a {tuple(value.shape)} "
                            f"tensor; its shard is {tuple(mine)} (placement {placement})")
        write_tp_shard(t, info.mesh, value)
