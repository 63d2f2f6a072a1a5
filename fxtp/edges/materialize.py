"""Meta-device models: trace without weights, then allocate and initialize only this
rank's shards; the full weights never exist anywhere.

A model built under ``torch.device("meta")`` is traced with its meta tensors swapped for
fake tensors on the target device (no memory). After the passes, every meta parameter and
buffer of the result is allocated with its local shape on ``device`` and initialized:

* modules are visited children first (the order constructors initialize in); for each one
  fxtp calls ``init_fn(module)`` when given, else ``module.reset_parameters()`` if the
  module defines it;
* during the call the module's tensors are this rank's shards: a sharded one as a
  ``DTensor`` of the global shape, so ``torch.nn.init`` computes fans from the global shape
  and draws the single-device distribution; a replicated one as a plain tensor;
* each piece of a sharded tensor draws from a stream of its own (pieces are independent;
  ranks holding the same piece, such as the TP ranks of one FSDP shard of a norm weight,
  share it), replicated tensors from a stream shared by all ranks (identical everywhere);
  the streams are seeded from one number drawn from rank 0's default generator, so the
  same seed gives the same shards. The values are not slices of what single-device
  initialization would draw;
* a tensor registered under several names (tied weights) is initialized by the module of
  its first name only;
* a floating (integer) tensor left holding NaN (the integer maximum) afterwards was not
  initialized: a :class:`PlanError` names it. Boolean buffers cannot be checked.

DTensor indexes a sharded dim by gathering, so a write through ``t[i]`` on a sharded dim
is lost; the one in torch's own initializers, ``nn.Embedding``'s zeroed ``padding_idx``
row, is redone here on the rank holding it.

:func:`init_weights` does the same for a result kept on the meta device
(``parallelize(..., device="meta")``), sharded further by FSDP2 and allocated by
``to_empty``: only the (dp x tp) shard is ever allocated.
"""
from __future__ import annotations

import contextlib
import hashlib
import warnings
from typing import Callable, Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..frontend.names import named_tensors
from ..kernels.torch_compat import FakeTensorMode, compute_local_shape_and_global_offset
from ..passes.placement import dtensor_placement, is_sharded
from ..plans.mesh import resolve_group

from ..passes.errors import PlanError


def meta_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """FQN -> tensor for every meta parameter and buffer, under all its names."""
    return {fqn: t for fqn, t in named_tensors(model) if t.is_meta}


@contextlib.contextmanager
def swapped(model: nn.Module, tensors: dict[str, torch.Tensor]):
    """Register ``tensors`` (FQN -> tensor) in ``model`` in place of its own for the
    duration of the block; the originals are restored on exit."""
    saved = []
    try:
        for fqn, t in tensors.items():
            owner_name, _, name = fqn.rpartition(".")
            owner = model.get_submodule(owner_name)
            slots = owner._parameters if name in owner._parameters else owner._buffers
            saved.append((slots, name, slots[name]))
            slots[name] = t
        yield model
    finally:
        for slots, name, original in reversed(saved):
            slots[name] = original


