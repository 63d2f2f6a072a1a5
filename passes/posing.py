"""Graph module classes that pass ``isinstance`` checks for the model's module classes.

An outlined module (:mod:`fxtp.passes.modules`) is a ``GraphModule`` running its part of
the program. Code that picks modules by class (``ModuleWrapPolicy({Block})``,
``apply_activation_checkpointing(check_fn=lambda m: isinstance(m, Block))``, torchtune's
and Lightning's wrap policies, weight-init functions applied with ``module.apply``) must
find it as it finds the original, or it skips it silently: per-block FSDP or
checkpointing quietly not applied.

:func:`posing_class` gives a ``GraphModule`` class with the original class among its bases
and none of its behaviour: every method, property and special method the original's
classes define is the one ``GraphModule`` has, or hidden (``AttributeError``) where it has
none, so nothing of the original's code runs on a module whose state it never made. Only
plain class data stays readable (Hugging Face's ``gradient_checkpointing = False``). A class
defining a protocol ``GraphModule`` lacks (``nn.Sequential``'s ``__len__``, ``__iter__``)
cannot be posed as: no class attribute unsets it, and its module stays a plain
``GraphModule``.
``__init_subclass__`` of the original's classes does not run for it or its subclasses (the
classes ``GraphModule`` and FSDP2 make per instance): Hugging Face's would wrap their
``forward``.
"""
from __future__ import annotations

import copy
import functools
import itertools
from typing import Optional

import torch
import torch.fx as fx
import torch.nn as nn

from ..kernels.torch_compat import LazyGraphModule
from .context import PassContext
from .graph import keep_on_copy, own_method

_KEPT = frozenset({"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__",
                   "__annotations__", "__slots__", "__abstractmethods__", "_abc_impl",
                   "__parameters__", "__orig_bases__", "__static_attributes__",
                   "__firstlineno__", "__type_params__", "__annotate__",
                   "__annotate_func__", "__annotations_cache__"})


