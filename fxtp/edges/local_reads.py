"""The program reads plain local tensors; the ecosystem sees ``DTensor`` parameters.

Each parameter fxtp lays out as a ``DTensor`` (:mod:`fxtp.edges.dtensor_params`) has a *local
read*: a plain leaf tensor sharing the storage and version counter of its local tensor.
The graphs read it, never the ``DTensor``: ``read_parameter(owner._fxtp_leaves, name)``.
So an eager call runs no ``DTensor`` code, and a compiled one guards and runs on plain
tensors only, as over plain parameters. What a backward leaves on a read goes to its
parameter when the backward ends, all reads in one pass: its ``.grad`` becomes a
``DTensor`` of the parameter's spec over it, or is added to in place, as autograd
accumulates; the read's own ``.grad`` is ``None`` again. A parameter with
post-accumulate-grad hooks of its own gets its gradient as soon as it is accumulated, and
its hooks run after. So ``param.grad``, ``zero_grad``,
torch's clipping, DCP and optimizers see what they see of any ``DTensor`` parameter.

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

from typing import Optional

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..kernels.torch_compat import (compute_global_tensor_info, current_backward, dtensor_fields,
                                   dtensor_of, mark_static_address, queue_backward_callback)
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
        return held
    local = param._local_tensor
    leaf = local.detach().requires_grad_(param.requires_grad)
    leaf._fxtp_param, leaf._fxtp_local, leaf._fxtp_live = param, local, _LIVE
    meta = param._spec.tensor_meta  # a gradient strided so becomes a DTensor as it is
    leaf._fxtp_stride = local.stride() if meta is not None and meta.dtype == local.dtype \
        else None
    if param.requires_grad:
        leaf.register_post_accumulate_grad_hook(_publish_gradient)
    mark_static_address(leaf)  # as parameters: CUDA graphs read it
    param.__dict__[_READ] = leaf
    epoch += 1
    return leaf


epoch = 0
"""How many reads were made in this process: a cache of reads is current while it holds."""


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


def _publish_gradient(leaf: torch.Tensor) -> None:
    """After a backward accumulated into ``leaf``: its gradient goes to its parameter at once
    where the parameter has hooks of its own to see it, else with the other reads this
    backward reached when it ends (one :class:`_Publication` queued on it)."""
    if leaf._fxtp_param._post_accumulate_grad_hooks:
        _publish(leaf)
        return
    task = current_backward()
    reads = _pending.get(task)
    if reads is None:
        reads = _pending[task] = []
        queue_backward_callback(_Publication(task))
    reads.append(leaf)


_pending: dict = {}  # backward -> the reads it left a gradient on, their parameters not given it


class _Publication:
    """Queued on a backward: publishes the reads it reached when it ends, or when it is
    dropped unrun (a backward that raised), as the gradients a backward leaves in ``.grad``
    before it raises stay there. Each read is published even where another raises."""

    def __init__(self, task: int):
        self.task = task

    def __call__(self) -> None:
        rest, failed = [], None
        with dtensor_fields():  # only fxtp's DTensors are touched in it
            for leaf in _pending.pop(self.task, ()):
                try:
                    given = _give(leaf)
                except Exception:  # noqa: BLE001 - raised again below, outside the context
                    given = False
                if not given:
                    rest.append(leaf)
        for leaf in rest:
            try:
                if leaf.grad is not None:
                    _publish(leaf)
            except Exception as e:  # noqa: BLE001 - raised once every read is published
                failed = failed or e
        if failed is not None:
            raise failed

    __del__ = __call__


def _give(leaf: torch.Tensor) -> bool:
    """:func:`_publish`'s common cases, run inside :func:`dtensor_fields`: a gradient that
    needs no graph of its own, for a parameter without hooks of its own, that becomes its
    ``.grad`` as it is or is added to the one it holds. ``False`` (nothing done) for any
    other."""
    grad = leaf.grad
    if grad is None:
        return True
    param = leaf._fxtp_param
    if grad.requires_grad or param._post_accumulate_grad_hooks:
        return False
    held = param.grad
    if held is None:
        if grad.stride() != leaf._fxtp_stride or grad.dtype is not leaf.dtype:
            return False
        param.grad = dtensor_of(grad, param._spec)
    elif laid_out_like(held, param):
        held._local_tensor.add_(grad)
    else:
        return False
    leaf.grad = None
    return True


def _publish(leaf: torch.Tensor) -> None:
    """``leaf``'s gradient goes to its parameter's ``.grad``, a ``DTensor`` over it, or is
    added in place to the one it holds; then the parameter's own hooks run."""
    grad, param = leaf.grad, leaf._fxtp_param
    leaf.grad = None
    with dtensor_fields():
        held = param.grad
    if held is None:
        param.grad = as_dtensor(grad, param._spec, param._local_tensor.stride())
    elif not grad.requires_grad and laid_out_like(held, param):
        held._local_tensor.add_(grad)
    else:
        param.grad = held + as_dtensor(grad, param._spec, param._local_tensor.stride())
    for hook in (param._post_accumulate_grad_hooks or {}).values():
        hook(param)


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
    """``nn.Module._apply``, then :func:`renew` (a graph module's own)."""
    result = nn.Module._apply(self, fn, recurse)
    renew(self)
    return result


def renewing_requires_grad_(self, requires_grad=True):
    """``nn.Module.requires_grad_``, then :func:`renew` (a graph module's own)."""
    result = nn.Module.requires_grad_(self, requires_grad)
    renew(self)
    return result
