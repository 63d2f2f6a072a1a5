"""Custom ``torch.autograd.Function`` s keep their own backward through tracing.

``torch.export`` traces a ``Function.apply`` call into the ATen ops of its ``forward``:
autograd would then differentiate those ops, not run the function's ``backward``. Where the
two differ (a straight-through estimator, PhiMoE's router, a gradient reversal) the traced
program's gradients would be silently wrong. So while tracing, every call of a custom
function that records a gradient (grad mode on, an input requiring grad) is kept as one
node, whose target, :class:`Apply`, calls ``function.apply`` at run time: the function's
own forward and backward run, as on a single device. Propagation has no rule for such a
node: its inputs arrive replicated (gathered where they are not, a reported fallback) and
its outputs are replicated; unless the function is elementwise (BLOOM's GeLU), which is
checked mechanically: its forward and its backward, traced on the call's shapes, run only
ops torch tags pointwise on tensors of one shape (and scalars). Such a call is sharded as a
pointwise op is.

Calls whose arguments cannot be graph constants (a module, an object) are traced into their
forward, with a warning naming the function. torch's own functions are traced as before:
custom ops' generated autograd (each op stays a node) and ``torch.utils.checkpoint``'s
reentrant function (whose backward recomputes its forward).
"""
from __future__ import annotations

import contextlib
import importlib
import warnings
from typing import Optional

import torch
import torch.fx as fx

from ..kernels.torch_compat import disable_current_modes, pytree

_FUNCTION_APPLY = torch.autograd.Function.apply.__func__


class Apply:
    """A graph target that calls ``function.apply(*args, **kwargs)``. ``elementwise``: the
    function was found elementwise on the call's inputs (:func:`is_elementwise`), which
    propagation reads to shard the call as a pointwise op."""

    def __init__(self, function: type[torch.autograd.Function], elementwise: bool = False):
        self.function = function
        self.elementwise = elementwise
        self.__name__ = f"{function.__name__}_apply"

    def __call__(self, *args, **kwargs):
        return self.function.apply(*args, **kwargs)

    def __repr__(self):
        return f"{self.function.__module__}.{self.function.__qualname__}.apply"


@contextlib.contextmanager
def keeping_functions(kept: dict):
    """While ``torch.export`` traces, keep each custom function's call as one node;
    ``kept`` gets the functions by the name the node holds."""
    from ..kernels.torch_compat import allow_in_pre_dispatch_graph, is_graphable
    keep = allow_in_pre_dispatch_graph(_FUNCTION_APPLY)

    def apply(cls, *args, **kwargs):
        leaves = pytree.tree_leaves((args, kwargs))
        records_gradient = torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in leaves)
        if not torch.compiler.is_exporting() or cls.__module__.partition(".")[0] == "torch" \
                or not records_gradient:
            return _FUNCTION_APPLY(cls, *args, **kwargs)
        odd = [type(a).__name__ for a in leaves if not is_graphable(a)]
        if odd:
            warnings.warn(
                f"fxtp traces {cls.__module__}.{cls.__qualname__}.apply into its forward: "
                f"its arguments include {', '.join(sorted(set(odd)))}, which a graph cannot "
                f"hold, so autograd differentiates the forward's ops instead of running "
                f"the function's backward (the same gradient only where that backward is "
                f"the forward's derivative). Pass it tensors and plain constants to keep it.",
                stacklevel=2)
            return _FUNCTION_APPLY(cls, *args, **kwargs)
        kept[f"{cls.__module__}.{cls.__qualname__}"] = cls
        return keep(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = classmethod(_FUNCTION_APPLY)


def call_kept_functions(gm: fx.GraphModule, kept: dict) -> None:
    """Replace the ``flat_apply`` nodes :func:`keeping_functions` left in ``gm`` (and in its
    sub-graphs) by calls of :class:`Apply` with the original arguments."""
    for module in list(gm.modules()):
        if not isinstance(module, fx.GraphModule):
            continue
        graph = module.graph
        replaced = []  # the get_attr nodes of the calls replaced
        for node in list(graph.nodes):
            if node.target is not torch.ops.higher_order.flat_apply:
                continue
            func, spec, *flat = node.args
            args, kwargs = pytree.tree_unflatten(flat, getattr(module, spec.target))
            function = _function_called(module, func, args, kept)
            if function is None:
                continue  # not a function's call: left for the trace to reject, naming it
            elementwise = is_elementwise(function, [_example(a) for a in args[1:]], kwargs)
            with graph.inserting_before(node):
                call = graph.call_function(Apply(function, elementwise), tuple(args[1:]),
                                           kwargs)
            call.meta.update(node.meta)
            replaced += (func, spec)
            node.replace_all_uses_with(call)
            graph.erase_node(node)
            for attr_node in (func, spec):
                if not attr_node.users:
                    graph.erase_node(attr_node)
        read = {node.target for node in graph.nodes if node.op == "get_attr"}
        for name in {n.target for n in replaced} - read:  # two calls may share one spec
            if hasattr(module, name):
                delattr(module, name)
        module.recompile()


def _function_called(module: fx.GraphModule, func: fx.Node, args: tuple, kept: dict):
    """The ``autograd.Function`` a ``flat_apply`` node calls: one :func:`keeping_functions`
    kept, or one whose ``apply`` export itself keeps by name (torch's
    ``allow_in_pre_dispatch_graph``: ``ModIndex``, the indexing of mask functions under
    ``vmap`` that transformers' masks use); ``None`` for any other ``flat_apply``."""
    if not (args and isinstance(args[0], str)):
        return None
    if args[0] in kept:
        return kept[args[0]]
    from ..kernels.torch_compat import call_custom_autograd_function_in_pre_dispatch
    constant = getattr(module, func.target, None)  # the spec of a _ConstantFunction
    if isinstance(constant, pytree.TreeSpec) and constant.num_leaves == 0:
        constant = pytree.tree_unflatten([], constant)
    if getattr(constant, "func", None) is not call_custom_autograd_function_in_pre_dispatch:
        return None
    owner, _, name = args[0].rpartition(".")
    function = getattr(importlib.import_module(owner), name, None)
    return function if isinstance(function, type) and \
        issubclass(function, torch.autograd.Function) else None


def _example(arg):
    """A graph argument's traced value (a fake tensor), or the constant itself."""
    return arg.meta.get("val") if isinstance(arg, fx.Node) else arg


def _example_shape(tensor: torch.Tensor) -> Optional[tuple]:
    """``tensor``'s shape, a dynamic dim at the size it was traced with (``None``: a size
    no example gave)."""
    hints = tuple(d.node.hint if isinstance(d, torch.SymInt) else d for d in tensor.shape)
    return None if None in hints else hints


class _Context:
    """The ``ctx`` of a function traced by :func:`is_elementwise`."""

    def __init__(self, needs):
        self.needs_input_grad = needs
        self.saved_tensors = ()
        self.materialize_grads = True

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors):
        pass

    def set_materialize_grads(self, value):
        self.materialize_grads = value