class _Hidden:
    """A class attribute that reads as absent (instances fall back to
    ``nn.Module.__getattr__``: their parameters, buffers and submodules)."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, instance, owner=None):
        raise AttributeError(f"'{owner.__name__}' object stands for a module in fxtp's "
                             f"program and has no attribute '{self.name}' of its own")


def _no_subclass_hook(cls, **kwargs) -> None:
    """Subclasses (per instance, FSDP2's) do not run the original's
    ``__init_subclass__``."""


@functools.lru_cache(maxsize=None)
def posing_class(original: type) -> Optional[type]:
    """A subclass of ``LazyGraphModule`` and of ``original`` that behaves as
    ``LazyGraphModule`` does, or ``None`` where Python cannot combine the two (an
    ``original`` with ``__slots__`` or a protocol of its own).

    Between them in the method resolution order sits a class holding, for every name
    ``original``'s classes define, ``nn.Module``'s attribute or a hidden one: lookups that
    pass ``GraphModule`` (its ``__init__``'s ``super().__init__()``) stop there."""
    if not issubclass(original, nn.Module) or issubclass(original, fx.GraphModule):
        return None
    modules = {name: vars(k)[name] for k in reversed(nn.Module.__mro__) for name in vars(k)}
    shield: dict = {"__init_subclass__": classmethod(_no_subclass_hook)}
    for k in original.__mro__:
        if k in nn.Module.__mro__:
            continue
        for name, value in vars(k).items():
            if name in _KEPT or name in shield:
                continue
            if name in modules:
                shield[name] = modules[name]
            elif name.startswith("__") and name.endswith("__") and callable(value):
                return None  # a protocol (``__len__``, ``__iter__``) no class attribute unsets
            elif name in PARAMETER_PROPERTIES and isinstance(value, property):
                shield[name] = property(PARAMETER_PROPERTIES[name])
            elif callable(value) or hasattr(type(value), "__get__"):
                shield[name] = _Hidden(name)
    try:
        shielded = type(f"Shielded{original.__name__}", (nn.Module,), shield)
        return type(original.__name__, (LazyGraphModule, shielded, original),
                    {"__module__": original.__module__, "__qualname__": original.__qualname__})
    except TypeError:
        return None


def _device(module: nn.Module) -> torch.device:
    return next(itertools.chain(module.parameters(), module.buffers())).device


def _dtype(module: nn.Module) -> torch.dtype:
    return next(p.dtype for p in module.parameters() if p.is_floating_point())


PARAMETER_PROPERTIES = {"device": _device, "dtype": _dtype}
"""Properties a module class may define that read its parameters (Hugging Face's
``model.device``, as in ``inputs.to(model.device)``, and ``model.dtype``): a module standing
for one has them, read from its own parameters, where the class defines them."""


def give_parameter_properties(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Give the root ``gm`` (and its copies) the :data:`PARAMETER_PROPERTIES` the class of
    ``ctx.model`` defines (outlined modules have theirs from :func:`posing_class`)."""
    model = ctx.model
    for name, read in PARAMETER_PROPERTIES.items():
        if isinstance(getattr(type(model), name, None), property) and \
                not hasattr(type(gm), name):
            own_method(gm, name, property(read))
    return gm


COPIED = "_fxtp_plain_attributes"  # the names copy_plain_state gave a module
_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)


def copy_plain_state(module: nn.Module, original: nn.Module) -> None:
    """Give ``module`` what code picking modules by class reads of ``original`` besides
    tensors: its parameters and buffers set to ``None`` (``m.bias is None``) and its plain
    public attributes (numbers, strings, dtypes and tuples of them: ``in_features``,
    ``padding_idx``, ``eps``), which are global sizes, as under DTensor's TP."""
    for kind in ("_parameters", "_buffers"):
        for name, value in getattr(original, kind).items():
            if value is None:
                getattr(module, kind).setdefault(name, None)
    copied = []
    for name, value in vars(original).items():
        if name.startswith("_") or name in vars(module) or hasattr(type(module), name):
            continue
        if isinstance(value, _PLAIN) or (isinstance(value, tuple) and
                                         all(isinstance(v, _PLAIN) for v in value)):
            module.__dict__[name] = value
            copied.append(name)
    module.__dict__[COPIED] = tuple(copied)


def copy_data_attributes(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Give ``gm`` and each graph module in it the public data attributes of its module in
    ``ctx.model`` that they lack: plain values (at the root; :func:`copy_plain_state` gave the
    others theirs) and objects holding no tensor or module, such as a model's ``config``
    (``gm.config.vocab_size``). Objects are deep copies, made once for all modules sharing
    one (every layer's ``config`` is the root's copy), so nothing set on them reaches
    ``model``; ``copy.deepcopy(gm)`` carries them."""
    model, memo = ctx.model, {}
    for fqn, module in gm.named_modules():
        try:
            original = model.get_submodule(fqn)
        except AttributeError:
            continue
        if not isinstance(module, fx.GraphModule):
            continue
        for name, value in vars(original).items():
            if name.startswith("_") or name in vars(module) or hasattr(type(module), name):
                continue
            if isinstance(value, _PLAIN):
                if module is not gm:
                    continue
                copied = value
            else:
                copied = _data_copy(value, memo)
                if copied is _NOT_DATA:
                    continue
            module.__dict__[name] = copied
            keep_on_copy(module, name)
    return gm


_NOT_DATA = object()


def _data_copy(value, memo: dict):
    """A deep copy of ``value`` (sharing ``memo``'s copies), or ``_NOT_DATA`` where it is,
    or holds, a tensor or a module, or cannot be copied."""
    if isinstance(value, (torch.Tensor, nn.Module)) or callable(value):
        return _NOT_DATA
    scratch = dict(memo)
    try:
        copied = copy.deepcopy(value, scratch)
    except Exception:  # noqa: BLE001 - not data this module can hand out
        return _NOT_DATA
    if any(isinstance(v, (torch.Tensor, nn.Module)) for k, v in scratch.items()
           if k not in memo):
        return _NOT_DATA
    memo.update(scratch)
    return copied
