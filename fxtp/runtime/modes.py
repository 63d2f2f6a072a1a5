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

A block's mode can be set alone (``gm.layers[0].eval()``): every ``GraphModule`` at and
below it switches, the rest of the tree keeps its program. That is allowed where the
block's inputs and outputs have the same placements in both modes' programs; where they
differ, the parts could not be joined and it is refused (set the mode on the root).
``copy.deepcopy(gm)`` (an EMA model) switches its own copies.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch.fx as fx
import torch.nn as nn

from ..edges.local_reads import LEAVES
from ..kernels.torch_compat import LazyGraphModule, pytree
from ..passes.errors import TraceError
from ..passes.graph import PLACEMENT, attr, keep_on_copy, own_method


class Programs:
    """The graphs of each mode for the ``GraphModule`` s of one result's module tree, with
    the constants each graph reads besides the module's tensors and submodules."""

    def __init__(self, gm: fx.GraphModule, training: bool,
                 build: Optional[Callable[[bool], fx.GraphModule]], unbuildable: str = ""):
        self.modules = [(path, m) for path, m in gm.named_modules()
                        if isinstance(m, fx.GraphModule)]
        self.traced_in = training
        self.modes = {path: training for path, _ in self.modules}
        self.graphs = {training: [(m.graph, {}) for _, m in self.modules]}
        self.build, self.unbuildable = build, unbuildable

    def switch(self, training: bool, within: str = "") -> None:
        """Run ``training``'s program in the ``GraphModule`` at ``within`` (a path, the
        root by default) and every one below it."""
        if all(mode == training for path, mode in self.modes.items() if _below(path, within)):
            return
        if training not in self.graphs:
            if self.build is None:
                raise TraceError(
                    f"this module was parallelized in {_name(self.traced_in)} mode and "
                    f"cannot trace its {_name(training)} program: {self.unbuildable}. "
                    f"Parallelize the model in the mode it runs in.")
            self.graphs[training] = self._adopt(self.build(training), training)
        if within:
            self._check_joins(within, training)
        for (path, module), (graph, constants) in zip(self.modules, self.graphs[training]):
            if not _below(path, within) or self.modes[path] == training:
                continue
            self.modes[path] = training
            for name, value in constants.items():
                setattr(module, name, value)
            wrapped = type(module)  # fx's class of it, or a subclass a wrapper made (FSDP2)
            module.__class__ = next(c for c in wrapped.__mro__ if "forward" in vars(c))
            try:  # the code goes on fx's class: written on a subclass, it would call itself
                module.graph = graph
                LazyGraphModule.force_recompile(module)
            finally:
                module.__class__ = wrapped

    def _check_joins(self, path: str, training: bool) -> None:
        """Refuse to switch the part at ``path`` alone where its inputs' or outputs'
        placements differ between the two programs."""
        index = [p for p, _ in self.modules].index(path)
        current = self.modes[path]
        ends = {mode: _boundary(self.graphs[mode][index][0]) for mode in (current, training)}
        if ends[current] != ends[training]:
            raise TraceError(
                f"'{path}' cannot run its {_name(training)} program alone: its inputs and "
                f"outputs are laid out {ends[training]} there and {ends[current]} in the "
                f"{_name(current)} program the rest of the model runs. Set the mode on the "
                f"whole result (gm.train() / gm.eval()).")

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


def _boundary(graph: fx.Graph) -> tuple:
    """The placements of ``graph``'s inputs and of what it returns."""
    nodes = list(graph.nodes)
    outputs = [a for a in pytree.tree_leaves(nodes[-1].args)
               if isinstance(a, fx.Node)]
    return tuple(str(n.meta.get(PLACEMENT)) for n in nodes if n.op == "placeholder"), \
        tuple(str(n.meta.get(PLACEMENT)) for n in outputs)


def _below(path: str, within: str) -> bool:
    return not within or path == within or path.startswith(within + ".")


def _state(module: nn.Module, target: str) -> bool:
    """Is ``target`` one of ``module``'s parameters, buffers or submodules, or the reads of
    its parameters (which the module here holds at the same path)?"""
    owner, _, name = target.rpartition(".")
    holder = _submodule(module, owner)
    return holder is not None and (name in holder._parameters or name in holder._buffers or
                                   name in holder._modules or name == LEAVES)


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
    programs = Programs(gm, training, build, unbuildable)
    for path, module in programs.modules:
        module._fxtp_programs = (programs, path)
        keep_on_copy(module, "_fxtp_programs")  # a copy (an EMA model) switches its own
        own_method(module, "train", _train)


def _train(self, mode: bool = True):
    """``nn.Module.train``, after switching the ``GraphModule`` s at and below this one to
    ``mode``'s program."""
    programs, path = self.__dict__["_fxtp_programs"]
    programs.switch(mode, path)
    return nn.Module.train(self, mode)
