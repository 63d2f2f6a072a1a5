"""State a model's forward changes by assignment, which a traced program cannot carry.

A trace records one call: what forward reads of its modules' state is baked into the
program as it was then. State updated in place (``cache.index_copy_``) stays state: the
program writes the buffer it holds. State replaced by assignment does not:

* a buffer given a new tensor (``self.k = self.k.to(x.dtype)``, litgpt's KV cache in
  another dtype than the model computes in): the program keeps reading the old tensor,
  so later calls compute with what it held (decoding diverged from the second token).
  fxtp refuses it (:class:`TraceError`).
* a plain attribute given another value (``self.step += 1``): the program computes with
  the traced value on every call. Harmless where no later call reads it, so fxtp warns.

:func:`watching_state` records both while ``model``'s forward runs (a watch on
``nn.Module.__setattr__``); :func:`judge_state_changes` raises or warns.
"""
from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn as nn

from ..passes.errors import TraceError

_BUFFER = object()
"""What a buffer held, in a recorded change (``before``)."""
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)
_PLAIN = (bool, int, float, str, type(None)) + _SYMBOLIC


@contextlib.contextmanager
def watching_state(model: nn.Module):
    """Give a list that collects ``(FQN, name, before, after)`` for each assignment
    ``model``'s forward makes that changes a module's state (``before`` is
    :data:`_BUFFER` for a buffer given a new tensor)."""
    owners = {id(m): fqn for fqn, m in model.named_modules()}
    running, changes = [0], []
    plain = nn.Module.__setattr__

    def watched(self, name, value):
        if running[0] and id(self) in owners:
            own = self.__dict__
            held = own.get("_buffers", {}).get(name)
            if isinstance(value, torch.Tensor):
                if held is not None and held is not value:
                    changes.append((owners[id(self)], name, _BUFFER, value))
            elif name in own and name != "training" and _changed(own[name], value):
                changes.append((owners[id(self)], name, own[name], value))
        plain(self, name, value)

    def enter(*_):
        running[0] += 1

    def leave(*_):
        running[0] -= 1
    hooks = [model.register_forward_pre_hook(enter), model.register_forward_hook(leave)]
    nn.Module.__setattr__ = watched
    try:
        yield changes
    finally:
        nn.Module.__setattr__ = plain
        for hook in hooks:
            hook.remove()


def _changed(before, after) -> bool:
    """Whether assigning ``after`` gives a plain attribute another value (a symbolic one,
    from a dynamic size, counts as another)."""
    if not isinstance(before, _PLAIN) or not isinstance(after, _PLAIN):
        return False
    if isinstance(before, _SYMBOLIC) or isinstance(after, _SYMBOLIC):
        return before is not after
    return type(before) is not type(after) or before != after


def judge_state_changes(model: nn.Module, changes: list) -> None:
    """Raise :class:`TraceError` for a buffer given a new tensor; warn for a plain
    attribute given another value."""
    for fqn, name, before, after in changes:
        module = f"module '{fqn}' ({type(model.get_submodule(fqn)).__name__})"
        if before is _BUFFER:
            raise TraceError(
                f"{module} gives its buffer '{name}' a new tensor in forward (self.{name} = "
                f"...): fxtp's program reads the buffer it holds, so the next call would "
                f"compute with the old one. Write into the buffer in place "
                f"(self.{name}.copy_(...)), or create it as forward uses it (in the dtype "
                f"the model computes in: litgpt's set_kv_cache(..., dtype=...))")
        warnings.warn(
            f"fxtp: {module} sets its attribute '{name}' in forward ({before!r} -> "
            f"{after!r}); fxtp's program computes with the value it had when traced on every "
            f"call, so a later call reading it would not see the change. Pass it as an "
            f"input, or keep it in a buffer updated in place", stacklevel=5)
