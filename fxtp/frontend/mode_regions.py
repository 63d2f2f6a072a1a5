"""Inlined mode regions leave their modes when an op in them raises, as ``with`` does.

Tracing inlines ``torch.autocast(...)`` and ``torch.no_grad()`` regions as calls entering
and leaving their mode (:func:`fxtp.frontend.trace.trace`), and a graph has no ``finally``: an op
that raises between them (a bad token id a training loop catches and skips) would leave
the process in the region's mode. :func:`restore_modes_on_error` makes the result's root
module put the grad mode and the autocast state of the regions' devices back as they were
when its call began, whenever the call raises.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..kernels.torch_compat import enter_autocast
from .trace import _enter_grad_mode


def restore_modes_on_error(gm: fx.GraphModule) -> None:
    """Register, on ``gm`` (and ``copy.deepcopy`` s of it), hooks restoring the modes its
    graphs' regions enter when a call raises; nothing where no graph has a region."""
    devices = _autocast_devices(gm)
    if devices is None:
        return

    def register(module: fx.GraphModule) -> None:
        entered: list[tuple] = []

        def before(_module, _args):
            if not torch.compiler.is_compiling():  # compiled code runs dynamo's own exits
                entered.append(_modes(devices))

        def after(_module, _args, _output):
            if not torch.compiler.is_compiling():
                _restore(devices, entered.pop())
        module.register_forward_pre_hook(before)
        module.register_forward_hook(after, always_call=True)
    register(gm)
    gm._register_deepcopy_hook(register)


def _autocast_devices(gm: fx.GraphModule):
    """The device types of the autocast regions in ``gm``'s graphs (``()``: grad-mode
    regions only); ``None`` where there is no region."""
    found = None
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            for node in module.graph.nodes:
                if node.target is enter_autocast:
                    found = (*(found or ()), node.args[0])
                elif node.target is _enter_grad_mode:
                    found = found or ()
    return None if found is None else tuple(dict.fromkeys(found))


def _nesting() -> int:
    """How many autocast regions are open (torch reads it only by changing it)."""
    depth = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return depth - 1


def _modes(devices: tuple) -> tuple:
    return (torch.is_grad_enabled(), torch.is_autocast_cache_enabled(), _nesting(),
            [(torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices])


def _restore(devices: tuple, modes: tuple) -> None:
    grad, cache, nesting, autocast = modes
    if _modes(devices) == modes:
        return
    torch.set_grad_enabled(grad)
    while _nesting() > nesting:  # as each region's exit would: its cache dropped at depth 0
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
    for device, (enabled, dtype) in zip(devices, autocast):
        torch.set_autocast_enabled(device, enabled)
        torch.set_autocast_dtype(device, dtype)
    torch.set_autocast_cache_enabled(cache)
