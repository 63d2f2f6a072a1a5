"""Parameters as ``DTensor`` s on the tensor-parallel mesh; the graph computes on plain
local reads of them.

After the passes each parameter of the result holds this rank's shard. :func:`as_dtensors`
wraps every one in a ``DTensor`` of its global shape and placement, and has the graphs
read it through its owner's plain reads (:mod:`fxtp.edges.local_reads`). So the ecosystem's own
tools see the global tensors: ``torch.nn.utils.clip_grad_norm_`` reduces sharded norms
across ranks, DCP saves each shard once under the model's keys, FSDP2 shards the TP shards
further on a 2-D mesh. Sharded buffers (a KV cache written with sharded heads) stay plain
local tensors for the graph and are handed out by ``state_dict()`` as ``DTensor`` s, too.

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

import warnings

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..kernels.collectives import _all_gather, _gather_units
from ..kernels.torch_compat import StridedShard
from ..passes.graph import READS, keep_on_copy, recompile_alone
from ..passes.placement import (BlockShard, UnitShard, dtensor_placement, is_sharded, is_whole,
                                local_part)
from .local_reads import LEAVES, keep_reads, read_parameter
from .local_steps import step_locally


def as_dtensors(gm: fx.GraphModule, placements: dict, shapes: dict, mesh, world: int) -> None:
    """Replace each parameter of ``gm`` (FQN in ``placements``, global shape in ``shapes``)
    by a ``DTensor`` parameter sharing its local tensor, read through its owner's plain
    reads (:mod:`fxtp.edges.local_reads`) by every graph of ``gm``'s module tree."""
    made: dict[int, nn.Parameter] = {}
    read: dict[str, list[str]] = {}  # owner FQN -> its DTensor parameters' names
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
        read.setdefault(owner, []).append(name)
    sharded_buffers = {fqn: (placements[fqn], torch.Size(shapes[fqn]), mesh)
                       for fqn, _ in gm.named_buffers(remove_duplicate=False)
                       if is_sharded(placements.get(fqn))}
    for owner, names in read.items():
        keep_reads(gm.get_submodule(owner), names)
    step_locally()
    for owner_fqn, module in gm.named_modules(remove_duplicate=False):
        if isinstance(module, fx.GraphModule):
            _read_locally(module)
        if module._parameters or module._buffers:
            module._fxtp_plain = {name: plain[id(p)] for name, p in module._parameters.items()
                                  if id(p) in plain}
            module._fxtp_strided = {name: (p.placements[0], p.shape, mesh)
                                    for name, p in module._parameters.items()
                                    if isinstance(p, DTensor) and
                                    isinstance(p.placements[0], StridedShard)}
            prefix = owner_fqn + "." if owner_fqn else ""
            module._fxtp_buffers = {name: sharded_buffers[prefix + name]
                                    for name in module._buffers
                                    if prefix + name in sharded_buffers}
            if isinstance(module, fx.GraphModule):
                for name in ("_fxtp_plain", "_fxtp_strided", "_fxtp_buffers"):
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
    if isinstance(placement, (BlockShard, StridedShard)):
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
    if not isinstance(placement, StridedShard):
        return global_view(local, placement, mesh, shape)
    full = full_tensor(local, placement, mesh, shape)
    return DTensor.from_local(full, mesh, [Replicate()], run_check=False).redistribute(
        mesh, [Shard(placement.dim)])


def local_shard(value: torch.Tensor, placement, mesh) -> torch.Tensor:
    """This rank's part, laid out as ``placement``, of ``value``: a full tensor, or a
    ``DTensor`` of any placement on ``mesh`` (redistributed, gathered whole only where
    DTensor cannot describe ``placement``) or on another mesh (FSDP2's around it: gathered
    whole)."""
    rank, world = mesh.get_local_rank(), mesh.size()
    if isinstance(value, DTensor) and value.device_mesh != mesh:
        value = value.full_tensor()
    if isinstance(value, DTensor):
        as_dtensor = (dtensor_placement(placement, value.shape[placement.dim], world)
                      if is_sharded(placement) else placement)
        # not to StridedShard: torch 2.11's redistribute cannot take Shard there
        if as_dtensor is not None and not isinstance(as_dtensor, StridedShard):
            return value.redistribute(mesh, [as_dtensor]).to_local()
        value = value.redistribute(mesh, [Replicate()]).to_local()
    return local_part(value, placement, rank, world)


