"""The program reads plain local tensors; the ecosystem sees ``DTensor`` parameters.

Each parameter fxtp lays out as a ``DTensor`` (:mod:`fxtp.edges.dtensor_params`) has a *local
read*: a plain leaf tensor sharing the storage and version counter of its local tensor.
The graphs read it, never the ``DTensor``: ``read_parameter(owner._fxtp_leaves, name)``.
So an eager call runs no ``DTensor`` code, and a compiled one guards and runs on plain
tensors only, as over plain parameters.

A backward accumulates into the reads, as into plain parameters, and a read's ``.grad``
is its parameter's gradient: the parameter is a :class:`LocalGradParameter`, whose
``.grad`` is a ``DTensor`` of its spec over the read's (made when asked for, the same
object while the gradient is), and whose ``.grad = ...`` sets the read's. So a backward,
``zero_grad`` and a local optimizer step (:mod:`fxtp.edges.local_steps`) touch no
``DTensor``, while ``param.grad``, torch's clipping, DCP and optimizers see what they see
of any ``DTensor`` parameter. A gradient the read cannot hold (laid out otherwise, or one
autograd put on the ``DTensor`` itself, where user code computed with it) is held by the
parameter as usual; ``.grad`` then adds the read's to it. A parameter's own
post-accumulate-grad hooks run when its read's gradient is accumulated.

The reads follow the parameters:

* an owner's ``_parameters`` is a :class:`ParameterTable`: a parameter written into it
  (FSDP2's sharded and unsharded ones, DDP's local ones, ``load_state_dict(assign=True)``'s)
  is what the graphs read from then on, through ``local_tensor``; fxtp's own by its read;
* ``_apply`` (``.to``, ``.double()``, ``to_empty``), ``requires_grad_`` and
  ``copy.deepcopy`` on a graph module renew the reads below it (:func:`renew`);
* an eager call renews any read that is stale (a parameter's ``requires_grad`` set
  directly, an unpickled module). A compiled program cannot check: set ``requires_grad``
  through ``module.requires_grad_`` there, or before compiling.

``torch.autograd.grad(loss, gm.parameters())`` finds no path to the parameters, which the
graphs do not read: parallelize with ``dtensor_params=False`` for that.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..kernels.torch_compat import (OWN_GRAD, compute_global_tensor_info, dtensor_of,
                                   held_only_by, mark_static_address)
from ..passes.graph import own_method

LEAVES = "_fxtp_leaves"
"""The attribute of a module holding its parameters' reads, by parameter name."""

_READ = "_fxtp_read"  # in a DTensor parameter's __dict__: its read (marks it as fxtp's)
_LIVE = object()  # a read's mark that it was made here, its hook attached (copies lack it)


def read_parameter(leaves: dict, name: str) -> torch.Tensor:
    """What a graph computes with for its owner's parameter ``name``: its read, or the
    local tensor of a parameter fxtp did not make."""
    value = leaves[name]
    if torch.compiler.is_compiling():
        return local_tensor(value)
    param = getattr(value, "_fxtp_param", None)
    if param is None:
        return local_tensor(value)
    if not _current(value, param):
        value = leaves[name] = read_of(param)
    return value


def read_attribute(module: nn.Module, target: str) -> torch.Tensor:
    """What a graph computes with for ``module``'s tensor at ``target`` (a dotted path)."""
    owner, _, name = target.rpartition(".")
    owner = module.get_submodule(owner)
    leaves = getattr(owner, LEAVES, None)
    if leaves is not None and name in leaves:
        return read_parameter(leaves, name)
    return local_tensor(getattr(owner, name))


def local_tensor(p):
    """What the graph computes with: a ``DTensor`` parameter's local tensor (differentiable)."""
    if not isinstance(p, DTensor):
        return p
    return p.to_local() if torch.compiler.is_compiling() else _LocalTensor.apply(p)


class _LocalTensor(torch.autograd.Function):
    """``DTensor.to_local`` for a parameter, cheaper backward: a gradient laid out like the
    local tensor becomes a ``DTensor`` of the parameter's own spec directly, where
    ``to_local``'s backward re-derives the spec and goes through ``from_local``. Any
    other gradient, or one that needs a graph of its own (double backward), takes
    ``from_local``'s way."""

    @staticmethod
    def forward(ctx, p):
        ctx.spec, ctx.local_stride = p._spec, p._local_tensor.stride()
        ctx.set_materialize_grads(False)
        return p._local_tensor.view_as(p._local_tensor)

    @staticmethod
    def backward(ctx, grad):
        return None if grad is None else as_dtensor(grad, ctx.spec, ctx.local_stride)


