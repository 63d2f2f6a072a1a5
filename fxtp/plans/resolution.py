"""Plan resolution: a style or a dict of FQN patterns -> styles, matched against a model.

Keys split on ``.``; each part is matched with ``fnmatch`` against the child names at that
depth (``layers.*.attention.wq``, ``net[1-2]``); ``""`` is the root module. Values may be
Hugging Face plan strings (``"colwise"``), and the plan ``"auto"`` is the model's own
Hugging Face plan (:mod:`fxtp.plans.huggingface`).
"""
from __future__ import annotations

import difflib
import warnings
from fnmatch import fnmatchcase
from typing import Callable, Mapping, Optional, Union

import torch.nn as nn
from torch.nn.utils import parametrize
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle as TorchStyle

from ..passes.errors import PlanError
from ..passes.graph import planned_placement
from .foreign_styles import ForeignStyle
from .huggingface import model_plan, styles_of
from .styles import (ColwiseParallel, ModuleSharding, ParallelStyle, RowwiseParallel,
                     from_torch, shard_module)

Plan = Union[ParallelStyle, Mapping[str, Union[ParallelStyle, str]], str]


def _matches(key: str, fqn: str) -> bool:
    if key == "" or fqn == "":
        return key == fqn
    parts, names = key.split("."), fqn.split(".")
    return len(parts) == len(names) and all(map(fnmatchcase, names, parts))


def carried_plan(model: nn.Module) -> dict:
    """The plan a Hugging Face ``model`` carries (``plan="auto"``,
    :func:`~fxtp.plans.huggingface.model_plan`), less its keys that match no module of ``model``:
    the plan covers the model's variants (Qwen3-MoE's names the dense MLPs a config may
    keep; Llama 4's names its layers both under and without the base model's prefix)."""
    fqns = [fqn for fqn, _ in model.named_modules()]
    return {key: style for key, style in model_plan(model).items()
            if any(_matches(key, fqn) for fqn in fqns)}


def module_fqns(model: nn.Module, patterns, what: str) -> list[str]:
    """The FQNs of ``model``'s modules matching any of ``patterns`` (plan-key syntax); a
    pattern matching none is a :class:`PlanError` naming ``what`` and the closest FQNs."""
    modules = [fqn for fqn, _ in model.named_modules()]
    found: dict[str, None] = {}
    for key in patterns:
        fqns = [fqn for fqn in modules if _matches(key, fqn)]
        if not fqns:
            close = _closest(key, [f for f in modules if f])
            raise PlanError(f"{what} {key!r} matches no module of {type(model).__name__}"
                            f"{'; closest module FQNs: ' + ', '.join(close) if close else ''}")
        found.update(dict.fromkeys(fqns))
    return list(found)


def _closest(key: str, fqns: list[str], n: int = 3) -> list[str]:
    """FQNs most like ``key``: most parts matched by its patterns, then most similar text."""
    parts = key.split(".")

    def score(fqn):
        names = fqn.split(".")
        matched = sum(map(fnmatchcase, names, parts)) if len(names) == len(parts) else 0
        return matched, difflib.SequenceMatcher(None, key, fqn).ratio()
    return sorted(fqns, key=score, reverse=True)[:n]


