"""Optimizers step fxtp's ``DTensor`` parameters on their plain local tensors.

torch's optimizers over ``DTensor`` s pay ``DTensor``'s dispatch on every foreach op, for
every tensor of the list (on CPU about 20 us a tensor an op, 2.6-4.8x the step over plain
tensors). For the length of a step, an optimizer holding fxtp's parameters
(:mod:`fxtp.edges.local_reads`) is handed, in place of each, its plain read (which holds
the parameter's gradient) and the local tensors of its state; afterwards the parameters
are handed back with their state, as ``DTensor`` s of each parameter's spec (state the
step created is wrapped once). The same ops update the same local tensors, so the numbers
are those of the step over the ``DTensor`` s, bit for bit; ``optimizer.state``,
``state_dict()`` and DCP see ``DTensor`` s as before.

What is handed in is worked out once and kept (:class:`_Handover`) while the optimizer's
groups, its state table, fxtp's reads and the state values of fxtp's parameters stay the
same (a value set between steps, ``opt.state[p]["exp_avg"] = ...``, is the one stepped), so
a step costs a few checks per parameter. A parameter group is stepped locally only where
every ``DTensor`` in it is fxtp's, with state laid out as it is (FSDP2's parameters are
stepped as they are). A step given a closure (its backward would leave new gradients)
and a step under ``torch.compile`` run on the ``DTensor`` s, as given. An optimizer's own
step hooks see the plain reads. A step that raises leaves them in place until the
optimizer's next step, which hands them back first.

The fast route, :func:`local_parameters`, gives the reads themselves to build an
optimizer over: no handover, local state.
"""
from __future__ import annotations

import functools
from collections import defaultdict
from itertools import chain, repeat
from operator import is_
from typing import Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from ..kernels.torch_compat import OWN_GRAD, dtensor_fields
from ..passes.errors import InputError
from . import local_reads
from .local_reads import (as_dtensor, forget_gradient, is_ours, laid_out_like, read_of,
                          settle_gradient, stale)

_HANDOVER = "_fxtp_handover"  # on an optimizer: its _Handover
_installed = False


def step_locally() -> None:
    """Have every optimizer step fxtp's parameters locally (once per process)."""
    global _installed
    if not _installed:
        register_optimizer_step_pre_hook(_hand_in)
        register_optimizer_step_post_hook(_hand_back)
        _installed = True


def local_parameters(module: nn.Module) -> list[torch.Tensor]:
    """What to build an optimizer over to step at plain-tensor speed: for each of
    ``module.parameters()``, in order, fxtp's parameter's read (the plain tensor the program
    computes with: its local shard's storage, holding its gradient), any other parameter as
    it is. Such an optimizer steps the local shards with no handover (one over
    ``gm.parameters()`` is handed the reads for each step and its state wrapped back, a
    few checks per parameter), and its state holds local tensors keyed by the reads: save
    it per rank with its own ``state_dict()``, not through DCP's global view. Build it
    after the parameters move (``gm.to(...)``, ``to_empty``, ``requires_grad_``) and after
    ``fully_shard`` or DDP wrap the module: a step over a read of a parameter that has
    moved since raises."""
    return [read_of(p) if is_ours(p) else p for p in module.parameters()]


def _check_reads_current(optimizer) -> None:
    """Raise where ``optimizer`` steps a read its parameter no longer reads."""
    moved = [p for group in optimizer.param_groups for p in group["params"]
             if not isinstance(p, DTensor) and stale(p)]
    if moved:
        raise InputError(
            f"{type(optimizer).__name__} steps {len(moved)} tensor(s) that "
            f"fxtp.local_parameters() gave for parameters that have moved since (first of "
            f"shape {tuple(moved[0].shape)}: .to(), to_empty() or requires_grad_() on the "
            f"module): the program no longer reads them, so the step would be lost. Build "
            f"the optimizer over fxtp.local_parameters(gm) again after the move.")


class _Handover:
    """What an optimizer is handed for a local step: for each group it steps locally, the
    list of parameters with reads in place of fxtp's, and a state table keyed by those
    (local tensors in place of ``DTensor`` s, state of other parameters shared)."""

    def __init__(self, optimizer):
        _check_reads_current(optimizer)
        self.key, self.stepping = _key(optimizer), False
        self.groups = []  # (group, its parameters, what it is handed)
        self.params, self.reads = [], []  # fxtp's parameters stepped locally, their reads
        for group in optimizer.param_groups:
            reads = _reads(group["params"], optimizer.state)
            if reads is None:
                continue
            self.groups.append((group, group["params"],
                                [r if r is not None else p for p, r in zip(group["params"],
                                                                           reads)]))
            pairs = [(p, r) for p, r in zip(group["params"], reads) if r is not None]
            self.params += [p for p, _ in pairs]
            self.reads += [r for _, r in pairs]
        self.state = defaultdict(dict, optimizer.state)
        self.dtensor_state = optimizer.state
        for p, read in zip(self.params, self.reads):
            held = self.state.pop(p, None)
            if held is not None:
                self.state[read] = {k: v._local_tensor if isinstance(v, DTensor) else v
                                    for k, v in held.items()}
        self.seen = list(_values(self.state))  # every state value, as last handed back
        self.held = list(self.dtensor_values())  # as the optimizer's own table holds them

    def dtensor_values(self):
        """The values of fxtp's parameters' state in the optimizer's own table, in order."""
        return chain.from_iterable(map(dict.values, map(self.dtensor_state.get, self.params,
                                                        repeat(_NO_STATE))))

    def current(self, optimizer) -> bool:
        """Is this handover still the optimizer's: its groups and tables the same, and the
        state of fxtp's parameters the same values as handed back (none set since)?"""
        if self.key != _key(optimizer):
            return False
        return _same(self.dtensor_values(), self.held)

    def hand_in(self, optimizer) -> bool:
        """Hand ``optimizer`` the reads, which hold their parameters' gradients; ``False``
        (nothing handed) where a parameter holds one laid out otherwise."""
        with dtensor_fields():  # as a rule none holds a gradient of its own: one pass in C
            own = list(map(OWN_GRAD.__get__, self.params))
        if not all(map(is_, own, repeat(None))) and not all(map(settle_gradient, self.params)):
            return False
        self.lend_reads()
        optimizer.state = self.state
        return True

    def lend_reads(self) -> None:
        """Put the reads in the groups, in place of fxtp's parameters."""
        for group, _, handed in self.groups:
            group["params"] = handed

    def return_params(self) -> None:
        """Put the parameters back in the groups."""
        for group, params, _ in self.groups:
            group["params"] = params

    def hand_back(self, optimizer) -> None:
        self.return_params()
        optimizer.state = self.dtensor_state
        if len(self.state) != len(self.dtensor_state):  # state made for plain parameters
            reads = set(map(id, self.reads))
            for key, value in self.state.items():
                if id(key) not in reads:
                    self.dtensor_state.setdefault(key, value)
        if _same(_values(self.state), self.seen):
            return  # every state was stepped in place
        for p, local in zip(self.params, map(self.state.get, self.reads)):
            held = self.dtensor_state.get(p) or {}
            if local is not None and not _wraps(held, local):
                self.dtensor_state[p] = {k: v if k == "step" else _as_state(v, p, held.get(k))
                                         for k, v in local.items()}
        self.seen, self.held = list(_values(self.state)), list(self.dtensor_values())


