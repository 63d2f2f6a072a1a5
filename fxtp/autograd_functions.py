"""Custom ``torch.autograd.Function`` s keep their own backward through tracing.

``torch.export`` traces a ``Function.apply`` call into the ATen ops of its ``forward``:
autograd would then differentiate those ops, not run the function's ``backward``. Where the
two differ (a straight-through estimator, PhiMoE's router, a gradient reversal) the traced
program's gradients would be silently wrong. So while tracing, every call of a custom
function that records a gradient (grad mode on, an input requiring grad) is kept as one
node, whose target, :class:`Apply`, calls ``function.apply`` at run time: the function's
own forward and backward run, as on a single device. Propagation has no rule for such a
node: its inputs arrive replicated (gathered where they are not, a reported fallback) and
its outputs are replicated.

Calls whose arguments cannot be graph constants (a module, an object) are traced into their
forward, with a warning naming the function. torch's own functions are traced as before:
custom ops' generated autograd (each op stays a node) and ``torch.utils.checkpoint``'s
reentrant function (whose backward recomputes its forward).
"""
from __future__ import annotations

import contextlib
import importlib
import warnings

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

_FUNCTION_APPLY = torch.autograd.Function.apply.__func__


class Apply:
    """A graph target that calls ``function.apply(*args, **kwargs)``."""

    def __init__(self, function: type[torch.autograd.Function]):
        self.function = function
        self.__name__ = f"{function.__name__}_apply"

    def __call__(self, *args, **kwargs):
        return self.function.apply(*args, **kwargs)

    def __repr__(self):
        return f"{self.function.__module__}.{self.function.__qualname__}.apply"


@contextlib.contextmanager
def keeping_functions(kept: dict):
    """While ``torch.export`` traces, keep each custom function's call as one node;
    ``kept`` gets the functions by the name the node holds."""
    from torch._export.wrappers import allow_in_pre_dispatch_graph
    from torch._higher_order_ops.flat_apply import is_graphable
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
            with graph.inserting_before(node):
                call = graph.call_function(Apply(function), tuple(args[1:]), kwargs)
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
    from torch.export.custom_ops import _call_custom_autograd_function_in_pre_dispatch
    constant = getattr(module, func.target, None)  # the spec of a _ConstantFunction
    if isinstance(constant, pytree.TreeSpec) and constant.num_leaves == 0:
        constant = pytree.tree_unflatten([], constant)
    if getattr(constant, "func", None) is not _call_custom_autograd_function_in_pre_dispatch:
        return None
    owner, _, name = args[0].rpartition(".")
    function = getattr(importlib.import_module(owner), name, None)
    return function if isinstance(function, type) and \
        issubclass(function, torch.autograd.Function) else None