def is_ours(value) -> bool:
    """Is ``value`` a parameter whose read fxtp made (and keeps)?"""
    return isinstance(value, DTensor) and _READ in value.__dict__


def read_of(param: DTensor) -> torch.Tensor:
    """``param``'s read, made here if it has none that is current."""
    global epoch
    held = param.__dict__.get(_READ)
    if held is not None and _current(held, param):
        if type(param) is DTensor:  # lent as one (renewing_apply)
            param.__class__ = LocalGradParameter
        return held
    before = _live_read(param)  # its gradient goes on to the new read
    grad = None if before is None else before.grad
    local = param._local_tensor
    leaf = local.detach().requires_grad_(param.requires_grad)
    leaf._fxtp_param, leaf._fxtp_local, leaf._fxtp_live = param, local, _LIVE
    leaf._fxtp_stride = local.stride()  # a gradient strided so is wrapped as it is
    mark_static_address(leaf)  # as parameters: CUDA graphs read it
    if type(param) is DTensor:
        param.__class__ = LocalGradParameter
    param.__dict__[_READ] = leaf
    param.__dict__.pop(_BOX, None)
    if grad is not None:
        param.grad = as_dtensor(grad, param._spec, local.stride())
    else:  # one the DTensor held (converted by torch's _apply): to the read, if it can
        settle_gradient(param)
    if param._post_accumulate_grad_hooks:
        _forward_hooks(leaf)
    epoch += 1
    return leaf


epoch = 0
"""How many reads were made in this process: a cache of reads is current while it holds."""


def stale(t: torch.Tensor) -> bool:
    """Is ``t`` a read that its parameter no longer reads (the parameter moved, was
    converted or had ``requires_grad`` set since)?"""
    param = t.__dict__.get("_fxtp_param")
    return param is not None and not _current(t, param)


def _current(leaf: torch.Tensor, param: DTensor) -> bool:
    return leaf.__dict__.get("_fxtp_live") is _LIVE and \
        leaf._fxtp_local is param._local_tensor and leaf.requires_grad == param.requires_grad


def laid_out_like(t, p: DTensor) -> bool:
    """Is ``t`` a ``DTensor`` laid out as ``p`` is (its local tensor a part of ``p``'s
    shape)?"""
    if not isinstance(t, DTensor):
        return False
    ts, ps = t._spec, p._spec  # specs copied from the parameter's share its parts
    return (ts.mesh is ps.mesh or ts.mesh == ps.mesh) and \
        (ts.placements is ps.placements or ts.placements == ps.placements) and \
        t._local_tensor.shape == p._local_tensor.shape


_BOX = "_fxtp_grad"  # in a parameter's __dict__: (the read's gradient, the DTensor over it),
# or (None, a spare DTensor to wrap the next one in)


class LocalGradParameter(DTensor):
    """An fxtp parameter: a ``DTensor`` whose gradient is its read's (see the module's
    docstring). Only :func:`read_of` makes one, from a ``DTensor`` parameter; a copy or a
    conversion of it is a ``DTensor`` again until its read is renewed."""

    @property
    def grad(self):
        read, held = _live_read(self), OWN_GRAD.__get__(self)
        local = None if read is None else read.grad
        if local is None:
            return held
        if held is not None:  # one put on the DTensor itself: the read's is added to it
            return _summed(self, read, held, local)
        box = self.__dict__.get(_BOX)
        if box is not None and box[0] is local:
            return box[1]
        grad = _wrapped(self, read, local, box)
        self.__dict__[_BOX] = (local, grad)
        return grad

    @grad.setter
    def grad(self, value):
        read = _live_read(self)
        if value is None:
            if read is not None:
                read.grad = None
            forget_gradient(self)
            return
        self.__dict__.pop(_BOX, None)
        if read is not None and _holdable(value, read, self):
            read.grad = value._local_tensor
            self.__dict__[_BOX] = (value._local_tensor, value)
            value = None
        elif read is not None:
            read.grad = None
        OWN_GRAD.__set__(self, value)

    _grad = grad

    def register_post_accumulate_grad_hook(self, hook):
        handle = super().register_post_accumulate_grad_hook(hook)
        read = _live_read(self)
        if read is not None:
            _forward_hooks(read)
        return handle

    def __deepcopy__(self, memo):
        """A ``DTensor`` copy, its gradient included (held by the copy itself)."""
        grad, held = self.grad, OWN_GRAD.__get__(self)
        box = self.__dict__.pop(_BOX, None)  # not copied: a copy's is its own
        self.__class__ = DTensor
        try:
            OWN_GRAD.__set__(self, grad)
            return copy.deepcopy(self, memo)
        finally:
            OWN_GRAD.__set__(self, held)
            self.__class__ = LocalGradParameter
            if box is not None:
                self.__dict__[_BOX] = box


