"""Parameters as ``DTensor`` s on the tensor-parallel mesh; the graph computes on their local
tensors.

After the passes each parameter of the result holds this rank's shard. :func:`as_dtensors`
wraps every one in a ``DTensor`` of its global shape and placement, and has the graph read
it through :func:`local_tensor` (``to_local``, whose backward hands the local gradient back
as a ``DTensor`` of the same placement; eagerly a leaner one that wraps the gradient in the
parameter's own spec). So the ecosystem's own tools see the global
tensors: ``torch.nn.utils.clip_grad_norm_`` reduces sharded norms across ranks, DCP saves
each shard once under the model's keys, FSDP2 shards the TP shards further on a 2-D mesh.
Sharded buffers (a KV cache written with sharded heads) stay plain local tensors for the
graph and are handed out by ``state_dict()`` as ``DTensor`` s, too.

Layouts DTensor cannot describe as one chunk per rank are handed out re-laid by
``state_dict()`` (and laid back by ``load_state_dict()``, which also accepts full tensors
and DTensors of any placement): a fused projection's ``_StridedShard`` weight as
``Shard(d)`` (an all-gather); a weight dealt in whole heads (``UnitShard``, uneven) or cut
in unequal blocks (``BlockShard``: gpt-fast's grouped-query ``wqkv``), which DTensor
cannot describe at all and which stays a plain local tensor, as ``Replicate()`` (an
all-gather).
``torch.nn.utils.clip_grad_norm_`` refuses such a mix of DTensors and plain tensors;
``fxtp.clip_grad_norm_`` takes it.
"""
from __future__ import annotations

import copy

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_global_tensor_info
from torch.distributed.tensor.placement_types import _StridedShard

from .passes.collectives import _all_gather, _gather_units
from .passes.graph import attr, keep_on_copy, recompile_alone
from .passes.placement import (BlockShard, UnitShard, dtensor_placement, is_sharded, is_whole,
                               local_part)


def local_tensor(p):
    """What the graph computes with: a ``DTensor`` parameter's local tensor (differentiable)."""
    if not isinstance(p, DTensor):
        return p
    return p.to_local() if torch.compiler.is_compiling() else _LocalTensor.apply(p)


class _LocalTensor(torch.autograd.Function):
    """``DTensor.to_local`` for a parameter, cheaper backward: a gradient laid out like the
    local tensor becomes a ``DTensor`` of the parameter's own spec directly, where
    ``to_local``'s backward re-derives the spec and goes through ``from_local`` (about
    100 us a parameter a step, most of fxtp's per-parameter cost in eager training). Any
    other gradient, or one that needs a graph of its own (double backward), takes
    ``from_local``'s way."""

    @staticmethod
    def forward(ctx, p):
        ctx.spec, ctx.local_stride = p._spec, p._local_tensor.stride()
        ctx.set_materialize_grads(False)
        return p._local_tensor.view_as(p._local_tensor)

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None
        spec = ctx.spec
        if grad.stride() == ctx.local_stride and not grad.requires_grad:
            return DTensor(grad, copy.copy(spec), requires_grad=False)
        _, stride = compute_global_tensor_info(grad, spec.mesh, spec.placements)
        return DTensor.from_local(grad, spec.mesh, spec.placements, run_check=False,
                                  shape=spec.shape, stride=tuple(stride))


