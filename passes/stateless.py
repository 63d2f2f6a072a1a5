"""A stateless copy of a graph module tree: every tensor it reads is an argument.

:func:`stateless` copies a graph module and the graph modules it calls (outlined modules,
checkpointed regions, the submodules a region calls) into graph modules that hold no
tensor. Each ``get_attr`` of a parameter, buffer or constant becomes a leading argument,
and each call of a copied module passes that module's tensors first. So one copy can
run any module with an equal program, and a compiler region over it (a nested compile
region) reads no module state: its parameters come in as inputs. The originals are left
as they are.
"""
from __future__ import annotations

import keyword
import re
from typing import Optional

import torch
import torch.fx as fx
import torch.nn as nn

from .graph import READS, attr
from .recompute import call_submodule, run_checkpointed

MODULE_ARGUMENT = (run_checkpointed, call_submodule)
"""Functions a graph calls with a module as first argument (a ``get_attr`` of it)."""


class Stateful(Exception):
    """A module tree :func:`stateless` cannot copy: it calls a module that is not a graph
    module, or uses a module value other than by calling it."""


def stateless(gm: fx.GraphModule, bound: Optional[dict[int, nn.Module]] = None
              ) -> tuple[fx.GraphModule, list[str]]:
    """The stateless copy of ``gm`` and the FQNs (relative to ``gm``) of the tensors it
    takes, in the order it takes them, before ``gm``'s own arguments. ``bound``: the
    modules ``gm``'s callers pass it, by argument position (a checkpointed region is passed
    the submodules it calls); the copy holds their copies instead, and names their tensors
    ``<argN>.name``. Raises :class:`Stateful` where it cannot."""
    if not isinstance(gm, fx.GraphModule):
        raise Stateful(f"it is a {type(gm).__name__}, not a graph module")
    bound = bound or {}
    modules: dict[fx.Node, tuple[str, nn.Module]] = {}  # module-valued node -> (path, module)
    lifted: dict[str, None] = {}
    metas: dict[str, dict] = {}  # a tensor read here -> the meta of a node reading it
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, module in bound.items():
        modules[placeholders[i]] = (f"<arg{i}>", module)
    sites: dict[fx.Node, tuple[fx.GraphModule, list[str]]] = {}  # a call -> (copy, its tensors)
    for node in gm.graph.nodes:
        if READS in node.meta:  # a parameter, read through its owner's reads
            lifted[node.meta[READS]] = None
            metas.setdefault(node.meta[READS], node.meta)
        elif node.op == "get_attr":
            value = attr(gm, node.target)
            if isinstance(value, torch.Tensor):
                lifted[node.target] = None
                metas.setdefault(node.target, node.meta)
            elif isinstance(value, nn.Module):
                modules[node] = (node.target, value)
        elif node.op == "call_module" or (node.op == "call_function" and
                                          node.target in MODULE_ARGUMENT and
                                          _is_in(node.args[0], modules)):
            path, module = (node.target, gm.get_submodule(node.target)) \
                if node.op == "call_module" else modules[node.args[0]]
            args = node.args if node.op == "call_module" else node.args[1:]
            passed = {j: modules[a] for j, a in enumerate(args) if _is_in(a, modules)}
            try:
                copy, names = stateless(module, {j: m for j, (_, m) in passed.items()})
            except Stateful as e:
                raise Stateful(f"{path}: {e}") from None
            sites[node] = (copy, [_passed_name(n, path, passed) for n in names])
            lifted.update(dict.fromkeys(sites[node][1]))
    for node in gm.graph.nodes:  # a module may be called, or passed on by position alone
        positional = {a for a in node.args if isinstance(a, fx.Node)} if node in sites else ()
        if any(a in modules and a not in positional for a in node.all_input_nodes):
            raise Stateful(f"{node.format_node()} uses a module other than by calling it")

    graph = fx.Graph()
    attrs: dict[str, object] = {}  # what the copy holds, by dotted path
    taken = {n.target for n in placeholders}
    tensors = {fqn: graph.placeholder(_free(fqn, taken)) for fqn in lifted}
    for fqn, meta in metas.items():
        tensors[fqn].meta = dict(meta)
    env: dict[fx.Node, fx.Node] = {}

    def kept(args):  # the arguments a copy is called with: its module arguments held
        return fx.node.map_arg(tuple(a for a in args if not _is_in(a, modules)),
                               env.__getitem__)
    for node in gm.graph.nodes:
        if node in modules:
            continue
        if READS in node.meta:
            env[node] = tensors[node.meta[READS]]
        elif node.op == "get_attr" and node.users and all(READS in u.meta for u in node.users):
            continue  # the reads: the copy takes the parameters instead
        elif node.op == "get_attr" and node.target in tensors:
            env[node] = tensors[node.target]
        elif node in sites:
            copy, names = sites[node]
            attrs[node.name] = copy
            its_tensors = [tensors[n] for n in names]
            if node.op == "call_module":
                env[node] = graph.call_module(node.name, (*its_tensors, *kept(node.args)),
                                              _kwargs(node, env))
            else:
                env[node] = graph.call_function(
                    node.target, (graph.get_attr(node.name), *its_tensors,
                                  *kept(node.args[1:])), _kwargs(node, env))
            env[node].meta = node.meta
        else:
            if node.op == "get_attr":  # a constant that is not a tensor
                attrs[node.target] = attr(gm, node.target)
            env[node] = graph.node_copy(node, env.__getitem__)
    copy = fx.GraphModule(attrs, graph, class_name=f"Stateless{type(gm).__name__}")
    if hasattr(gm, "checkpoint_options"):
        copy.checkpoint_options = gm.checkpoint_options
    return copy, list(lifted)


def _is_in(arg, modules: dict) -> bool:
    return isinstance(arg, fx.Node) and arg in modules


def _kwargs(node: fx.Node, env: dict) -> dict:
    return fx.node.map_arg(dict(node.kwargs), env.__getitem__)


def _passed_name(name: str, path: str, passed: dict[int, tuple[str, nn.Module]]) -> str:
    """A tensor name of a called copy, as its caller names it: under the module passed at
    ``<argN>``, else under ``path`` (the called module's)."""
    for j, (module_path, _) in passed.items():
        if name.startswith(f"<arg{j}>."):
            return module_path + name[len(f"<arg{j}>"):]
    return f"{path}.{name}"


def _free(fqn: str, taken: set) -> str:
    """An argument name for the tensor ``fqn`` that no other argument has."""
    name = re.sub(r"\W", "_", fqn).strip("_") or "tensor"
    if name[0].isdigit() or keyword.iskeyword(name):
        name = "_" + name
    while name in taken:
        name += "_"
    taken.add(name)
    return name