def _read_locally(gm: fx.GraphModule) -> None:
    """Each parameter read whose owner keeps reads (:mod:`fxtp.edges.local_reads`) becomes a
    :func:`~fxtp.edges.local_reads.read_parameter` of its owner's reads, all of them at the top of
    the graph (outside checkpointed regions, which then take plain tensors)."""
    graph = gm.graph
    top = next(n for n in graph.nodes if n.op not in ("placeholder", "get_attr"))
    owners: dict[str, fx.Node] = {}
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        owner, _, name = node.target.rpartition(".")
        if name not in gm.get_submodule(owner).__dict__.get(LEAVES, {}):
            continue
        if owner not in owners:
            with graph.inserting_before(top), warnings.catch_warnings():
                warnings.filterwarnings("ignore", "Attempted to insert a get_attr Node")
                owners[owner] = graph.get_attr(f"{owner}.{LEAVES}" if owner else LEAVES)
        users = list(node.users)
        if users:  # reported in the module that reads it
            node.meta["nn_module_stack"] = dict(users[0].meta.get("nn_module_stack", {}))
        node.meta.pop("custom", None)
        node.meta[READS] = node.target
        top.prepend(node)  # the node itself, keeping its name (explain, dumps)
        node.op, node.target = "call_function", read_parameter
        node.args = (owners[owner], name)
    graph.lint()
    recompile_alone(gm)


def _on_tp_mesh(p) -> bool:
    """Is ``p`` as fxtp made it (not sharded further, by FSDP2 on a 2-D mesh)?"""
    return isinstance(p, DTensor) and p.device_mesh.ndim == 1


def fsdp_shard_placement(param: nn.Parameter):
    """FSDP2's ``shard_placement_fn`` for fxtp's parameters:
    ``fully_shard(block, mesh=mesh["dp"], shard_placement_fn=fxtp.fsdp_shard_placement)``.
    FSDP2 cuts every parameter along dim 0 by default; a fused projection's weight is laid
    out in blocks along its dim 0 on "tp" (``_StridedShard``), and rows of those blocks cut
    again have no DTensor placement, so FSDP2's own view of it (``full_tensor()``, the
    gradient's, the optimizer state's) would scramble rows. This cuts such a weight along
    its largest other dim instead, where the views are right; ``None`` (dim 0) for every
    other parameter, and for a 1-D fused bias, which has no other dim. The model's state
    dict is whole either way (fxtp's state-dict hooks go by what FSDP2 holds)."""
    if isinstance(param, DTensor):
        blocked = {p.dim for p in param.placements if isinstance(p, StridedShard)}
        free = [d for d in range(param.ndim) if d not in blocked]
        if blocked and free:
            return Shard(max(free, key=lambda d: param.shape[d]))
    return None


def sharded_further(p, mesh) -> bool:
    """Has data parallelism (FSDP2, HSDP) sharded ``p`` further than fxtp laid it out on
    its tensor-parallel ``mesh``? FSDP2 cuts this rank's TP shard in ``torch.chunk`` parts
    along one dim across its shard group, and describes the result as a ``DTensor`` on a
    mesh around ``mesh``: right for ``Shard`` and ``Replicate``; for a fused
    projection's ``_StridedShard`` cut along its own dim, or a layout DTensor has no
    placement for, not (its ``full_tensor`` and DCP's chunks would scramble or overlap
    rows). :func:`tp_shard` and the state-dict hooks go by what FSDP2 holds instead."""
    return isinstance(p, DTensor) and p.device_mesh != mesh


def _tp_index(full_mesh, mesh):
    """The dim of ``full_mesh`` (FSDP2's, around the TP ``mesh``) that is TP's: by name, the
    last where the meshes carry none; ``None`` where it has none (a parameter fxtp left
    plain, which FSDP2 shards on the data-parallel mesh alone)."""
    names, tp_name = full_mesh.mesh_dim_names, (mesh.mesh_dim_names or (None,))[0]
    if names:
        return names.index(tp_name) if tp_name in names else None
    return full_mesh.ndim - 1 if full_mesh.ndim > 1 else None


def _dp_cut(p: DTensor, mesh):
    """``(mesh dim, tensor dim)`` along which data parallelism cut ``p``'s TP shard, or
    ``None``: the dim of ``p``'s mesh that is not TP's and shards."""
    tp_index = _tp_index(p.device_mesh, mesh)
    for i, placement in enumerate(p.placements):
        if i != tp_index and isinstance(placement, (Shard, StridedShard)):
            return i, placement.dim
    return None


