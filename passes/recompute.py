"""Recompute pass: keep the model's activation-checkpoint regions in the per-rank program.

Tracing inlines ``torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False)``: the
graph computes ``fn`` like any other code, and would save every activation for backward.
The trace marks each checkpoint region's nodes (``node.meta["custom"][REGION]``, the
region's number); after the rewrite this pass moves each region, with the collectives the
rewrite put in it and the calls of outlined modules whose ops are all in it, into a
submodule ``checkpoint_<i>`` that the program calls through
``torch.utils.checkpoint.checkpoint`` (non-reentrant) with the region's own options, so
backward recomputes it as the single-device model would.

Collectives inside a region: the region's ``context_fn`` is the model's own where it gave
one (a selective-checkpoint policy); otherwise fxtp's :func:`save_collectives` policy, which
saves the results of collectives and recomputes everything else, so recomputation issues no
collective a second time. Values computed from parameters alone (hoisted before the
gradient-sync bucket) stay outside the regions.

:func:`fxtp.passes.modules.inline_program` undoes the pass (and the module outlining) on a
copy of the graph, for analyses that walk the whole program (:func:`fxtp.explain`).
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts, noop_context_fn)

from ..kernels.collectives import KINDS
from ..kernels.torch_compat import c10d_functional
from .context import PassContext
from .effects import written_through
from .graph import COLLECTIVE, RECOMPUTED, REGION, recompile_alone

PREFIX = "checkpoint_"

_COLLECTIVE_OPS = set(KINDS) | {c10d_functional.wait_tensor.default}


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _COLLECTIVE_OPS else \
        CheckpointPolicy.PREFER_RECOMPUTE


def save_collectives():
    """The default ``context_fn`` of a region: recompute everything but collectives."""
    return create_selective_checkpoint_contexts(_policy)


def run_checkpointed(region: fx.GraphModule, *inputs):
    """Call ``region`` under non-reentrant checkpointing with the options it was traced
    with (``region.checkpoint_options``)."""
    options = dict(region.checkpoint_options)
    if options.get("context_fn", noop_context_fn) is noop_context_fn:
        options["context_fn"] = save_collectives
    return checkpoint(region, *inputs, use_reentrant=False, **options)


def region_of(node: fx.Node) -> Optional[int]:
    return (node.meta.get("custom") or {}).get(REGION)


def outline_checkpoints(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Move each marked region into a checkpointed submodule; ``ctx.regions``: region
    number -> ``checkpoint`` keyword options. ``gm.meta[RECOMPUTED]``: the submodules the
    regions call (recomputed whole with them: their own marks are to be left alone)."""
    options, spans = ctx.regions, _spans(gm)
    called: list[nn.Module] = []
    for i, (region, span) in enumerate(spans):
        called += _outline(gm, span, options.get(region, {}), f"{PREFIX}{i}")
    if spans:
        gm.graph.lint()
        recompile_alone(gm)
    gm.meta[RECOMPUTED] = called
    return gm


def copy_written_collectives(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Give each collective result that a checkpoint region writes in place (directly or
    through a view) a copy for the writes, on the graph before outlining."""
    aten = torch.ops.aten
    for _, span in _spans(gm):
        for node in [n for n in span if COLLECTIVE in n.meta]:
            values = [u for u in node.users if u.target is operator.getitem] \
                if isinstance(node.meta.get("val"), (tuple, list)) else [node]
            for value in filter(written_through, values):
                with gm.graph.inserting_after(value):
                    copy = gm.graph.call_function(aten.clone.default, (value,))
                copy.meta = dict(value.meta)
                value.replace_all_uses_with(copy, delete_user_cb=lambda u: u is not copy)
    gm.graph.lint()
    recompile_alone(gm)
    return gm


def call_submodule(module: nn.Module, *args, **kwargs):
    """``module(*args, **kwargs)``: a region calls the submodules it does not hold."""
    return module(*args, **kwargs)


def _spans(gm: fx.GraphModule) -> list[tuple[int, list[fx.Node]]]:
    """Each region's nodes: everything in graph order from its first to its last node in the
    region (collectives the rewrite put between them included); a region inside another
    (nested checkpoints) joins the outer one. A region that is one module's call alone is
    left to that module's graph."""
    nodes = list(gm.graph.nodes)
    bounds: dict[int, list[int]] = {}
    regions = _regions(gm)
    for i, node in enumerate(nodes):
        if regions.get(node) is not None:
            bounds.setdefault(regions[node], [i, i])[1] = i
    spans, end = [], -1
    for region, (first, last) in sorted(bounds.items(), key=lambda item: item[1][0]):
        if first > end:
            spans.append((region, nodes[first:last + 1]))
            end = last
        elif last > end:  # overlapping without nesting: extend the previous span
            spans[-1] = (spans[-1][0], nodes[nodes.index(spans[-1][1][0]):last + 1])
            end = last
    return [(region, span) for region, span in spans
            if len(span) > 1 or span[0].op != "call_module"]


def _regions(gm: fx.GraphModule) -> dict[fx.Node, Optional[int]]:
    """The region of each node of ``gm``'s graph that computes: an op's mark, or for a call
    of an outlined module the one region all its ops are in. Reads of held tensors and what
    is computed of them alone, collectives and ``getitem`` are in none: they stay where the
    rewrite and the outliner put them."""
    held: set[fx.Node] = set()
    regions: dict[fx.Node, Optional[int]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" or node.op == "call_function" and node.all_input_nodes \
                and all(a in held for a in node.all_input_nodes):
            held.add(node)
        elif node.op == "call_function" and COLLECTIVE not in node.meta and \
                node.target is not operator.getitem:
            regions[node] = region_of(node)
        elif node.op == "call_module":
            called = gm.get_submodule(node.target)
            inner = set(_regions(called).values()) \
                if isinstance(called, fx.GraphModule) else {None}
            regions[node] = next(iter(inner)) if len(inner) == 1 else None
    return regions


def _outline(gm: fx.GraphModule, span: list[fx.Node], options: dict, name: str) -> None:
    """Parameters, buffers and the submodules called in the span are passed in: the region
    holds none (their owners stay theirs). Returns those submodules."""
    graph = gm.graph
    called = []
    for n in span:
        if n.op == "get_attr":
            span[0].prepend(n)
        elif n.op == "call_module":
            called.append(gm.get_submodule(n.target))
            with graph.inserting_before(span[0]):
                module = graph.get_attr(n.target)
            n.op, n.target, n.args = "call_function", call_submodule, (module, *n.args)
    span = [n for n in span if n.op != "get_attr"]
    inside = set(span)
    inputs = list(dict.fromkeys(a for n in span for a in n.all_input_nodes if a not in inside))
    outputs = [n for n in span if any(u not in inside for u in n.users)]
    body = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = body.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in span:
        env[n] = body.node_copy(n, env.__getitem__)
    body.output(tuple(env[o] for o in outputs))
    region = fx.GraphModule(gm, body, class_name="CheckpointRegion")
    region.checkpoint_options = options
    gm.add_submodule(name, region)
    with graph.inserting_before(span[0]):
        module = graph.get_attr(name)
        call = graph.call_function(run_checkpointed, (module, *inputs))
        call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
        results = []
        for i, out in enumerate(outputs):
            results.append(graph.call_function(operator.getitem, (call, i)))
            results[-1].meta.update(out.meta)
    for out, result in zip(outputs, results):
        out.replace_all_uses_with(result)
    for n in reversed(span):
        graph.erase_node(n)
    return called
