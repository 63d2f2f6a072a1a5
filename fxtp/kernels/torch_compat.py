"""Every private torch API fxtp uses, in one place: each name says what it is for and which
torch versions it was checked on. The rest of fxtp imports these names, never a private
torch module, so that a torch release that moves one is mended here alone.

"Checked on" lists the versions whose test suites ran the code that uses the name: 2.13 is
CI's pinned version; 2.11, ``setup.cfg``'s floor, is where the GPU machines run.

Names whose modules are slow to import (inductor, export, dynamo's translator) are looked
up when first used (module ``__getattr__``), so ``import fxtp`` stays as quick as before.
"""
from __future__ import annotations

import contextlib
import importlib
import sys

import torch
import torch.distributed as dist
# Checked on 2.11 and 2.13 unless a line says otherwise.
import torch.utils._pytree as pytree  # no public pytree module
from torch._C._distributed_c10d import FakeProcessGroup
from torch._decomp import decomposition_table
from torch._guards import detect_fake_mode
from torch._ops import HigherOrderOperator, OperatorBase, OpOverload, OpOverloadPacket
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.amp.autocast_mode import _enter_autocast as enter_autocast
from torch.amp.autocast_mode import _exit_autocast as exit_autocast
from torch.distributed.distributed_c10d import _resolve_process_group as resolve_process_group
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import (compute_global_tensor_info,
                                             compute_local_shape_and_global_offset)
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard
from torch.fx._lazy_graph_module import _LazyGraphModule as LazyGraphModule
from torch.fx._lazy_graph_module import _use_lazy_graph_module as lazy_graph_modules
from torch.nn.modules.module import _WrappedHook as WrappedHook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes

__all__ = [
    "pytree", "decomposition_table", "detect_fake_mode", "HigherOrderOperator",
    "OperatorBase", "OpOverload", "OpOverloadPacket", "FakeTensor", "FakeTensorMode",
    "compute_global_tensor_info", "compute_local_shape_and_global_offset", "LazyGraphModule",
    "lazy_graph_modules", "without_source_lines",
    "TorchDispatchMode", "disable_current_modes", "c10d_functional", "assert_async",
    "foreach_mul_", "has_kernel_for", "mark_static_address", "dtensor_of", "OWN_GRAD",
    "held_only_by",
    "compiled_frame", "init_fake_process_group", "enter_autocast", "exit_autocast",
    "resolve_process_group", "StridedShard", "WrappedHook", "function_apply"]

c10d_functional = torch.ops._c10d_functional
"""The functional collectives' op namespace (2.11, 2.13): ``all_reduce``, ``wait_tensor``..."""

assert_async = torch._assert_async
"""A data-dependent check that does not synchronize the device (2.11, 2.13)."""

foreach_mul_ = torch._foreach_mul_
"""In-place multiply of a list of tensors in one kernel launch per device (2.11, 2.13)."""

_LAZY = {  # name -> (module, attribute): imported when first used
    "compile_fx": ("torch._inductor.compile_fx", "compile_fx"),  # 2.11, 2.13
    "CustomGraphPass": ("torch._inductor.custom_graph_pass", "CustomGraphPass"),  # 2.11, 2.13
    "get_hash_for_files": ("torch._inductor.custom_graph_pass", "get_hash_for_files"),
    "allow_in_pre_dispatch_graph": ("torch._export.wrappers",
                                    "allow_in_pre_dispatch_graph"),  # 2.11, 2.13
    "is_graphable": ("torch._higher_order_ops.flat_apply", "is_graphable"),  # 2.11, 2.13
    "call_custom_autograd_function_in_pre_dispatch": (  # 2.11, 2.13
        "torch.export.custom_ops", "_call_custom_autograd_function_in_pre_dispatch"),
}
__all__ += list(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _LAZY[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


@contextlib.contextmanager
def without_source_lines():
    """Tracing records no node's user source lines (``node.meta["stack_trace"]``, a fifth of
    export's time): ``torch.fx.config.do_not_emit_stack_traces`` (2.13; a torch without the
    switch records them)."""
    config = torch.fx.config
    before = getattr(config, "do_not_emit_stack_traces", None)
    if before is None:
        yield
        return
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


def has_kernel_for(op: OpOverload, dispatch_key: str) -> bool:
    """Does ``op`` have its own kernel for ``dispatch_key`` (2.11, 2.13)?"""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), dispatch_key)


