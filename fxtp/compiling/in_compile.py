"""Parallelize the plain model dynamo is compiling (``backend="fxtp"`` with a plan).

Dynamo hands the backend its graph of ``model.forward`` with the model's parameters and
buffers as inputs, and calls the compiled result with the current tensors on every call.
The replacement graph is :func:`fxtp.parallelize`'s program for the same call, reading
each parameter as :func:`fxtp.kernels.collectives.shard` of the full tensor passed in.

What it serves: inference, with each rank computing on its shards and the model's
parameters read afresh on every call. Training through it is correct but is not tensor
parallelism's saving: every rank keeps and updates full parameters, and the gradient of a
sharded parameter is all-gathered (``shard``'s backward) on every step. Train with
``torch.compile(fxtp.parallelize(model, ...))`` instead.

Requirements, each checked with an error saying what to change: ``torch.compile(model)``
of an ``nn.Module`` with ``fullgraph=True`` and static shapes (``dynamic=False``), and
outputs the plan leaves replicated.
"""
from __future__ import annotations

import inspect

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import Replicate

from ..kernels.torch_compat import compiled_frame, pytree
from ..passes.graph import PLACEMENT
from ..passes.modules import inline_program
from ..passes.placement import UnitShard, blocks, is_sharded

from ..kernels import collectives
from ..passes.errors import FxtpError
from ..pipeline import parallelize


def parallelize_dynamo_graph(gm: fx.GraphModule, example_inputs, plan, mesh) -> fx.GraphModule:
    """Dynamo's graph ``gm`` of ``model.forward`` -> this rank's graph, same inputs and
    outputs."""
    model, args, kwargs = _compiled_call()
    if any(not isinstance(x, torch.Tensor) for x in example_inputs):
        raise FxtpError("backend='fxtp' with a plan needs static shapes: pass dynamic=False "
                        "to torch.compile (each new input shape then compiles anew)")
    tp = parallelize(model, plan, mesh, example_inputs=args, example_kwargs=kwargs,
                     dtensor_params=False)  # dynamo passes the full parameters in
    if any(p is not None and p != Replicate() for p in tp.fxtp.output_placements):
        raise FxtpError(f"backend='fxtp' with a plan returns full outputs, but the plan leaves "
                        f"them {tp.fxtp.output_placements}: give the last planned module "
                        f"output_layouts=Replicate()")
    graph = fx.Graph()
    inputs = {}
    for node, x in zip([n for n in gm.graph.nodes if n.op == "placeholder"], example_inputs):
        inputs[id(x)] = graph.placeholder(node.name)
        inputs[id(x)].meta["example_value"] = node.meta.get("example_value")
    leaves = iter(pytree.tree_leaves((args, kwargs)))
    env: dict[fx.Node, object] = {}
    info = tp.fxtp
    for node in inline_program(tp).nodes:  # one graph: modules and regions inlined
        if node.op == "placeholder":
            leaf = next(leaves)
            env[node] = inputs[id(leaf)] if isinstance(leaf, torch.Tensor) else leaf
        elif node.op == "get_attr" and _state(model, node.target) is not None:
            full = inputs.get(id(_state(model, node.target)))
            if full is None:
                raise FxtpError(f"dynamo did not pass '{node.target}' to the backend; "
                                f"backend='fxtp' with a plan cannot shard it")
            env[node] = _shard(graph, full, node.meta[PLACEMENT], info)
        elif node.op == "output":
            outs = pytree.tree_leaves(node.args[0])
            _check_outputs(gm, outs)
            graph.output(tuple(env[o] for o in outs))
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
    return fx.GraphModule(tp, graph)


def _shard(graph: fx.Graph, full: fx.Node, placement, info) -> fx.Node:
    """This rank's part of a full parameter, as a differentiable collective."""
    if not is_sharded(placement):
        return full
    if isinstance(placement, UnitShard):
        return graph.call_function(collectives.shard_units, (full,), dict(
            dim=placement.dim, units=placement.units, rank=info.rank, world=info.world_size,
            group=info.group))
    return graph.call_function(collectives.shard, (full,), dict(
        dim=placement.dim, rank=info.rank, world=info.world_size, group=info.group,
        blocks=blocks(placement)))


def _compiled_call() -> tuple[nn.Module, list, dict]:
    """The module whose ``forward`` dynamo is compiling, and the arguments of the call."""
    f_locals, f_code, one_graph = compiled_frame()
    model = f_locals.get("self")
    if not isinstance(model, nn.Module) or f_code is not type(model).forward.__code__:
        raise FxtpError("backend='fxtp' with a plan compiles a model: call "
                        "torch.compile(model, backend='fxtp', options={'plan': ...}) on the "
                        "nn.Module itself")
    if not one_graph:
        raise FxtpError("backend='fxtp' with a plan needs the whole forward in one graph: pass "
                        "fullgraph=True to torch.compile")
    args, kwargs = [], {}
    for name, param in inspect.signature(model.forward).parameters.items():
        value = f_locals[name]
        if param.kind is param.VAR_POSITIONAL:
            args.extend(value)
        elif param.kind is param.VAR_KEYWORD:
            kwargs.update(value)
        elif param.kind is param.KEYWORD_ONLY:
            kwargs[name] = value
        else:
            args.append(value)
    return model, args, kwargs


def _state(model: nn.Module, fqn: str):
    """The model's parameter or buffer named ``fqn``, else ``None``."""
    owner, _, name = fqn.rpartition(".")
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        return None
    return module._parameters.get(name, module._buffers.get(name))


def _check_outputs(gm: fx.GraphModule, outs: list) -> None:
    expected = [getattr(o, "meta", {}).get("example_value")
                for o in pytree.tree_leaves(next(iter(reversed(gm.graph.nodes))).args[0])]
    got = [getattr(o, "meta", {}).get("val") for o in outs]
    shapes = [tuple(getattr(v, "shape", ())) for v in expected], \
        [tuple(getattr(v, "shape", ())) for v in got]
    if shapes[0] != shapes[1]:
        raise FxtpError(f"backend='fxtp' with a plan: dynamo's graph returns shapes "
                        f"{shapes[0]}, fxtp's program {shapes[1]}; the model's outputs must "
                        f"be tensors returned by forward (no buffer updates)")
