"""Hugging Face tensor-parallel plans: ``"auto"`` (the model's own plan) and plan strings.

A Hugging Face model carries its plan: ``config.base_model_tp_plan`` (FQN patterns under the
base model -> style strings) and its head class's ``_tp_plan`` (``lm_head``); transformers
merges them, base model prefix included, as ``model.tp_plan``. Each string has the meaning
transformers gives it, as an fxtp style. fxtp tracks every value's real placement, so the
strings that only say how a gradient or an output must be reduced
(``replicated_with_grad_allreduce``, ``all_reduce``), those that keep a tensor whole
(``replicate``, ``local_params``) and those that keep a module whole and correct a reduction
by hand (``mla_kv_a_proj``, ``moe_identity_expert``) need no style: fxtp reduces where the
graph needs it.
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch.nn as nn
from torch.distributed.tensor import Replicate

from ..passes.errors import PlanError
from .styles import (ColwiseParallel, ExpertTensorParallel, ParallelStyle, RowwiseParallel,
                     SequenceParallel)

STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise": RowwiseParallel,
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
    "packed_colwise": ColwiseParallel,  # a fused projection: its split gets a strided layout
    "packed_rowwise": RowwiseParallel,
    # transformers' layers run on local tensors: its SequenceParallel hands them on so
    "sequence_parallel": lambda: SequenceParallel(use_local_output=True),
    "moe_tp_experts": ExpertTensorParallel,  # its parameters' own entries are its to say
}
"""Plan strings with a style: the layouts transformers registers for each."""

NO_STYLE = frozenset({"replicate", "replicated_with_grad_allreduce", "all_reduce",
                      "local_params", "mla_kv_a_proj", "moe_identity_expert"})
"""Plan strings fxtp needs no style for: it reduces gradients and outputs where the graph
needs it. Among them those that keep a module whole and correct a reduction by hand:
``mla_kv_a_proj`` (MLA's shared rotary key, read by every rank's heads: its gradient is
summed) and ``moe_identity_expert`` (an identity expert's output, divided by the world size
before the experts' partial outputs are summed)."""


EMBEDDINGS = frozenset({"embedding_rowwise", "embedding_colwise"})


def model_plan(model: nn.Module) -> dict[str, str]:
    """The plan ``model`` carries (``"auto"``): transformers' merged ``model.tp_plan``, or
    ``config.base_model_tp_plan`` under the base model's prefix plus the class's
    ``_tp_plan``; for a model that wraps a transformers model (PEFT's ``PeftModel``), that
    model's plan under its FQN. A plan for no more than the embedding and the head is a
    :class:`PlanError`: every layer would run whole."""
    fqn, inner = next(((fqn, m) for fqn, m in model.named_modules()
                       if any(c.__name__ == "PreTrainedModel" for c in type(m).__mro__)),
                      ("", model))
    return {f"{fqn}.{key}" if fqn else key: style for key, style in _own_plan(inner).items()}


def _own_plan(model: nn.Module) -> dict[str, str]:
    head = getattr(type(model), "_tp_plan", None) or {}
    plan = dict(getattr(model, "tp_plan", None) or {})
    if not plan:
        base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
        prefix = getattr(model, "base_model_prefix", "")
        under = f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), nn.Module) \
            else ""
        plan = {f"{under}{key}": style for key, style in base.items()}
        plan.update(head)
    name = type(model).__name__
    ends = {key for key, style in plan.items() if key in head or style in EMBEDDINGS}
    if not set(plan) - ends:  # every layer would run whole
        carried = (f" a plan only for its embedding and head ({', '.join(sorted(plan))})"
                   if plan else " none")
        raise PlanError(f"plan='auto' needs a Hugging Face model that carries a tensor-"
                        f"parallel plan for its layers (config.base_model_tp_plan); {name} "
                        f"carries{carried}: pass a plan dict")
    return plan


def styles_of(plan: Mapping) -> dict:
    """``plan`` with Hugging Face plan strings replaced by fxtp styles (other values as they
    are); strings that need no style are left out."""
    resolved = {}
    experts = tuple(f"{key}." for key, value in plan.items() if value == "moe_tp_experts")
    for key, value in plan.items():
        if key.startswith(experts):  # an experts parameter: ExpertTensorParallel shards it
            continue
        if not isinstance(value, str):
            resolved[key] = value
        elif value in STYLES:
            resolved[key] = STYLES[value]()
        elif value not in NO_STYLE:
            raise PlanError(f"plan[{key!r}] = {value!r} is not a Hugging Face plan string; "
                            f"known: {', '.join(sorted(STYLES.keys() | NO_STYLE))}")
    return resolved
