"""Training and eval mode: a program for each.

A trace records what ``forward`` did in the mode the model was in: ``nn.Dropout`` masked
or passed through, batch norm took the batch's or the running statistics, attention's
``dropout_p`` is what ``self.training`` chose. So ``gm.train(mode)`` / ``gm.eval()`` on a
result of :func:`fxtp.parallelize` switch every graph of its module tree to the program of
that mode, traced the first time it is asked for from a meta-device copy of the model
(its structure and attributes, no weights) taken when ``parallelize`` ran. Both programs
read the same parameters and buffers, so FSDP2, hooks and wrappers applied to the result
keep working across a switch. The first switch to a mode runs the passes again, with their
collectives: call it on every rank, like every other step of a tensor-parallel program.

Only the root's ``train`` switches programs: a submodule's mode set alone (``gm.layers[0]
.eval()``) does not change the program it runs. ``copy.deepcopy(gm)`` (an EMA model)
switches its own copies.
"""
from __future__ import annotations

import copy
import itertools
from typing import Callable, Optional

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule
import torch.nn as nn

from .passes.errors import TraceError
from .passes.graph import attr, keep_on_copy, own_method


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device (ties kept),
    everything else deep-copied."""
    memo = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) \
            else meta
    return copy.deepcopy(model, memo)


class Programs:
    """The graphs of each mode for the ``GraphModule`` s of one result's module tree, with
    the constants each graph reads besides the module's tensors and submodules."""

    def __init__(self, gm: fx.GraphModule, training: bool,
                 build: Optional[Callable[[bool], fx.GraphModule]], unbuildable: str = ""):
        self.modules = [(path, m) for path, m in gm.named_modules()
                        if isinstance(m, fx.GraphModule)]
        self.mode = training
        self.graphs = {training: [(m.graph, {}) for _, m in self.modules]}
        self.build, self.unbuildable = build, unbuildable

    def switch(self, training: bool) -> None:
        if training not in self.graphs:
            if self.build is None:
                raise TraceError(
                    f"this module was parallelized in {_name(self.mode)} mode and cannot "
                    f"trace its {_name(training)} program: {self.unbuildable}. Parallelize "
                    f"the model in the mode it runs in.")
            self.graphs[training] = self._adopt(self.build(training), training)
        for (_, module), (graph, constants) in zip(self.modules, self.graphs[training]):
            for name, value in constants.items():
                setattr(module, name, value)
            wrapped = type(module)  # fx's class of it, or a subclass a wrapper made (FSDP2)
            module.__class__ = next(c for c in wrapped.__mro__ if "forward" in vars(c))
            try:  # the code goes on fx's class: written on a subclass, it would call itself
                module.graph = graph
                _LazyGraphModule.force_recompile(module)
            finally:
                module.__class__ = wrapped
        self.mode = training

    def _adopt(self, other: fx.GraphModule, training: bool) -> list[tuple]:
        """``other``'s graphs, each reading the tensors and submodules of the module at its
        path here, and the constants each reads besides, under new names."""
        adopted = []
        renamed: dict[fx.Node, tuple] = {}  # (blocks stamped alike share one graph)
        for path, module in self.modules:
            theirs = _submodule(other, path)
            if not isinstance(theirs, fx.GraphModule):
                raise TraceError(
                    f"in {_name(training)} mode the model traces to another module tree "
                    f"('{path or '(the root)'}' is not a part of the program of its own "
                    f"there): parallelize the model in the mode it runs in.")
            constants = {}
            for node in theirs.graph.nodes:
                if node not in renamed and (node.op not in ("get_attr", "call_module") or
                                            _state(theirs, node.target)):
                    continue
                if node not in renamed:
                    renamed[node] = (f"_fxtp_{_name(training)}_{node.target.replace('.', '_')}",
                                     attr(theirs, node.target))
                    node.target = renamed[node][0]
                constants[renamed[node][0]] = renamed[node][1]
            adopted.append((theirs.graph, constants))
        return adopted


def _state(module: nn.Module, target: str) -> bool:
    """Is ``target`` one of ``module``'s parameters, buffers or submodules (which the
    module here holds at the same path)?"""
    owner, _, name = target.rpartition(".")
    holder = _submodule(module, owner)
    return holder is not None and (name in holder._parameters or name in holder._buffers or
                                   name in holder._modules)


def _submodule(module: nn.Module, path: str) -> Optional[nn.Module]:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _name(training: bool) -> str:
    return "training" if training else "eval"


def keep_programs(gm: fx.GraphModule, training: bool,
                  build: Optional[Callable[[bool], fx.GraphModule]], unbuildable: str = ""
                  ) -> None:
    """Make ``gm.train(mode)`` switch ``gm``'s module tree to ``mode``'s program;
    ``build(mode)``: a result of the same model and plan traced in that mode."""
    nn.Module.train(gm, training)
    gm._fxtp_programs = Programs(gm, training, build, unbuildable)
    keep_on_copy(gm, "_fxtp_programs")  # a copy (an EMA model) switches its own modules
    own_method(gm, "train", _train)


def _train(self, mode: bool = True):
    nn.Module.train(self, mode)
    programs = self.__dict__.get("_fxtp_programs")
    if programs is not None and programs.mode != mode:
        programs.switch(mode)
    return self