_NO_STATE: dict = {}  # a parameter's state before its first step


def _values(state: dict):
    """Every value of an optimizer's ``state``, in order."""
    return chain.from_iterable(map(dict.values, state.values()))


def _same(values, seen: list) -> bool:
    """Are ``values`` (an iterator) the objects ``seen``, as many, in order (one pass)?"""
    return all(map(is_, chain(values, _END), chain(seen, _END)))


_END = (object(),)  # closes both sides of a comparison: a longer side meets it unmatched


def _wraps(held: dict, local: dict) -> bool:
    """Does a parameter's ``held`` state hold the values of its read's ``local`` state (as
    they are, or as the local tensors of ``DTensor`` s)?"""
    return held.keys() == local.keys() and all(
        h is v or (isinstance(h, DTensor) and h._local_tensor is v)
        for h, v in zip(map(held.get, local), local.values()))


def _key(optimizer) -> tuple:
    """What a :class:`_Handover` was worked out from."""
    return (local_reads.epoch, id(optimizer.state), id(optimizer.param_groups),
            tuple((id(g["params"]), len(g["params"])) for g in optimizer.param_groups))


def _hand_in(optimizer, args, kwargs) -> None:
    closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args[0]: optimizer
    if torch.compiler.is_compiling() or closure is not None:
        return
    handover: Optional[_Handover] = optimizer.__dict__.get(_HANDOVER)
    if handover is not None and handover.stepping:  # the last step raised
        _hand_back(optimizer, args, kwargs)
    if handover is None or not handover.current(optimizer):
        handover = optimizer.__dict__[_HANDOVER] = _Handover(optimizer)
    if handover.groups:
        handover.stepping = handover.hand_in(optimizer)
        if "zero_grad" not in optimizer.__dict__ and \
                type(optimizer).zero_grad is torch.optim.Optimizer.zero_grad:
            optimizer.zero_grad = functools.partial(_zero_grad, optimizer)


def _zero_grad(optimizer, set_to_none: bool = True) -> None:
    """``Optimizer.zero_grad`` (an optimizer's own, once it stepped locally): with
    ``set_to_none``, over the reads it steps locally, their parameters' ``DTensor``
    gradients let go after (a plain tensor's ``.grad`` is read and dropped for 0.2 against
    2.7 us)."""
    handover: Optional[_Handover] = optimizer.__dict__.get(_HANDOVER)
    if not (set_to_none and handover is not None and handover.key == _key(optimizer) and
            not handover.stepping):
        type(optimizer).zero_grad(optimizer, set_to_none)
        return
    handover.lend_reads()
    try:
        type(optimizer).zero_grad(optimizer, True)
    finally:
        handover.return_params()
        for p in handover.params:
            forget_gradient(p)


def _hand_back(optimizer, args, kwargs) -> None:
    handover = optimizer.__dict__.get(_HANDOVER)
    if handover is not None and handover.stepping:
        handover.stepping = False
        handover.hand_back(optimizer)


def _reads(params: list, state) -> Optional[list]:
    """The read of each of ``params`` to step in its place (``None`` for a plain tensor),
    or ``None`` where the group steps as it is."""
    reads = []
    for p in params:
        if not isinstance(p, DTensor):
            reads.append(None)
            continue
        if not is_ours(p) or not all(laid_out_like(v, p) for v in state.get(p, {}).values()
                                     if isinstance(v, DTensor)):
            return None
        reads.append(read_of(p))
    return reads if any(r is not None for r in reads) else None


def _as_state(value, p: DTensor, before):
    """A state value (not a step count) after a local step: the ``DTensor`` it was handed
    in as, or a new tensor shaped like ``p``'s local one as a ``DTensor`` of ``p``'s
    layout."""
    if isinstance(before, DTensor) and before._local_tensor is value:
        return before
    if isinstance(value, torch.Tensor) and value.shape == p._local_tensor.shape:
        return as_dtensor(value, p._spec, p._local_tensor.stride())
    return value
