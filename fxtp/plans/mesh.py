"""Resolve the ``mesh`` argument to the process group fxtp's collectives run on."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..passes.errors import PlanError


@dataclass(frozen=True)
class Group:
    """A 1-D tensor-parallel group: its registered name, this rank's index, its size."""

    name: str
    rank: int
    world: int
    pg: Optional[dist.ProcessGroup] = field(default=None, compare=False, repr=False)
    given_mesh: Optional[DeviceMesh] = field(default=None, compare=False, repr=False)

    @property
    def device_type(self) -> str:
        """The device type the group's backend communicates on: ``cuda`` for NCCL."""
        if self.given_mesh is not None:
            return self.given_mesh.device_type
        return "cuda" if "nccl" in str(dist.get_backend(self.pg)) else "cpu"

    def device_mesh(self, device_type: Optional[str] = None) -> DeviceMesh:
        """The 1-D ``DeviceMesh`` over the group on ``device_type`` (default: the group's),
        which the parameters' DTensors live on. A given mesh must be on the parameters'
        device type: a DTensor moves its local tensor to its mesh's device."""
        device_type = device_type if device_type not in (None, "meta") else self.device_type
        if self.given_mesh is None:
            return DeviceMesh.from_group(self.pg, device_type)
        if self.given_mesh.device_type != device_type:
            raise PlanError(
                f"the mesh is a {self.given_mesh.device_type!r} DeviceMesh but the model's "
                f"parameters are on {device_type!r}: build the mesh on the parameters' device "
                f"(init_device_mesh({device_type!r}, ...)) or move the model there first")
        return self.given_mesh


def resolve_group(mesh: Union[DeviceMesh, dist.ProcessGroup, None]) -> Group:
    if not dist.is_initialized():
        raise PlanError("fxtp needs an initialized process group: call "
                        "torch.distributed.init_process_group() first (or run under torchrun)")
    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != 1:
            names = mesh.mesh_dim_names or ()
            hint = f'mesh["{names[-1]}"]' if names else "a 1-D slice such as mesh['tp']"
            raise PlanError(f"fxtp shards over a 1-D mesh; got a {mesh.ndim}-D DeviceMesh "
                            f"{tuple(mesh.shape)}. Pass the tensor-parallel dim: {hint}")
        pg: Optional[dist.ProcessGroup] = mesh.get_group()
        given = mesh
    elif mesh is None or isinstance(mesh, dist.ProcessGroup):
        pg, given = mesh or dist.group.WORLD, None
    else:
        raise PlanError(f"mesh must be a 1-D DeviceMesh, a ProcessGroup or None, got "
                        f"{type(mesh).__name__}")
    return Group(pg.group_name, dist.get_rank(pg), dist.get_world_size(pg), pg, given)