def resolve_plan(model: nn.Module, plan: Plan, strict: bool = False,
                 mesh_of: Optional[Callable[[], DeviceMesh]] = None
                 ) -> dict[str, ModuleSharding]:
    """Return FQN -> :class:`ModuleSharding` for every module the plan names. Styles may be
    fxtp's or ``torch.distributed.tensor.parallel``'s own objects, or another project's
    ``ParallelStyle`` s, read on the mesh ``mesh_of()`` gives
    (:class:`~fxtp.plans.foreign_styles.ForeignStyle`).

    A key that matches no module is skipped with a warning naming the key and the closest
    FQNs, as torch's ``parallelize_module`` does (plans are shared between model variants:
    torchtune's llama3 plan names an ``output`` its tied 3.2 models lack); with ``strict``
    it is a :class:`PlanError` (``"auto"`` drops such keys: :func:`carried_plan`). Raises
    :class:`PlanError` for a module matched by two keys,
    or a style that cannot handle the module's type.
    """
    if isinstance(plan, (ParallelStyle, TorchStyle)):
        plan = {"": plan}
    if plan == "auto":
        plan = carried_plan(model)
    if not isinstance(plan, Mapping):
        raise PlanError(f"plan must be a ParallelStyle, a dict FQN -> ParallelStyle (or "
                        f"Hugging Face plan string) or 'auto', got {plan!r}")
    plan = styles_of(plan)
    modules = dict(model.named_modules())
    resolved: dict[str, ModuleSharding] = {}
    matched_by: dict[str, str] = {}
    for key, style in plan.items():
        if isinstance(style, TorchStyle):
            style = from_torch(style) or ForeignStyle(style, mesh_of)
        if not isinstance(style, ParallelStyle):
            raise PlanError(f"plan[{key!r}] must be an fxtp parallel style "
                            f"(ColwiseParallel(), RowwiseParallel(), ...), got {style!r}")
        fqns = [fqn for fqn in modules if _matches(key, fqn)]
        if not fqns:
            close = _closest(key, [f for f in modules if f])
            hint = f"; closest module FQNs: {', '.join(close)}" if close else ""
            message = f"plan key {key!r} matches no module of {type(model).__name__}{hint}"
            if strict:
                raise PlanError(message + " (strict=True)")
            warnings.warn(f"fxtp: {message}; skipping it", stacklevel=3)
            continue
        for fqn in fqns:
            if fqn in resolved:
                raise PlanError(f"module '{fqn}' is matched by plan keys "
                                f"{matched_by[fqn]!r} and {key!r}; give each module one style")
            resolved[fqn] = shard_module(style, fqn, modules[fqn])
            matched_by[fqn] = key
            _warn_parametrized(fqn, modules[fqn], resolved[fqn])
    _follow_ties(model, resolved)
    return resolved


def _warn_parametrized(fqn: str, module: nn.Module, sharding: ModuleSharding) -> None:
    """A style's parameter that a parametrization computes (``weight_norm``,
    ``spectral_norm``) has no tensor of its own to shard: say that it is computed whole on
    every rank and sliced to the style's layout each step."""
    for name in sharding.params:
        if "." not in name and parametrize.is_parametrized(module, name):
            kinds = ", ".join(type(p).__name__ for p in module.parametrizations[name])
            warnings.warn(f"fxtp: module '{fqn}' computes its '{name}' by a parametrization "
                          f"({kinds}): its tensors stay whole on every rank, and the computed "
                          f"'{name}' is sliced to the {type(sharding.style).__name__} layout "
                          f"each step (its gradient gathered back)", stacklevel=4)


def _follow_ties(model: nn.Module, resolved: dict[str, ModuleSharding]) -> None:
    """A module left out of the plan that shares a planned module's parameter (an
    embedding tied to the LM head) gets the style that splits that parameter the same way,
    with its input and output replicated: a vocab-sharded weight makes the embedding a
    vocab-parallel lookup (``RowwiseParallel``) and the head colwise with its logits
    gathered. Other module types keep no style; the seed pass gives the shared tensor the
    planned placement under every name."""
    modules = dict(model.named_modules())
    for names in tied_names(model).values():
        planned = {fqn: planned_placement(resolved, fqn) for fqn in names}
        placements = {str(p): p for p in planned.values() if p is not None}
        if len(placements) != 1:
            continue  # nothing planned, or planned two ways (the seed pass says so)
        (placement,) = placements.values()
        for fqn in names:
            owner, _, name = fqn.rpartition(".")
            if owner in resolved or name != "weight":
                continue
            style = _tie_style(modules[owner], placement)
            if style is not None:
                resolved[owner] = shard_module(style, owner, modules[owner])


def _tie_style(module: nn.Module, placement) -> ParallelStyle | None:
    """The style that gives ``module.weight`` (vocab x dim) ``placement``, replicated in
    and out."""
    if not isinstance(placement, Shard) or placement.dim not in (0, 1):
        return None
    vocab = placement.dim == 0
    if isinstance(module, nn.Embedding):
        return RowwiseParallel(input_layouts=Replicate()) if vocab else \
            ColwiseParallel(output_layouts=Replicate())
    if isinstance(module, nn.Linear):
        return ColwiseParallel(output_layouts=Replicate()) if vocab else \
            RowwiseParallel(input_layouts=Replicate())
    return None


def block_fqns(model: nn.Module) -> list[str]:
    """FQNs of the elements of ``model``'s ``ModuleList`` s and ``ModuleDict`` s: its
    blocks."""
    return [f"{fqn}.{name}" if fqn else name for fqn, m in model.named_modules()
            if isinstance(m, (nn.ModuleList, nn.ModuleDict)) for name in m._modules]


def tied_names(model: nn.Module) -> dict[str, list[str]]:
    """Parameter FQN -> all FQNs of that tensor, for tensors registered under several."""
    names: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(fqn)
    return {fqn: group for group in names.values() if len(group) > 1 for fqn in group}
