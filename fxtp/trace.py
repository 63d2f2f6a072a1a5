"""Tracing: a single-device ``nn.Module`` -> an ATen-level ``fx.GraphModule``.

Uses ``torch.export`` (non-strict) so ordinary Python model code traces; every node keeps
``nn_module_stack`` (module FQNs) in ``node.meta`` and ``val`` (a fake tensor with the
global shape). Modules named by the plan keep their call boundaries: :class:`ModuleCall`
says which graph values are their inputs and outputs.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Optional

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.utils.checkpoint as cp
import torch.utils._pytree as pytree

from .passes.errors import TraceError
from .passes.graph import ModuleCall
from .passes.recompute import REGION


def trace(model: torch.nn.Module, args: tuple, kwargs: Optional[dict],
          boundaries: Iterable[str], dynamic_shapes=None, checkpointed: Iterable[str] = ()
          ) -> tuple[fx.GraphModule, dict[str, ModuleCall]]:
    """Trace ``model(*args, **kwargs)``; return the graph module and the calls of the
    modules in ``boundaries`` (FQNs; ``""`` is the root, whose inputs are placeholders).

    Activation-checkpoint regions (the model's non-reentrant ``torch.utils.checkpoint``
    calls, and every call of the modules named in ``checkpointed``) are marked on their
    nodes for :mod:`fxtp.passes.recompute`; their options are ``gm.meta[REGION]``."""
    boundaries = tuple(boundaries)
    regions: dict[int, dict] = {}
    try:
        with fx_traceback.preserve_node_meta(), _marking_checkpoints(model, checkpointed,
                                                                     regions):
            ep = torch.export.export(
                model, tuple(args), kwargs=kwargs or {}, strict=False,
                dynamic_shapes=dynamic_shapes,
                preserve_module_call_signature=tuple(b for b in boundaries if b))
    except Exception as e:  # noqa: BLE001 - re-raised with a hint
        raise TraceError(
            f"fxtp could not trace {type(model).__name__} with torch.export (non-strict): "
            f"{type(e).__name__}: {e}\nHint: data-dependent Python control flow and "
            f"non-tensor outputs are the usual causes; check that model(*example_inputs, "
            f"**example_kwargs) runs, and rewrite branches on tensor values with "
            f"torch.where / torch.cond.") from e
    gm = ep.module()
    _inline_grad_mode_regions(gm)
    _drop_export_guards(gm)
    gm = fx.GraphModule(gm, gm.graph)  # without export's input-shape check hooks
    gm.meta[REGION] = regions
    nodes = {n.name: n for n in gm.graph.nodes}

    def node_of(arg):
        return nodes.get(getattr(arg, "name", None))

    calls = {}
    signatures = {e.fqn: e.signature for e in ep.module_call_graph}
    for fqn in boundaries:
        if fqn == "":
            continue
        sig = signatures.get(fqn)
        if sig is None:
            raise TraceError(f"module '{fqn}' is named by the plan but torch.export recorded "
                             f"no call of it; is it called in forward()?")
        call_args, call_kwargs = pytree.tree_unflatten([node_of(a) for a in sig.inputs],
                                                        sig.in_spec)
        outputs = tuple(node_of(a) for a in sig.outputs)
        calls[fqn] = ModuleCall(tuple(call_args), dict(call_kwargs), outputs)
    return gm, calls


@contextlib.contextmanager
def _marking_checkpoints(model: torch.nn.Module, fqns: Iterable[str], regions: dict):
    """While tracing, mark the nodes of every non-reentrant checkpoint region (and of every
    call of the modules ``fqns``) with the region's number; ``regions`` gets each region's
    ``checkpoint`` options."""
    def region(options):
        number = len(regions)
        regions[number] = options
        return fx_traceback.annotate({REGION: number})

    def checkpoint_region(fn, preserve_rng_state=True, context_fn=cp.noop_context_fn,
                          determinism_check=cp._DEFAULT_DETERMINISM_MODE, debug=False,
                          *args, **kwargs):
        with region(dict(preserve_rng_state=preserve_rng_state, context_fn=context_fn,
                         determinism_check=determinism_check, debug=debug)):
            yield

    entered: list = []

    def enter(*_):
        entered.append(region({}))
        entered[-1].__enter__()

    def leave(*_):
        entered.pop().__exit__(None, None, None)
    hooks = [h for fqn in fqns for h in (model.get_submodule(fqn).register_forward_pre_hook(enter),
                                         model.get_submodule(fqn).register_forward_hook(leave))]
    original = cp._checkpoint_without_reentrant_generator
    cp._checkpoint_without_reentrant_generator = checkpoint_region
    try:
        yield
    finally:
        cp._checkpoint_without_reentrant_generator = original
        for hook in hooks:
            hook.remove()


def _inline_grad_mode_regions(gm: fx.GraphModule) -> None:
    """Inline ``torch.no_grad()`` / ``enable_grad()`` regions that export wraps in a
    higher-order op (Hugging Face computes rotary tables under no_grad), so their ops get
    placements like any other. Outputs of a no-grad region are detached, which keeps its
    meaning: nothing inside it receives gradients."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.target is not torch.ops.higher_order.wrap_with_set_grad_enabled:
            continue
        enabled, submod, *operands = node.args
        body = getattr(gm, submod.target).graph
        env = dict(zip([n for n in body.nodes if n.op == "placeholder"], operands))
        with graph.inserting_before(node):
            for inner in body.nodes:
                if inner.op == "placeholder":
                    continue
                if inner.op == "output":
                    outs = [env[o] for o in inner.args[0]]
                    break
                env[inner] = graph.node_copy(inner, lambda a: env[a])
            if not enabled:
                detached = []
                for out in outs:
                    d = graph.call_function(torch.ops.aten.detach.default, (out,))
                    d.meta.update(out.meta)
                    detached.append(d)
                outs = detached
        for user in list(node.users):
            user.replace_all_uses_with(outs[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
        graph.erase_node(submod)
        delattr(gm, submod.target)


def _drop_export_guards(gm: fx.GraphModule) -> None:
    """Remove the input-shape guard and metadata asserts export adds: fxtp's module takes
    local shards, whose shapes differ from the traced global ones."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
        elif node.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    gm.graph.lint()
