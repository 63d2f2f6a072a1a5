"""The model's names for the tensors of a module that torch's wrappers may have wrapped.

``torch.compile(block)`` registers the block under ``_orig_mod`` and ``checkpoint_wrapper``
under ``_checkpoint_wrapped_module``, so ``gm.named_parameters()`` of a result whose blocks
were compiled or checkpointed in place says ``layers.0._orig_mod.attention.wq.weight`` where
the model (and every table fxtp keeps by FQN) says ``layers.0.attention.wq.weight``. These
helpers drop the wrappers' segments, as ``torch.distributed.checkpoint.state_dict`` does."""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn as nn

WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module")


def model_fqn(name: str) -> str:
    """``name`` with the wrappers' segments dropped."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(model FQN, tensor)`` for every parameter and buffer of ``module``, under all of
    its names (tied tensors under each)."""
    for name, t in module.named_parameters(remove_duplicate=False):
        yield model_fqn(name), t
    for name, t in module.named_buffers(remove_duplicate=False):
        yield model_fqn(name), t
