"""The model's hooks through tracing.

Tracing runs the model's Python once and records the tensor ops it runs; a hook either
becomes part of that program or would silently stop running. So:

* a gradient hook a ``forward`` registers on a tensor (``h.register_hook(fn)``) is kept:
  :func:`keeping_gradient_hooks` records each as a marker node, and
  :func:`call_gradient_hooks` makes it a :class:`GradientHooks` node that every reader of
  the tensor reads through, whose backward runs the tensor's hooks in the order they were
  registered on its gradient, as on a single device. Propagation has no rule for that
  node: the tensor arrives replicated (gathered where it is sharded, a reported fallback),
  so a hook sees the whole gradient, as it would on one device;
* forward hooks and pre-hooks on the model's modules (or global ones) are traced into the
  program: what they compute, it computes; what they do besides (store an activation,
  count calls) happened once, while tracing. :func:`check_model_hooks` warns, naming the
  modules;
* backward hooks on the model's modules (or global ones) would not run at all:
  :func:`check_model_hooks` refuses them, naming the module;
* hooks on the model's parameters stay on them, and the result holds parameters of its
  own: :func:`check_model_hooks` warns, naming the parameters.

The per-rank module keeps the planned modules as submodules (``gm.get_submodule(fqn)``),
so a hook meant to run on every call is registered there after ``parallelize``; it sees
that rank's local tensors.
"""
from __future__ import annotations

import collections
import contextlib
import warnings

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.node import has_side_effect
from torch.utils.hooks import RemovableHandle

from ..passes.errors import TraceError

_REGISTER_HOOK = torch.Tensor.register_hook


@torch.library.custom_op("fxtp::gradient_hook", mutates_args=())
def _gradient_hook(x: torch.Tensor, key: int) -> torch.Tensor:
    """Marks that hook ``key`` was registered on ``x`` while tracing; every mark is replaced
    by :func:`call_gradient_hooks`."""
    return x.clone()


@_gradient_hook.register_fake
def _(x, key):
    return torch.empty_like(x)


has_side_effect(torch.ops.fxtp.gradient_hook.default)  # its output is unused: kept anyway


class _RunHooks(torch.autograd.Function):
    """Identity whose backward runs ``hooks`` on the gradient, each on what the one before
    returned (``None``: unchanged), as ``Tensor.register_hook`` does."""

    @staticmethod
    def forward(ctx, x, hooks):
        ctx.hooks = hooks
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        for hook in ctx.hooks:
            changed = hook(grad)
            grad = grad if changed is None else changed
        return grad, None


class GradientHooks:
    """A graph target: ``x`` unchanged, whose gradient goes through ``hooks``."""

    __name__ = "gradient_hooks"

    def __init__(self, hooks: tuple):
        self.hooks = hooks

    def __call__(self, x):
        return _RunHooks.apply(x, self.hooks)

    def __repr__(self):
        return f"gradient_hooks({', '.join(map(_name, self.hooks))})"


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


@contextlib.contextmanager
def keeping_gradient_hooks(hooks: collections.OrderedDict):
    """While ``torch.export`` traces, each hook registered on a tensor that records a
    gradient goes into ``hooks`` (key -> hook; an ``OrderedDict``, which the handles refer
    to weakly) and leaves a marker node in the graph; the
    handle returned removes it, as ``Tensor.register_hook``'s does."""
    def register_hook(tensor, hook):
        if not (torch.compiler.is_exporting() and tensor.requires_grad and
                torch.is_grad_enabled()):
            return _REGISTER_HOOK(tensor, hook)
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        torch.ops.fxtp.gradient_hook(tensor, handle.id)
        return handle

    torch.Tensor.register_hook = register_hook
    try:
        yield
    finally:
        torch.Tensor.register_hook = _REGISTER_HOOK


def call_gradient_hooks(gm: fx.GraphModule, hooks: dict) -> None:
    """Replace the markers :func:`keeping_gradient_hooks` left in ``gm`` (and in its
    sub-graphs): each marked tensor gets one :class:`GradientHooks` node with its hooks in
    registration order, placed before the tensor's first reader, and every reader reads
    it instead."""
    for module in list(gm.modules()):
        if not isinstance(module, fx.GraphModule):
            continue
        graph = module.graph
        marked: dict[fx.Node, tuple[dict, list]] = {}  # tensor -> (first mark's meta, hooks)
        for node in list(graph.nodes):
            if node.target is torch.ops.fxtp.gradient_hook.default:
                tensor, key = node.args
                meta, its_hooks = marked.setdefault(tensor, (dict(node.meta), []))
                if key in hooks:  # else removed by its handle before the trace ended
                    its_hooks.append(hooks[key])
                graph.erase_node(node)
        for tensor, (meta, its_hooks) in marked.items():
            if not (its_hooks and tensor.users):
                continue
            first = min(tensor.users)  # nodes order as they stand in the graph
            with graph.inserting_before(first):
                call = graph.call_function(GradientHooks(tuple(its_hooks)), (tensor,))
            call.meta.update(meta, val=tensor.meta.get("val"))
            tensor.replace_all_uses_with(call, delete_user_cb=lambda user: user is not call)
        if marked:
            module.recompile()


def check_model_hooks(model: nn.Module) -> None:
    """Refuse backward hooks on ``model``'s modules, warn of forward hooks and of hooks on
    its parameters (see the module's docstring)."""
    module_hooks = nn.modules.module
    backward = [fqn or "(the model)" for fqn, m in model.named_modules()
                if m._backward_hooks or m._backward_pre_hooks]
    if backward or module_hooks._global_backward_hooks or \
            module_hooks._global_backward_pre_hooks:
        where = f"module '{backward[0]}'" if backward else "every module (a global hook)"
        raise TraceError(
            f"{where} has backward hooks (register_full_backward_hook / "
            f"register_full_backward_pre_hook), which fxtp's traced program would not "
            f"run. Remove them before parallelize and register them on the result "
            f"(gm.get_submodule(fqn) of a planned module), where they see this rank's "
            f"local gradients.")
    forward = [fqn or "(the model)" for fqn, m in model.named_modules()
               if m._forward_hooks or m._forward_pre_hooks]
    if module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks:
        forward.append("every module (a global hook)")
    if forward:
        warnings.warn(
            f"fxtp traces the forward hooks of {_listed(forward)} into its program: what "
            f"they return is computed by it, but what else they do (store an activation, "
            f"count calls) ran once, while tracing. To run a hook on every call, register "
            f"it on the result after parallelize (gm.get_submodule(fqn) of a planned "
            f"module), where it sees this rank's local tensors.", stacklevel=3)
    hooked = [name for name, p in model.named_parameters()
              if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)]
    if hooked:
        warnings.warn(
            f"the hooks on parameter{'s' if len(hooked) > 1 else ''} {_listed(hooked)} stay "
            f"on the model's parameters; the result holds parameters of its own. Register "
            f"them on the result's parameters (gm.get_parameter(name)).", stacklevel=3)


def _listed(names: list) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:4])
    return shown + (f" and {len(names) - 4} more" if len(names) > 4 else "")