def mark_static_address(t: torch.Tensor) -> None:
    """Have ``torch.compile`` treat ``t`` as parameters are treated: read in place by CUDA
    graphs, with no guard on its identity (2.13)."""
    torch._dynamo.mark_static_address(t, guard=False)


def function_apply(function: type, *args):
    """``function.apply(*args)`` for an autograd ``Function`` with its own ``setup_context``
    and positional arguments only, without ``Function.apply``'s binding of default arguments
    through ``inspect.signature`` (about 16 us a call on CPU); the binding runs where
    functorch transforms are active, which need it (2.11, 2.13)."""
    if torch._C._are_functorch_transforms_active():
        return function.apply(*args)
    return super(torch.autograd.Function, function).apply(*args)  # autograd's own apply


def run_as_python(fn):
    """Have every frame of ``fn``'s code, and the frames it calls, run as plain Python: dynamo
    never compiles one as a frame of its own (the hooks ``torch.compile(module)`` runs outside
    its graph then cost a call, not a frame's cache lookup and guards), while dynamo tracing
    a caller of ``fn`` still traces through it. ``False`` where this torch cannot (then
    nothing changes) (2.13)."""
    from torch._dynamo import eval_frame
    strategy = getattr(eval_frame, "FrameExecStrategy", None)
    if strategy is None or not hasattr(eval_frame, "_is_in_optimized_module"):
        return False
    skip = eval_frame.FrameAction.SKIP
    eval_frame.set_code_exec_strategy(fn.__code__, strategy(skip, skip))
    return True


def in_compiled_module_call() -> bool:
    """Is a call of a ``torch.compile`` d module running (its hooks outside its graph)?
    ``False`` where this torch cannot tell, where :func:`run_as_python` changes nothing
    (2.13)."""
    from torch._dynamo import eval_frame
    running = getattr(eval_frame, "_is_in_optimized_module", None)
    return running is not None and running()


def dtensor_fields():
    """A context in which a ``DTensor``'s ``.grad`` is read and set without the check for a
    ``__torch_function__`` override, which ``DTensor`` disables anyway: 0.09 against 0.57 us
    a read. Only for ``DTensor`` s: it skips any other subclass's override (2.11, 2.13)."""
    return torch._C.DisableTorchFunctionSubclass()


OWN_GRAD = torch._C.TensorBase.grad
"""The ``grad`` every tensor has (a descriptor: ``OWN_GRAD.__get__(t)``,
``OWN_GRAD.__set__(t, g)``), past any ``grad`` property of a subclass (2.11, 2.13)."""


def held_only_by(t: torch.Tensor, references: int) -> bool:
    """Whether nothing holds ``t`` but the ``references`` Python references its caller
    counts (``t``'s own argument excluded): no other Python reference, and no C++ one (an
    autograd graph that saved it) (CPython; 2.11, 2.13)."""
    return sys.getrefcount(t) == references + 2 and t._use_count() == 1


def dtensor_of(local: torch.Tensor, spec) -> DTensor:
    """``local`` as a ``DTensor`` of ``spec``, as ``DTensor.__new__`` makes it: ``__init__``
    adds nothing to it but a dynamo-disabling wrapper that costs 3 us a call. ``local`` must
    already be laid out as ``spec`` says and need no gradient (2.13)."""
    return DTensor.__new__(DTensor, local, spec, requires_grad=False)


def compiled_frame() -> tuple[dict, object, bool]:
    """While dynamo compiles: the frame's locals, its code object, and whether it must be
    one graph (``fullgraph``) (2.11, 2.13)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator
    tx = InstructionTranslator.current_tx()
    return tx.f_locals, tx.f_code, tx.one_graph


def _create_fake_group(common_opts, backend_opts):
    create = getattr(FakeProcessGroup, "_create_internal", None)  # 2.13; older: the class
    if create is None:
        return FakeProcessGroup(common_opts.group_rank, common_opts.group_size)
    return create(common_opts.group_rank, common_opts.group_size, backend_opts)


def init_fake_process_group(world_size: int, rank: int = 0) -> None:
    """Make the default process group torch's fake one: ``world_size`` ranks in this process,
    collectives that move nothing (shapes only). Registers the ``"fake"`` backend as
    ``torch.testing`` does, without importing it (2.13)."""
    dist.Backend.register_backend("fake", _create_fake_group, extended_api=True,
                                  devices=["cpu", "cuda"])
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)