def _live_read(param: DTensor) -> Optional[torch.Tensor]:
    """``param``'s read, where it is the one made for it here (not a copy's)."""
    read = param.__dict__.get(_READ)
    if read is None or read.__dict__.get("_fxtp_live") is not _LIVE or \
            read.__dict__.get("_fxtp_param") is not param:
        return None
    return read


def _holdable(value, read: torch.Tensor, param: DTensor) -> bool:
    """Can ``read`` hold ``value`` (a gradient set on ``param``) as its ``.grad``?"""
    return value is not None and laid_out_like(value, param) and not value.requires_grad and \
        value._local_tensor.dtype == read.dtype and value._local_tensor.device == read.device


def _summed(param: DTensor, read: torch.Tensor, held: DTensor, local: torch.Tensor):
    """``param``'s gradient where the ``DTensor`` holds one (``held``) and its read another
    (``local``): their sum, added into ``held`` in place where the read can hold it then."""
    if _holdable(held, read, param) and not local.requires_grad:
        held._local_tensor.add_(local)
        param.grad = held
        return held
    summed = held + as_dtensor(local, param._spec, read._fxtp_stride)
    param.grad = summed
    return summed


def _wrapped(param: DTensor, read: torch.Tensor, local: torch.Tensor, box) -> DTensor:
    """``local`` (``read``'s gradient) as a ``DTensor`` of ``param``'s spec: the spare one
    ``box`` holds, where it has one and ``local`` is strided as the shard; else a new one."""
    if box is not None and box[0] is None and box[1]._spec is param._spec and \
            not local.requires_grad and local.stride() == read._fxtp_stride:
        box[1]._local_tensor = local
        return box[1]
    return as_dtensor(local, param._spec, read._fxtp_stride)


def _keep_spare(param: DTensor, box) -> None:
    """Keep the ``DTensor`` a dropped gradient was wrapped in (``box``) as ``param``'s
    spare, emptied, where nothing else holds it: the next gradient is wrapped in it, not in
    a new one (1 against 2.6 us)."""
    if box is None:
        return
    grad = box[1]
    if box[0] is not None:
        if grad._spec is not param._spec or not held_only_by(grad, 2):  # box, grad
            return
        grad._local_tensor = _NOTHING
    param.__dict__[_BOX] = (None, grad)


_NOTHING = torch.empty(0)  # a spare's local tensor


def forget_gradient(param: DTensor) -> None:
    """After ``param``'s read let its gradient go: ``param`` holds none either."""
    _keep_spare(param, param.__dict__.pop(_BOX, None))
    OWN_GRAD.__set__(param, None)


def _forward_hooks(read: torch.Tensor) -> None:
    """Have ``read`` run its parameter's post-accumulate-grad hooks (once)."""
    if read.__dict__.get("_fxtp_forwards") is None and read.requires_grad:
        read._fxtp_forwards = read.register_post_accumulate_grad_hook(_run_parameter_hooks)


def _run_parameter_hooks(read: torch.Tensor) -> None:
    param = read._fxtp_param
    for hook in list((param._post_accumulate_grad_hooks or {}).values()):
        hook(param)


def settle_gradient(param: DTensor) -> bool:
    """Have ``param``'s read hold its whole gradient: ``False`` where the ``DTensor`` itself
    holds one the read cannot."""
    if OWN_GRAD.__get__(param) is None:
        return True
    param.grad = param.grad
    return OWN_GRAD.__get__(param) is None