def as_dtensors(gm: fx.GraphModule, placements: dict, shapes: dict, mesh, world: int) -> None:
    """Replace each parameter of ``gm`` (FQN in ``placements``, global shape in ``shapes``)
    by a ``DTensor`` parameter sharing its local tensor, read through :func:`local_tensor`
    by every graph of ``gm``'s module tree."""
    made: dict[int, nn.Parameter] = {}
    plain: dict[int, tuple] = {}  # id(local) -> (placement, global shape, mesh)
    for fqn, local in list(gm.named_parameters(remove_duplicate=False)):
        placement, shape = placements.get(fqn) or Replicate(), shapes.get(fqn, local.shape)
        if _undescribable(placement, shape, world):
            plain[id(local)] = (placement, torch.Size(shape), mesh)
            continue
        if id(local) not in made:
            made[id(local)] = nn.Parameter(_wrap(local.detach(), placement, mesh, shape),
                                           requires_grad=local.requires_grad)
        owner, _, name = fqn.rpartition(".")
        gm.get_submodule(owner)._parameters[name] = made[id(local)]
    sharded_buffers = {fqn: (placements[fqn], torch.Size(shapes[fqn]), mesh)
                       for fqn, _ in gm.named_buffers(remove_duplicate=False)
                       if is_sharded(placements.get(fqn))}
    for owner_fqn, module in gm.named_modules(remove_duplicate=False):
        if isinstance(module, fx.GraphModule):
            _read_locally(module)
        if module._parameters or module._buffers:
            module._fxtp_plain = {name: plain[id(p)] for name, p in module._parameters.items()
                                  if id(p) in plain}
            prefix = owner_fqn + "." if owner_fqn else ""
            module._fxtp_buffers = {name: sharded_buffers[prefix + name]
                                    for name in module._buffers
                                    if prefix + name in sharded_buffers}
            if isinstance(module, fx.GraphModule):
                for name in ("_fxtp_plain", "_fxtp_buffers"):
                    keep_on_copy(module, name)
            module._register_state_dict_hook(_relay_for_checkpoint)
            module._register_load_state_dict_pre_hook(_lay_back, with_module=True)


def _undescribable(placement, shape, world: int) -> bool:
    """A layout DTensor has no placement for: whole heads dealt unevenly or to groups of
    ranks, unequal blocks."""
    return is_sharded(placement) and not is_whole(placement) and \
        dtensor_placement(placement, shape[placement.dim], world) is None