def tp_shard(p: torch.Tensor, mesh) -> torch.Tensor:
    """This rank's tensor-parallel shard of parameter ``p`` as fxtp laid it out on
    ``mesh``: its local tensor, gathered across the data-parallel shard group where
    FSDP2 / HSDP cut it further (:func:`sharded_further`)."""
    if not isinstance(p, DTensor):
        return p
    if not sharded_further(p, mesh):
        return p._local_tensor
    local, cut = p._local_tensor, _dp_cut(p, mesh)
    if cut is None:
        return local
    index, dim = cut
    group, n = p.device_mesh.get_group(index), p.device_mesh.size(index)
    length = torch.tensor([local.shape[dim]], device=local.device)
    every = [torch.empty_like(length) for _ in range(n)]
    torch.distributed.all_gather(every, length, group=group)
    lengths = [int(t) for t in every]
    padded = torch.zeros((*local.shape[:dim], max(lengths), *local.shape[dim + 1:]),
                         dtype=local.dtype, device=local.device)
    padded.narrow(dim, 0, local.shape[dim]).copy_(local)
    parts = [torch.empty_like(padded) for _ in range(n)]
    torch.distributed.all_gather(parts, padded, group=group)
    return torch.cat([part.narrow(dim, 0, length) for part, length in zip(parts, lengths)],
                     dim)


def write_tp_shard(p: torch.Tensor, mesh, shard: torch.Tensor) -> None:
    """Copy this rank's TP ``shard`` into parameter or buffer ``p``: into its local tensor,
    or the part of it FSDP2 / HSDP keeps where it sharded ``p`` further."""
    local = p._local_tensor if isinstance(p, DTensor) else p
    if isinstance(p, DTensor) and sharded_further(p, mesh):
        shard = _further_part(shard, p, mesh)
    if shard.data_ptr() != local.data_ptr():  # DCP may have loaded it in place already
        local.copy_(shard)


def _further_part(shard: torch.Tensor, p: DTensor, mesh) -> torch.Tensor:
    """The part of this rank's TP ``shard`` that FSDP2 / HSDP keeps in ``p``: its
    ``torch.chunk`` part along the data-parallel cut (an empty one past the last)."""
    cut = _dp_cut(p, mesh)
    if cut is None:
        return shard
    index, dim = cut
    chunks = torch.chunk(shard, p.device_mesh.size(index), dim)
    rank = p.device_mesh.get_local_rank(index)
    return chunks[rank] if rank < len(chunks) else shard.narrow(dim, 0, 0)


def _checkpoint_view_further(p: DTensor, placement, shape, mesh) -> DTensor:
    """:func:`checkpoint_view` of a parameter FSDP2 / HSDP sharded further: the whole
    tensor, gathered, handed out on ``p``'s mesh as one chunk per TP rank (``Shard`` of
    the strided dim; ``Replicate`` where DTensor has no placement), the same across the
    data-parallel ranks."""
    whole = full_tensor(tp_shard(p, mesh), placement, mesh, shape)
    full_mesh, tp_index = p.device_mesh, _tp_index(p.device_mesh, mesh)
    target = [Replicate()] * full_mesh.ndim
    if isinstance(placement, StridedShard) and tp_index is not None:
        target[tp_index] = Shard(placement.dim)
    return DTensor.from_local(whole, full_mesh, [Replicate()] * full_mesh.ndim,
                              run_check=False).redistribute(full_mesh, target)


def _relay_for_checkpoint(module, state_dict, prefix, local_metadata):
    """Parameters and sharded buffers (a KV cache) as :func:`checkpoint_view` lays them
    out."""
    for name, (placement, shape, mesh) in module._fxtp_buffers.items():
        if prefix + name in state_dict:
            state_dict[prefix + name] = checkpoint_view(module._buffers[name].detach(),
                                                        placement, mesh, shape)
    for name, p in module._parameters.items():
        key = prefix + name
        layout = module._fxtp_plain.get(name) or module._fxtp_strided.get(name)
        if key not in state_dict or layout is None:
            continue
        placement, shape, mesh = layout
        if sharded_further(p, mesh):
            state_dict[key] = _checkpoint_view_further(p.detach(), placement, shape, mesh)
        else:
            state_dict[key] = checkpoint_view(tp_shard(p.detach(), mesh), placement, mesh,
                                              shape)
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
        layout = module._fxtp_plain.get(name) or module._fxtp_strided.get(name)
        if layout is not None and sharded_further(p, layout[2]):
            placement, _, mesh = layout
            part = _further_part(local_shard(value, placement, mesh), p, mesh)
            state_dict[key] = DTensor.from_local(part.to(p.dtype).contiguous(), p.device_mesh,
                                                 p.placements, run_check=False, shape=p.shape,
                                                 stride=p.stride())
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
