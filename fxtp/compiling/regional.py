"""Regional compilation: each distinct block compiled once, whatever the depth.

torchtitan compiles each transformer block on its own; every block runs the same
``forward``, so dynamo compiles it once and reuses the code for every instance, and
compile time does not grow with depth. fxtp's blocks are graph modules, each with its own
generated class and code, so both calls here first group the blocks whose programs are
equal (the stamped copies of a block, :mod:`fxtp.frontend.stamping`).

- :func:`compile` compiles the whole program with each block a nested compile region
  (``torch.compiler.nested_compile_region``), every block of a group running one
  stateless copy of the first: dynamo traces it once and stamps its subgraph for the
  others, inductor compiles it once, and the step runs one compiled program (no per-block
  call overhead, the code between blocks compiled too).
- :func:`compile_blocks` compiles each block on its own (``module.compile()``), the blocks
  of a group sharing the first one's classes, the program between blocks running eagerly:
  the form that composes with FSDP2's per-block hooks.
"""
from __future__ import annotations

import inspect
import types
import warnings
from typing import Iterable, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from ..edges.local_reads import read_attribute
from ..passes.errors import InputError
from .backend import NO_BUFFER_REUSE

from ..passes.complex_pairs import Unpaired, pair_complex
from ..passes.stateless import Stateful, stateless
from ..plans.resolution import block_fqns


def compile(gm: nn.Module, blocks: Optional[Iterable[str]] = None, **options) -> nn.Module:
    """``torch.compile(gm, **options)`` (a result of :func:`fxtp.parallelize`) with each
    block a nested compile region; ``blocks``: their FQNs (default: the outermost elements
    of ``gm``'s ``ModuleList`` s and ``ModuleDict`` s). Returns the compiled module.

    Blocks with equal programs run one stateless copy of the first
    (:func:`fxtp.passes.stateless.stateless`) that takes their tensors as arguments (local
    tensors: a region cannot take ``DTensor`` s), so dynamo traces it once and stamps the
    subgraph for the others, and inductor compiles it once: compile time barely grows
    with depth, and the step runs one compiled program. ``gm``'s blocks are marked in
    place; eager calls of ``gm`` run the same code with the same numbers. Complex values
    (Meta's rotary tables), which a region cannot differentiate through, are computed as
    real pairs (:func:`fxtp.passes.complex_pairs.pair_complex`). A block the copy cannot be
    made of (a module in it is not a graph module, an op on complex values has no pair
    form) is compiled inline, with a warning. With FSDP2 (``fully_shard`` per block) use
    :func:`compile_blocks`.

    Inductor compiles the program with ``allow_buffer_reuse=False`` unless ``options`` say
    otherwise: with reuse, torch 2.13's inductor gave wrong gradients through the regions
    (up to 140x on fxtp's Llama; ``aot_eager`` and the whole program compiled were right;
    pytorch/pytorch#193960, a reused region's backward overwriting a saved input)."""
    if options.get("backend") == "eager":
        raise InputError("fxtp.compile: a nested compile region needs AOT autograd, which "
                         "backend='eager' skips; use backend='aot_eager' to run the regions "
                         "uncompiled")
    groups = _equal_programs(gm, _outermost(list(blocks) if blocks is not None
                                            else block_fqns(gm)))
    region = _region(_run, len(groups) + 8)
    inline = {}
    for group in groups:
        try:
            copy, tensors = stateless(gm.get_submodule(group[0]))
            pair_complex(copy)
        except (Stateful, Unpaired) as e:
            inline.update(dict.fromkeys(group, str(e)))
            continue
        for fqn in group:
            block = gm.get_submodule(fqn)
            block.forward = types.MethodType(_calling(region, copy, tensors), block)
    if inline:
        warnings.warn("fxtp.compile: these blocks are compiled inline, not as regions, so "
                      "their compile time grows with their number (fxtp.compile_blocks "
                      "compiles each distinct block once): "
                      + "; ".join(f"{fqn} ({why})" for fqn, why in inline.items()))
    if options.get("backend", "inductor") == "inductor":  # the "fxtp" backend does it too
        options["options"] = {**NO_BUFFER_REUSE, **(options.get("options") or {})}
    return torch.compile(gm, **options)


def _region(fn, entries: int):
    """``fn`` as a nested compile region reusing up to ``entries`` traced bodies (torch
    2.11 has no such limit and no argument for it)."""
    mark = torch.compiler.nested_compile_region
    if "max_reuse_entries" in inspect.signature(mark).parameters:
        return mark(fn, max_reuse_entries=entries)
    return mark(fn)


def _run(copy, *args, **kwargs):
    """A block's region: its stateless copy called."""
    return copy(*args, **kwargs)


def _calling(region, copy: fx.GraphModule, tensors: list[str]):
    """A block's ``forward``: ``region`` runs ``copy`` on the block's tensors (``tensors``:
    their FQNs), local, then the block's arguments; complex tensors cross the region's
    boundary as real pairs (:mod:`fxtp.passes.complex_pairs`)."""
    def forward(self, *args, **kwargs):
        inputs = (*(read_attribute(self, t) for t in tensors), *args)
        return region(copy, *map(_pairs, inputs), **{k: _pairs(v) for k, v in kwargs.items()})
    return forward


def _pairs(x):
    """A complex tensor as its real pairs; anything else as it is."""
    if isinstance(x, torch.Tensor) and x.is_complex():
        return torch.view_as_real(x.resolve_conj())
    return x


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
    for group in _equal_programs(gm, fqns):
        first = gm.get_submodule(group[0])
        for fqn in group:
            block = gm.get_submodule(fqn)
            _share_classes(block, first)
            block.compile(**options)
    return fqns


def _equal_programs(gm: nn.Module, fqns: list[str]) -> list[list[str]]:
    """``fqns`` grouped by their blocks' equal programs, in order."""
    groups: dict[tuple, list[str]] = {}
    for fqn in fqns:
        groups.setdefault(_program(gm.get_submodule(fqn)), []).append(fqn)
    return list(groups.values())


def _outermost(fqns: list[str]) -> list[str]:
    """``fqns`` less those inside another of them (a region holds its nested blocks)."""
    return [f for f in fqns if not any(f.startswith(g + ".") for g in fqns)]


def _program(block: nn.Module) -> tuple:
    """What must be equal for two blocks to run one compiled code: each submodule's name
    and class, each graph module's nodes (op, target, arguments by position), and each
    tensor's name, shape, dtype, type and placement and which names share one tensor."""
    tensors = list(block.named_parameters(remove_duplicate=False)) + \
        list(block.named_buffers(remove_duplicate=False))
    first = {}
    return (tuple((name, _graph_program(m.graph) if isinstance(m, fx.GraphModule)
                   else type(m)) for name, m in block.named_modules()),
            tuple((name, t.shape, t.dtype, type(t), getattr(t, "placements", None),
                   t.requires_grad, first.setdefault(id(t), name)) for name, t in tensors))


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
    FSDP's)? ``GraphModule.__new__`` names each ``GraphModuleImpl``."""
    return cls.__qualname__.rsplit(".", 1)[-1] == "GraphModuleImpl"