def _wrap(local: torch.Tensor, placement, mesh, shape) -> DTensor:
    if isinstance(placement, UnitShard):
        placement = Replicate() if is_whole(placement) else Shard(placement.dim)
    return DTensor.from_local(local, mesh, [placement], run_check=False,
                              shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def global_view(local: torch.Tensor, placement, mesh, shape) -> DTensor:
    """This rank's ``local`` tensor (of global ``shape``, laid out as ``placement``) as a
    ``DTensor``; a layout DTensor cannot describe (whole heads, unequal blocks) is gathered
    whole (``Replicate()``)."""
    if not _undescribable(placement, shape, mesh.size()):
        return _wrap(local, placement, mesh, shape)
    return DTensor.from_local(full_tensor(local, placement, mesh, shape), mesh, [Replicate()],
                              run_check=False)


def full_tensor(local: torch.Tensor, placement, mesh, shape) -> torch.Tensor:
    """The whole tensor of global ``shape`` whose ``placement`` part this rank holds as
    ``local``, the same on every rank. Blocks and units are gathered by fxtp's own
    collectives (torch 2.11's ``redistribute`` cannot read ``_StridedShard``)."""
    group, world = mesh.get_group().group_name, mesh.size()
    if isinstance(placement, (BlockShard, _StridedShard)):
        blocks = placement.blocks if isinstance(placement, BlockShard) else \
            placement.split_factor
        return _all_gather(local, placement.dim, world, group, blocks)
    if isinstance(placement, UnitShard) and not is_whole(placement):
        return _gather_units(local, placement.dim, placement.units, shape[placement.dim],
                             world, group)
    return _wrap(local, placement, mesh, shape).full_tensor()


def checkpoint_view(local: torch.Tensor, placement, mesh, shape) -> DTensor:
    """:func:`global_view` as checkpoints hold it, one chunk per rank: a fused projection's
    ``_StridedShard`` weight is re-laid as ``Shard(d)`` (an all-gather)."""
    if not isinstance(placement, _StridedShard):
        return global_view(local, placement, mesh, shape)
    full = full_tensor(local, placement, mesh, shape)
    return DTensor.from_local(full, mesh, [Replicate()], run_check=False).redistribute(
        mesh, [Shard(placement.dim)])


def local_shard(value: torch.Tensor, placement, mesh) -> torch.Tensor:
    """This rank's part, laid out as ``placement``, of ``value``: a full tensor, or a
    ``DTensor`` of any placement on ``mesh`` (redistributed, gathered whole only where
    DTensor cannot describe ``placement``)."""
    rank, world = mesh.get_local_rank(), mesh.size()
    if isinstance(value, DTensor):
        as_dtensor = (dtensor_placement(placement, value.shape[placement.dim], world)
                      if is_sharded(placement) else placement)
        # not to _StridedShard: torch 2.11's redistribute cannot take Shard there
        if as_dtensor is not None and not isinstance(as_dtensor, _StridedShard):
            return value.redistribute(mesh, [as_dtensor]).to_local()
        value = value.redistribute(mesh, [Replicate()]).to_local()
    return local_part(value, placement, rank, world)


def _read_locally(gm: fx.GraphModule) -> None:
    """Each ``DTensor`` read becomes a :func:`local_tensor` call, all of them at the top of
    the graph (outside checkpointed regions, which then take plain tensors)."""
    graph = gm.graph
    top = next(n for n in graph.nodes if n.op not in ("placeholder", "get_attr"))
    for node in list(graph.nodes):
        if node.op == "get_attr" and _holds_dtensor(gm, node.target):
            top.prepend(node)
            with graph.inserting_before(top):
                local = graph.call_function(local_tensor, (node,))
            local.meta = {k: v for k, v in node.meta.items() if k != "custom"}
            users = [u for u in node.users if u is not local]
            if users:  # reported in the module that reads it
                local.meta["nn_module_stack"] = dict(users[0].meta.get("nn_module_stack", {}))
            node.replace_all_uses_with(local, delete_user_cb=lambda u: u is not local)
    graph.lint()
    recompile_alone(gm)


def _holds_dtensor(gm: fx.GraphModule, target: str) -> bool:
    try:
        return isinstance(attr(gm, target), DTensor)
    except AttributeError:
        return False


def _on_tp_mesh(p) -> bool:
    """Is ``p`` as fxtp made it (not sharded further, by FSDP2 on a 2-D mesh)?"""
    return isinstance(p, DTensor) and p.device_mesh.ndim == 1


def _relay_for_checkpoint(module, state_dict, prefix, local_metadata):
    """Parameters and sharded buffers (a KV cache) as :func:`checkpoint_view` lays them
    out."""
    for name, (placement, shape, mesh) in module._fxtp_buffers.items():
        if prefix + name in state_dict:
            state_dict[prefix + name] = checkpoint_view(module._buffers[name].detach(),
                                                        placement, mesh, shape)
    for name, p in module._parameters.items():
        key = prefix + name
        if key not in state_dict:
            continue
        if name in module._fxtp_plain:
            placement, shape, mesh = module._fxtp_plain[name]
            state_dict[key] = checkpoint_view(p.detach(), placement, mesh, shape)
        elif _on_tp_mesh(p) and isinstance(p.placements[0], _StridedShard):
            state_dict[key] = checkpoint_view(p.detach().to_local(), p.placements[0],
                                              p.device_mesh, p.shape)
    return state_dict


@torch.no_grad()
def _lay_back(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    """Incoming values (a full tensor, a DTensor of any placement on the mesh) become what
    the parameter holds: a DTensor laid out as it is, or this rank's plain part; a sharded
    buffer takes this rank's part."""
    for name, (placement, _, mesh) in module._fxtp_buffers.items():
        value = state_dict.get(prefix + name)
        if value is not None:
            state_dict[prefix + name] = local_shard(value, placement, mesh)
    for name, p in module._parameters.items():
        key = prefix + name
        value = state_dict.get(key)
        if value is None:
            continue
        if name in module._fxtp_plain:
            placement, _, mesh = module._fxtp_plain[name]
        elif _on_tp_mesh(p):
            placement, mesh = p.placements[0], p.device_mesh
            if isinstance(value, DTensor) and value.placements == p.placements:
                continue
        else:
            continue
        local = local_shard(value, placement, mesh).to(p.dtype).contiguous()
        state_dict[key] = local if name in module._fxtp_plain else DTensor.from_local(
            local, mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
