"""Parallel styles fxtp has no equivalent of, read by applying them to a meta copy.

Projects write their own ``torch.distributed.tensor.parallel.ParallelStyle`` s (torchtitan's
``NoParallel`` for routers and q/k norms, its ``TensorParallel`` for grouped experts, and
the many training libraries that copy them). Such a style acts through
``distribute_module``: a partition function makes the module's parameters DTensors, and
hooks declare its inputs' layouts (``DTensor.from_local``) and redistribute its inputs
and outputs (``DTensor.redistribute``). Applied to a copy of the module whose tensors are
on the meta device (no data, no communication), the style shows the placement of every
parameter and the layouts at the module's boundary: a :class:`ModuleSharding`, as fxtp's
own styles give.

A style that does anything else is refused with a :class:`PlanError` naming the module,
the style and what it did: computing on a value in a hook (a vocab mask), reordering or
reshaping a parameter, sharding a buffer, communicating outside a redistribution (expert
parallelism's all-to-all). fxtp would not compute what such a style computes.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional
from unittest import mock

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ..frontend.meta_copy import meta_copy
from ..kernels.torch_compat import TorchDispatchMode
from ..passes.errors import PlanError
from ..passes.graph import ModuleSharding
from .styles import ParallelStyle

#: Ops that split a tensor into shards without reordering or changing its values: what
#: ``distribute_tensor`` does to a parameter, and what a hook may do beside DTensor's calls.
_SPLITTING = frozenset({
    "alias", "chunk", "clone", "contiguous", "copy_", "detach", "empty", "empty_like",
    "empty_strided", "lift_fresh", "narrow", "new_empty", "new_empty_strided", "slice",
    "split", "split_with_sizes", "_to_copy", "view"})
#: The arities tried for a module's positional inputs when calling a style's input hook.
_ARITIES = (1, 2, 3, 4)


class _Watch(TorchDispatchMode):
    """Records the ops run outside DTensor's own ``from_local`` / ``redistribute`` /
    ``to_local`` / ``full_tensor`` that are not :data:`_SPLITTING`."""

    def __init__(self):
        super().__init__()
        self.depth, self.foreign = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.depth == 0 and func.__name__.split(".")[0] not in _SPLITTING:
            self.foreign.append(str(func))
        return func(*args, **(kwargs or {}))


class _Boundary:
    """What a style's hooks did to the values given them: the placements they declared
    (``from_local``) and redistributed to, by the position of the value."""

    def __init__(self, values):
        self.kept = list(values)  # alive while recording: positions are keyed by id()
        self.position = {id(v): i for i, v in enumerate(values)}
        self.declared: dict[int, object] = {}
        self.desired: dict[int, object] = {}

    @contextlib.contextmanager
    def recording(self, watch: _Watch):
        from_local, redistribute = DTensor.from_local, DTensor.redistribute
        to_local, full_tensor = DTensor.to_local, DTensor.full_tensor

        def inside(fn):
            def run(*args, **kwargs):
                watch.depth += 1
                try:
                    return fn(*args, **kwargs)
                finally:
                    watch.depth -= 1
            return run

        def tracked(fn, into: dict):
            """``fn`` (from_local or redistribute), noting the placement it gives a value
            of a known position in ``into``, and that its result holds that position."""
            def run(*args, **kwargs):
                out = inside(fn)(*args, **kwargs)
                value = args[0] if args else kwargs.get("local_tensor")
                if id(value) in self.position:
                    i = self.position[id(value)]
                    into[i] = out.placements[0]
                    self.position[id(out)] = i
                    self.kept.append(out)
                return out
            return run

        declare, move = tracked(from_local, self.declared), tracked(redistribute, self.desired)
        with mock.patch.object(DTensor, "from_local", staticmethod(declare)), \
                mock.patch.object(DTensor, "redistribute", move), \
                mock.patch.object(DTensor, "to_local", inside(to_local)), \
                mock.patch.object(DTensor, "full_tensor", inside(full_tensor)), watch:
            yield

    def layouts(self, n: int):
        """(declared, redistributed-to) layouts of the ``n`` values, ``None`` where a hook
        did neither. A value only declared keeps the placement fxtp knows it has: DTensor
        computes on its local tensor as it is (torchtitan's ``NoParallel`` on a q/k norm
        declares head-sharded values Replicate, and moves nothing)."""
        return (tuple(self.declared.get(i) for i in range(n)),
                tuple(self.desired.get(i) for i in range(n)))


class ForeignStyle(ParallelStyle):
    """A ``torch.distributed.tensor.parallel.ParallelStyle`` fxtp has no equivalent of,
    read by applying it to a meta copy of each module it is given, on the mesh ``mesh_of()``
    gives (``None``: there is none to read it on)."""

    def __init__(self, style, mesh_of: Optional[Callable[[], DeviceMesh]]):
        self.style, self.mesh_of, self.mesh = style, mesh_of, None
        self.use_local_output = True  # until its output hook is seen to hand on a DTensor

    def __repr__(self):
        return f"{type(self.style).__name__} (read from its DTensor hooks)"

    def shard(self, fqn: str, module: nn.Module) -> ModuleSharding:
        name, kind = fqn or "<root>", type(self.style).__name__
        where = f"{kind} on module '{name}' ({type(module).__name__})"
        if self.mesh_of is None:
            raise PlanError(f"{where}: fxtp reads a style it has no equivalent of by applying "
                            f"it on the mesh; resolve the plan through fxtp.parallelize")
        self.mesh = self.mesh or self.mesh_of()
        shadow = meta_copy(module)
        before = {m: _hooks(m) for m in shadow.modules()}
        watch = _Watch()
        try:
            with watch:
                applied = self.style._apply(shadow, self.mesh)
        except Exception as e:
            raise PlanError(f"{where}: applying the style to a meta copy of the module (to "
                            f"read its placements) raised {e!r}") from e
        if applied is not shadow:
            raise PlanError(f"{where}: the style returns another module than it was given; "
                            f"fxtp can only read styles that change the module in place")
        if watch.foreign:
            raise PlanError(f"{where}: its partition function runs {watch.foreign[0]} on a "
                            f"parameter, which changes its values or their order; fxtp keeps "
                            f"each parameter's own layout. Plan the module with "
                            f"ColwiseParallel/RowwiseParallel or fxtp's own styles instead")
        params = self._params(where, module, shadow)
        for m, hooks in before.items():
            if m is not shadow and _hooks(m) != hooks:
                raise PlanError(f"{where}: the style puts hooks on submodules; fxtp reads "
                                f"only hooks on the module it is planned for")
        pre, post = (_new(shadow, before[shadow], kind) for kind in ("pre", "post"))
        inputs, desired_inputs = self._inputs(where, shadow, pre)
        # what DTensor would compute the output as: a module of replicated parameters keeps
        # its input's layout (a norm, a router); one of sharded parameters leaves partial sums
        entry = next((p for p in (*(desired_inputs or ()), *(inputs or ())) if p), Replicate())
        output = entry if all(isinstance(p, Replicate) for p in params.values()) else Partial()
        return ModuleSharding(fqn, self, params, input_layouts=inputs,
                              desired_inputs=desired_inputs,
                              desired_outputs=self._outputs(where, shadow, post, output))

    def _params(self, where, module, shadow) -> dict:
        """The placement the style gave each parameter (Replicate where it left one a
        plain tensor), checked to keep the parameter's global shape and dtype."""
        params = {}
        original = dict(module.named_parameters())
        for path, p in shadow.named_parameters():
            if not isinstance(p, DTensor):
                params[path] = Replicate()
                continue
            before = original.get(path)
            if before is None or p.shape != before.shape or p.dtype != before.dtype:
                shape = "absent" if before is None else tuple(before.shape)
                raise PlanError(f"{where}: the style makes parameter '{path}' a "
                                f"{tuple(p.shape)} {p.dtype} DTensor from {shape}; fxtp needs "
                                f"each parameter split as it is, not replaced or reshaped")
            (placement,) = p.placements
            if type(placement) not in (Shard, Replicate):
                raise PlanError(f"{where}: parameter '{path}' is placed {placement}; fxtp "
                                f"splits parameters as Shard(d) or keeps them Replicate()")
            params[path] = placement
        for path, b in shadow.named_buffers():
            if isinstance(b, DTensor) and not all(isinstance(q, Replicate)
                                                  for q in b.placements):
                raise PlanError(f"{where}: the style shards buffer '{path}' "
                                f"({b.placements[0]}); fxtp shards buffers only where the "
                                f"program writes them (KV caches)")
        return params

    def _inputs(self, where, shadow, hooks):
        """(declared, desired) layouts of the module's positional inputs, from calling its
        input hooks with as many meta tensors as they take."""
        if not hooks:
            return None, None

        def call(args):
            for hook, with_kwargs in hooks:
                out = hook(shadow, args, {}) if with_kwargs else hook(shadow, args)
                if out is not None:
                    args = out[0] if with_kwargs else out
                    args = args if isinstance(args, tuple) else (args,)
        attempts = [tuple(self._meta() for _ in range(n)) for n in _ARITIES]
        boundary, values, _ = _first_run(
            where, "input", attempts, call, f"with 1 to {_ARITIES[-1]} tensors",
            "PrepareModuleInput")
        return boundary.layouts(len(values))

    def _outputs(self, where, shadow, hooks, placement):
        """Layouts the module's output hooks redistribute its output to, from calling them
        with a meta tensor (a module that computes on local tensors), else with a meta
        DTensor placed ``placement`` (one that computes on DTensors); ``None`` where they
        leave it as it is."""
        if not hooks:
            return None

        def call(values):
            (output,) = values
            for hook, with_kwargs in hooks:
                got = hook(shadow, (), {}, output) if with_kwargs else hook(shadow, (), output)
                output = output if got is None else got
            return output
        local = self._meta()
        attempts = [(local,), (DTensor.from_local(local, self.mesh, (placement,),
                                                  run_check=False),)]
        boundary, _, output = _first_run(where, "output", attempts, call, "with one tensor",
                                         "PrepareModuleOutput")
        self.use_local_output = not isinstance(output, DTensor)
        return (boundary.desired.get(0),)

    def _meta(self) -> torch.Tensor:
        """A meta tensor to call a hook with: 3-D, each dim divisible by the mesh's size."""
        return torch.empty((8 * self.mesh.size(),) * 3, device="meta")