_aten = torch.ops.aten
_SHAPE_KEEPING = frozenset({  # a copy, or a constant, of a tensor's shape
    _aten.detach.default, _aten.clone.default, _aten._to_copy.default, _aten.alias.default,
    _aten.lift_fresh_copy.default, _aten.ones_like.default, _aten.zeros_like.default,
    _aten.full_like.default, _aten.empty_like.default})


def is_elementwise(function: type[torch.autograd.Function], args: list, kwargs: dict) -> bool:
    """Whether ``function``'s forward and backward, traced together on fake tensors shaped
    as ``args``' tensors (all of one shape, the outputs too), run only ATen ops torch tags
    pointwise (random ones excluded), copies of a tensor or constants of its shape, on
    values of that shape or single elements: then each element of the outputs and of the
    input gradients depends only on the same element of the inputs and output gradients,
    and a shard computes its part of the whole. Anything else (another shape, a reduction, a view, a
    function that cannot be traced so) is ``False``."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from ..passes.rules import is_tagged_pointwise
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    shapes = {tuple(map(str, args[i].shape)) for i in positions}  # dims may be symbols
    if kwargs or len(shapes) != 1 or \
            not all(args[i].is_floating_point() for i in positions):
        return False
    shape = _example_shape(args[positions[0]])
    if shape is None:
        return False
    custom_setup = function.setup_context is not torch.autograd.Function.setup_context

    def forward_and_backward(*tensors):
        given = list(args)
        for i, t in zip(positions, tensors):
            given[i] = t
        ctx = _Context(tuple(i in positions for i in range(len(given))))
        if custom_setup:
            out = function.forward(*given)
            function.setup_context(ctx, tuple(given), out)
        else:
            out = function.forward(ctx, *given)
        outs = out if isinstance(out, tuple) else (out,)
        grads = function.backward(ctx, *[torch.ones_like(o) for o in outs])
        return outs, grads if isinstance(grads, tuple) else (grads,)
    try:
        with disable_current_modes(), torch.enable_grad():
            meta = [torch.empty(shape, dtype=args[i].dtype, device="meta") for i in positions]
            traced = make_fx(forward_and_backward, tracing_mode="fake")(*meta)
    except Exception:  # noqa: BLE001 - a function that cannot be traced so is not shown
        return False      # elementwise
    for node in traced.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and tuple(value.shape) != shape and \
                value.numel() != 1:
            return False
        if node.op == "call_function" and node.target not in _SHAPE_KEEPING and \
                not is_tagged_pointwise(node.target):
            return False
    outputs = pytree.tree_leaves(next(iter(traced.graph.find_nodes(op="output"))).args)
    return all(not isinstance(o, fx.Node) or tuple(o.meta["val"].shape) == shape
               for o in outputs)
