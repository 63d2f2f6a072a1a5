"""Regional compilation: ``torch.compile`` per block, each distinct block compiled once.

torchtitan compiles each transformer block on its own; every block runs the same
``forward``, so dynamo compiles it once and reuses the code for every instance, and
compile time does not grow with depth. fxtp's blocks are graph modules, each with its own
generated class and code: :func:`compile_blocks` first lets blocks whose programs are
equal (the stamped copies of a block, :mod:`fxtp.stamping`) share the first one's
classes, then compiles each block. The program between blocks runs eagerly.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch.fx as fx
import torch.nn as nn
from torch.fx._lazy_graph_module import _LazyGraphModule

from .plan import block_fqns


def compile_blocks(gm: nn.Module, blocks: Optional[Iterable[str]] = None,
                   **options) -> list[str]:
    """Compile each block of ``gm`` (a result of :func:`fxtp.parallelize`) in place with
    ``module.compile(**options)`` (``torch.compile``'s options); ``blocks``: their FQNs
    (default: the elements of ``gm``'s ``ModuleList`` s and ``ModuleDict`` s). Returns
    the FQNs compiled.

    Blocks with equal programs (node for node, submodule for submodule) share the graph
    module classes of the first of them, so each distinct block is compiled once. Call it
    after :func:`fxtp.parallelize` and activation-checkpoint wrapping and before
    ``fully_shard``, as torchtitan orders them. A block's graph edited afterwards must be
    recompiled on a class of its own (``type(m)`` is shared)."""
    fqns = list(blocks) if blocks is not None else block_fqns(gm)
    first: dict[tuple, nn.Module] = {}
    for fqn in fqns:
        block = gm.get_submodule(fqn)
        key = _program(block)
        if key in first:
            _share_classes(block, first[key])
        else:
            first[key] = block
        block.compile(**options)
    return fqns


def _program(block: nn.Module) -> tuple:
    """What must be equal for two blocks to run one compiled code: each submodule's name
    and class, and each graph module's nodes (op, target, arguments by position)."""
    return tuple((name, _graph_program(m.graph) if isinstance(m, fx.GraphModule)
                  else type(m)) for name, m in block.named_modules())


def _graph_program(graph: fx.Graph) -> tuple:
    position = {n: i for i, n in enumerate(graph.nodes)}
    return tuple((n.op, None if n.op == "placeholder" else str(n.target),
                  repr(fx.node.map_arg((n.args, n.kwargs), position.__getitem__)))
                 for n in graph.nodes)


def _share_classes(block: nn.Module, like: nn.Module) -> None:
    """Give each graph module of ``block`` the class of its counterpart in ``like`` (the
    classes ``GraphModule`` makes per instance, holding the generated ``forward``)."""
    for (_, mine), (_, theirs) in zip(block.named_modules(), like.named_modules()):
        if isinstance(mine, fx.GraphModule) and _generated(type(mine)) and \
                _generated(type(theirs)):
            mine.__class__ = type(theirs)


def _generated(cls: type) -> bool:
    """Is ``cls`` the class a graph module was made with (not one wrapping it, e.g.
    FSDP's)?"""
    return cls.__bases__ in ((fx.GraphModule,), (_LazyGraphModule,))