def _first_run(where: str, side: str, attempts, call, tried: str, instead: str):
    """``call(values)`` for each tuple of meta ``values`` in ``attempts`` in turn, recording
    what DTensor's calls in it do; the first that runs -> (its :class:`_Boundary`, its
    values, what ``call`` returned), refused if it computes besides. A :class:`PlanError`
    (``tried``: how it was called; ``instead``: the style to use) where none runs."""
    failures = []
    for values in attempts:
        boundary, watch = _Boundary(values), _Watch()
        try:
            with boundary.recording(watch):
                result = call(values)
        except (TypeError, ValueError, IndexError, RuntimeError, AttributeError) as e:
            failures.append(e)
            continue
        _refuse_computing(where, side, watch)
        return boundary, values, result
    raise PlanError(f"{where}: fxtp could not call the style's {side} hook {tried} to read "
                    f"its layouts ({failures[-1]!r}); write them with {instead} instead")


def _hooks(module: nn.Module):
    return (tuple(module._forward_pre_hooks), tuple(module._forward_hooks))


def _new(module: nn.Module, before, kind: str) -> list:
    """The forward (``pre``) or output (``post``) hooks added to ``module`` since
    ``before``, in order, each with whether it takes keyword arguments."""
    hooks, with_kwargs, old = (
        (module._forward_pre_hooks, module._forward_pre_hooks_with_kwargs, before[0])
        if kind == "pre" else
        (module._forward_hooks, module._forward_hooks_with_kwargs, before[1]))
    return [(hook, key in with_kwargs) for key, hook in hooks.items() if key not in old]


def _refuse_computing(where: str, side: str, watch: _Watch) -> None:
    if watch.foreign:
        raise PlanError(f"{where}: its {side} hook runs {watch.foreign[0]} on the module's "
                        f"{side} besides laying it out, so the module would not compute what "
                        f"the model does. fxtp reads hooks that only declare and redistribute "
                        f"layouts (DTensor.from_local, redistribute, to_local); write that "
                        f"computation in the model, or plan the module with fxtp's styles")