def as_dtensor(local: torch.Tensor, spec, local_stride) -> DTensor:
    """``local``, laid out as a parameter's local tensor (its ``spec``; ``local_stride``:
    its local tensor's strides), as a ``DTensor`` of that layout: a gradient, an optimizer
    state. Differentiable where ``local`` has a graph (double backward)."""
    meta = spec.tensor_meta
    if not local.requires_grad and local.stride() == local_stride and \
            meta is not None and local.dtype == meta.dtype:
        return dtensor_of(local, spec)
    _, stride = compute_global_tensor_info(local, spec.mesh, spec.placements)
    return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False,
                              shape=spec.shape, stride=tuple(stride))


class ParameterTable(dict):
    """A module's ``_parameters`` that keeps its reads (``module._fxtp_leaves``) on what is
    written into it. A deleted parameter's read stays (DDP's recipe deletes each one and
    sets it again); a copy is a plain ``dict`` (:func:`renew` makes the copy's table)."""

    def __init__(self, params: dict, leaves: Optional[dict] = None):
        super().__init__(params)
        self.leaves = leaves if leaves is not None else params.leaves

    def __setitem__(self, name, value) -> None:
        super().__setitem__(name, value)
        if name in self.leaves:
            self.leaves[name] = read_of(value) if is_ours(value) else value

    def __reduce_ex__(self, protocol):
        return dict, (dict(self),)


def keep_reads(module: nn.Module, names) -> None:
    """Give ``module`` reads of its ``DTensor`` parameters ``names`` and the table that keeps
    them."""
    module.__dict__.setdefault(LEAVES, {}).update(dict.fromkeys(names))
    _renew_module(module)


def renew(root: nn.Module) -> None:
    """Make every read at and below ``root`` current, and every owner's table: after a
    copy or a conversion, where the parameters are fxtp's own (at rest, any ``DTensor``
    parameter of a 1-D mesh is)."""
    for module in root.modules():
        _renew_module(module)


def _renew_module(module: nn.Module) -> None:
    leaves = module.__dict__.get(LEAVES)
    if leaves is None:
        return
    for name in leaves:
        param = module._parameters.get(name)
        if param is None:
            continue
        if isinstance(param, DTensor) and param.device_mesh.ndim == 1 and param.is_leaf:
            param.__dict__.setdefault(_READ, None)
            leaves[name] = read_of(param)
        else:
            leaves[name] = param
    if not isinstance(module._parameters, ParameterTable) or \
            module._parameters.leaves is not leaves:
        module.__dict__["_parameters"] = ParameterTable(module._parameters, leaves)


def follow_parameters(gm: nn.Module) -> None:
    """Have the reads of ``gm`` (a result of ``parallelize``) follow its parameters: every
    graph module in it renews the reads below it after ``_apply``, ``requires_grad_`` and
    ``copy.deepcopy``."""
    for module in gm.modules():
        if isinstance(module, fx.GraphModule) and \
                renew not in module.__dict__.get("_deepcopy_hooks", ()):
            if "_apply" not in vars(type(module)):  # the root's guards renew in theirs
                own_method(module, "_apply", renewing_apply)
            own_method(module, "requires_grad_", renewing_requires_grad_)
            module._register_deepcopy_hook(renew)
    renew(gm)


def renewing_apply(self, fn, recurse=True):
    """``nn.Module._apply``, then :func:`renew` (a graph module's own). For its length the
    parameters below are plain ``DTensor`` s holding their gradients themselves: torch
    wraps each in a new ``nn.Parameter`` (which a ``LocalGradParameter`` cannot be) and
    converts the gradient it holds; :func:`read_of` makes them fxtp's again."""
    for param in self.parameters():
        if type(param) is LocalGradParameter:
            _as_dtensor_parameter(param)
    try:
        return nn.Module._apply(self, fn, recurse)
    finally:
        renew(self)


def _as_dtensor_parameter(param: LocalGradParameter) -> None:
    grad, read = param.grad, _live_read(param)
    if read is not None:
        read.grad = None
    param.__dict__.pop(_BOX, None)
    param.__class__ = DTensor
    OWN_GRAD.__set__(param, grad)


def renewing_requires_grad_(self, requires_grad=True):
    """``nn.Module.requires_grad_``, then :func:`renew` (a graph module's own)."""
    result = nn.Module.requires_grad_(self, requires_grad)
    renew(self)
    return result