def fake_tensors(meta: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Fake tensors on ``device`` standing for ``meta`` tensors (ties kept), to trace with."""
    mode, fakes = FakeTensorMode(allow_non_fake_inputs=True), {}
    with mode:
        for t in meta.values():
            if id(t) not in fakes:
                fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
                fakes[id(t)] = nn.Parameter(fake, t.requires_grad) \
                    if isinstance(t, nn.Parameter) else fake
    return {fqn: fakes[id(t)] for fqn, t in meta.items()}


def materialize(gm: fx.GraphModule, model: nn.Module, meta: dict[str, torch.Tensor],
                placements: dict, group, mesh, device: torch.device,
                init_fn: Optional[Callable[[nn.Module], None]], seed: int) -> None:
    """Give ``gm`` real local tensors for the ``meta`` FQNs and initialize them (see the
    module docstring). ``placements``: FQN -> placement; ``seed``: rank 0's draw. On
    the meta device they are allocated there (meta tensors, not the trace's fakes) and not
    initialized."""
    allocated = _allocate(gm, meta, device)
    if device.type == "meta":
        return
    names = _first_names(model, meta)
    locals_ = {names[fqn]: allocated[fqn] for fqn in meta}
    placed = {names[fqn]: p for fqn, p in placements.items() if fqn in names and p}
    views = {fqn: _init_view(t.detach(), placed.get(fqn), mesh, meta[fqn].shape)
             for fqn, t in locals_.items()}
    _initialize(model, views, names, seed, device, init_fn)


def init_weights(gm: nn.Module, model: nn.Module,
                 init_fn: Optional[Callable[[nn.Module], None]] = None) -> None:
    """Initialize every tensor of ``gm``, the result of ``parallelize(model, ...,
    device="meta")`` after ``gm.to_empty(device=...)``, as ``parallelize`` initializes a
    meta-device model (see the module docstring): ``init_fn(module)`` or the modules'
    ``reset_parameters()``, each seeing its tensors at their global shape.

    This is the route that keeps every rank at its share when FSDP2 shards further:
    ``parallelize(..., device="meta")``, ``fully_shard`` the blocks and the root (on the
    meta device), ``gm.to_empty(device=...)``, then ``init_weights(gm, model)``: a
    parameter is allocated only as its (dp x tp) shard, and initialized through FSDP's
    2-D ``DTensor``. Ranks holding the same piece draw the same values. Every rank must
    call it (rank 0's seed is broadcast over the default group)."""
    if not hasattr(gm, "fxtp"):
        raise PlanError("init_weights takes the result of fxtp.parallelize(model, ...) and "
                        "the model it was made from")
    info, tensors = gm.fxtp, dict(named_tensors(gm))  # compiled, checkpointed blocks too
    model_tensors = dict(named_tensors(model))
    names = _first_names(gm, tensors)
    views = {}
    for fqn, t in tensors.items():
        first = names[fqn]
        if first in views:
            continue
        if _local(t).is_meta:
            raise PlanError(f"'{fqn}' is still on the meta device: allocate the result "
                            f"first, e.g. gm.to_empty(device='cuda'), then init_weights")
        view = t.detach() if isinstance(t, DTensor) else \
            _init_view(t.detach(), info.param_placements.get(fqn), info.mesh,
                       model_tensors[fqn].shape)
        if view.shape != model_tensors[fqn].shape:
            raise PlanError(f"'{fqn}' shows the shape {tuple(view.shape)} where the model's "
                            f"is {tuple(model_tensors[fqn].shape)}: parallelize with "
                            f"dtensor_params=True before sharding it further")
        views[first] = view
    for view in views.values():
        _fill_unwritten(_local(view))
    on = resolve_group(None).device_type  # where the default group communicates
    draw = torch.randint(2 ** 62, (1,)).to(on)
    dist.broadcast(draw, src=0)  # a fake process group leaves it as it is
    device = _local(next(iter(views.values()))).device
    _initialize(model, views, names, int(draw), device, init_fn)


def _first_names(module: nn.Module, tensors: dict) -> dict[str, str]:
    """Every FQN of ``tensors`` -> the first name its tensor has in ``module`` (the one
    whose module initializes it: tied weights are initialized once)."""
    first = {}
    for fqn, t in named_tensors(module):
        first.setdefault(id(t), fqn)
    return {fqn: first[id(t)] for fqn, t in tensors.items()}


def _local(view: torch.Tensor) -> torch.Tensor:
    return view._local_tensor if isinstance(view, DTensor) else view


def _initialize(model: nn.Module, views: dict, names: dict, seed: int, device,
                init_fn) -> None:
    """Run the initializers of ``model``'s modules, children first, with its tensors shown
    as ``views`` (first FQN -> the tensor to write, a ``DTensor`` when sharded), each
    drawing from the random stream of the piece it holds; check that all were written."""
    streams = {fqn: _stream(view) for fqn, view in views.items()}
    for prefix, module in reversed(list(model.named_modules())):
        init = (lambda m=module: init_fn(m)) if init_fn else \
            getattr(module, "reset_parameters", None)
        owned = [fqn for fqn in views if _within(fqn.rpartition(".")[0], prefix)]
        if init is None or not owned:
            continue
        for stream in sorted({streams[fqn] for fqn in owned}):
            # the other streams' tensors stay meta: what the initializer writes there is lost
            shown = {n: views[f] for n, f in names.items() if streams[f] == stream}
            with swapped(model, shown), _random_stream(seed, prefix, stream, device), \
                    torch.no_grad(), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="DTensor random operators")
                init()
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            _zero_padding_row(module, prefix, views)
    _check_written(model, {fqn: _local(v) for fqn, v in views.items()}, init_fn)


def _allocate(gm: nn.Module, meta: dict, device) -> dict[str, torch.Tensor]:
    """Register in ``gm`` a new local tensor (ties kept) for each ``meta`` FQN, whose value
    in ``gm`` is still a fake or meta stand-in of the local shape; return them by FQN."""
    stand_ins = dict(named_tensors(gm))
    made: dict[int, torch.Tensor] = {}
    for fqn in meta:
        value = stand_ins[fqn]
        if id(value) not in made:
            local = _unwritten(value.shape, value.dtype, device)
            made[id(value)] = nn.Parameter(local, value.requires_grad) \
                if isinstance(value, nn.Parameter) else local
        _register(gm, fqn, made[id(value)])
    return {fqn: made[id(stand_ins[fqn])] for fqn in meta}


def _unwritten(shape, dtype, device) -> torch.Tensor:
    """An allocation holding the marker of :func:`_fill_unwritten`."""
    t = torch.empty(shape, dtype=dtype, device=device)
    _fill_unwritten(t)
    return t


@torch.no_grad()
def _fill_unwritten(t: torch.Tensor) -> None:
    """Overwrite ``t`` with a marker no initializer writes: NaN, or the integer maximum
    (``False`` for booleans, which cannot be checked)."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    else:
        t.fill_(False if t.dtype == torch.bool else torch.iinfo(t.dtype).max)


def _is_unwritten(t: torch.Tensor) -> bool:
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return bool(torch.isnan(t).any())
    if t.dtype == torch.bool or t.numel() == 0:
        return False
    return bool((t == torch.iinfo(t.dtype).max).all())


def _register(gm: nn.Module, fqn: str, t: torch.Tensor) -> None:
    owner_name, _, name = fqn.rpartition(".")
    owner = gm.get_submodule(owner_name)
    if name in owner._parameters:
        owner._parameters[name] = t
    else:
        owner._buffers[name] = t


def _init_view(local: torch.Tensor, placement, mesh, global_shape) -> torch.Tensor:
    """What an initializer sees: the local tensor, or for a shard a DTensor of the
    global shape over it."""
    if not is_sharded(placement):
        return local
    as_dtensor = dtensor_placement(placement, global_shape[placement.dim], mesh.size())
    if as_dtensor is None:
        raise PlanError(f"a meta-device model's parameter laid out as {placement}, which "
                        f"DTensor cannot describe (heads that do not divide by the world "
                        f"size, a fused projection of unequal parts), cannot be initialized "
                        f"shard by shard; build the model on a real device, or choose sizes "
                        f"that divide by the world size")
    return DTensor.from_local(local, mesh, [as_dtensor], run_check=False,
                              shape=torch.Size(global_shape),
                              stride=torch.empty(global_shape, device="meta").stride())


def _within(owner: str, prefix: str) -> bool:
    return prefix == "" or owner == prefix or owner.startswith(prefix + ".")


def _stream(view: torch.Tensor) -> str:
    """The random stream a tensor draws from: one per piece of a sharded tensor (ranks
    holding the same piece, e.g. TP ranks of one FSDP shard of a norm weight, share it),
    one for replicated tensors."""
    if not isinstance(view, DTensor):
        return "replicated"
    at = view.device_mesh.get_coordinate()
    pieces = [f"{d}:{at[d]}" for d, p in enumerate(view.placements) if p.is_shard()]
    return "shard " + ",".join(pieces) if pieces else "replicated"


@contextlib.contextmanager
def _random_stream(seed: int, prefix: str, stream: str, device: torch.device):
    """The default generators, seeded for one module and stream, restored afterwards."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        digest = hashlib.sha256(f"{seed}/{prefix}/{stream}".encode()).digest()
        torch.manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        yield


@torch.no_grad()
def _zero_padding_row(module: nn.Embedding, prefix: str, views: dict) -> None:
    fqn = f"{prefix}.weight" if prefix else "weight"
    view = views.get(fqn)
    if not isinstance(view, DTensor):
        return  # not sharded here: the initializer's own write went through
    shape, offset = compute_local_shape_and_global_offset(view.shape, view.device_mesh,
                                                          view.placements)
    row = module.padding_idx % module.num_embeddings - offset[0]
    if 0 <= row < shape[0]:
        view._local_tensor[row].fill_(0)


def _check_written(model: nn.Module, locals_: dict, init_fn) -> None:
    missing = []
    for fqn, t in locals_.items():
        if _is_unwritten(t.detach()):
            owner_name = fqn.rpartition(".")[0]
            owner = model.get_submodule(owner_name)
            why = "init_fn did not write it" if init_fn else \
                "reset_parameters() did not write it" if hasattr(owner, "reset_parameters") \
                else f"{type(owner).__name__} has no reset_parameters()"
            missing.append(f"'{fqn}' ({why})")
    if missing:
        raise PlanError(
            f"meta-device tensors were left uninitialized: {', '.join(missing)}. Pass "
            f"parallelize(..., init_fn=fn): fxtp calls fn(module) for every module, children "
            f"first, with the module's tensors as this rank's shards (DTensors of the global "
            f"shape when sharded), and fn initializes them in place, e.g. "
            f"nn.init.ones_(module.weight)")
