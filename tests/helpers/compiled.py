"""Compiled parity: an fxtp GraphModule under torch.compile against the same module eager."""
from __future__ import annotations

import contextlib
import re
from collections import Counter

import torch
import torch.fx as fx
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import fxtp
from fxtp.passes.modules import inline_program
from fxtp.passes.optimize import optimize
from tests.helpers.parity import (LR, example, local_of, local_part, noise_floor,
                                  step_like_reference, tolerance)

_KINDS = {"all_reduce_": "all_reduce", "all_reduce": "all_reduce",
          "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
          "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all"}


def collectives_in(codes: list[str]) -> dict[str, int]:
    """Collectives inductor's output ``codes`` issue, by kind (as ``count_collectives``)."""
    calls = Counter()
    for code in codes:
        for op in re.findall(r"torch\.ops\._c10d_functional\.(\w+)\.default\(", code):
            if op in _KINDS:
                calls[_KINDS[op]] += 1
    return dict(calls)


def forward_and_backward(codes: list[str]) -> tuple[list[str], list[str]]:
    """Split inductor's programs: backward ones take the output gradients (``tangents``)."""
    return [c for c in codes if "tangents_" not in c], [c for c in codes if "tangents_" in c]


def train_step(module, inputs, placements, rank, world, step, counts=None):
    """Forward and backward of ``module`` on this rank's part of ``inputs``, the output
    weighted by a fixed random tensor. ``counts``: a (forward, backward) pair of
    ``count_collectives`` to run them under. Returns the output and the local inputs."""
    fwd, bwd = counts or (contextlib.nullcontext(), contextlib.nullcontext())
    local = [local_part(x, p, rank, world).clone().requires_grad_(x.is_floating_point())
             for x, p in zip(inputs, placements)]
    with fwd:
        out = module(*local)
    with bwd:
        (out * example(*out.shape, seed=step).to(out)).sum().backward()
    return out.detach(), local


def check_compiled(rank, world, make_model, plan, inputs, *, backend="inductor",
                   dtype=torch.float32, steps=2, input_placements=None, device="cpu",
                   compiler=None, compare_dtype=None, **parallelize_kwargs):
    """Train ``torch.compile(gm, backend=backend, fullgraph=True)`` and the eager ``gm``
    side by side for ``steps`` AdamW steps from the same parameters; assert outputs, every
    parameter and input gradient and the parameters after the steps match, and that dynamo
    made one graph and no graph break. ``compiler``: how ``gm`` is compiled instead of
    ``torch.compile`` (``backend`` then only names the backend it uses). Returns the collectives
    of the first step by kind,
    ``{"eager": (fwd, bwd), "compiled": (fwd, bwd)}`` (compiled: those inductor's code
    issues). ``compare_dtype``: the dtype whose tolerance applies (a model computing in bf16
    under autocast)."""
    tol_dtype = compare_dtype or dtype
    torch.manual_seed(0)
    model = make_model().to(device=device, dtype=dtype)
    xs = [x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype)
          for x in inputs]
    placements = input_placements or [None] * len(xs)
    eager = fxtp.parallelize(model, plan, example_inputs=xs, **parallelize_kwargs)
    gm = fxtp.parallelize(model, plan, example_inputs=xs, **parallelize_kwargs)
    compiled = (compiler or (lambda m: torch.compile(m, backend=backend, fullgraph=True)))(gm)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=LR) for m in (eager, gm)]
    counters.clear()
    result = {}
    for step in range(steps):
        counts = (fxtp.count_collectives(), fxtp.count_collectives()) if step == 0 else None
        ref, ref_inputs = train_step(eager, xs, placements, rank, world, step, counts)
        if step == 0:
            (out, got_inputs), codes = run_and_get_code(train_step, compiled, xs, placements,
                                                        rank, world, step)
            fwd, bwd = forward_and_backward(codes)
            result = {"eager": tuple(dict(c.counts) for c in counts),
                      "compiled": (collectives_in(fwd), collectives_in(bwd))}
        else:
            out, got_inputs = train_step(compiled, xs, placements, rank, world, step)
        torch.testing.assert_close(out, ref, **tolerance(tol_dtype, ref, step),
                                   msg=lambda m: f"step {step} output: {m}")
        floor = noise_floor([local_of(q.grad) for q in eager.parameters()], tol_dtype)
        for (name, p), q in zip(gm.named_parameters(), eager.parameters()):
            expected = local_of(q.grad)
            torch.testing.assert_close(local_of(p.grad), expected,
                                       **tolerance(tol_dtype, expected, step),
                                       msg=lambda m: f"step {step} grad of {name}: {m}")
            step_like_reference(local_of(p.grad), expected, floor)
        for i, (a, b) in enumerate(zip(got_inputs, ref_inputs)):
            if b.grad is not None:
                torch.testing.assert_close(a.grad, b.grad,
                                           **tolerance(tol_dtype, b.grad, step),
                                           msg=lambda m: f"step {step} grad of input {i}: {m}")
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(gm.named_parameters(), eager.parameters()):
        torch.testing.assert_close(local_of(p), local_of(q),
                                   **tolerance(tol_dtype, steps=steps),
                                   msg=lambda m: f"{name} after {steps} AdamW steps: {m}")
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    return result


def optimize_whole(gm: fx.GraphModule) -> None:
    """The passes on the whole program, its modules inlined (a round trip may span two
    modules: a reduce-scatter at one's output, the gather at the next one's input)."""
    graph = inline_program(gm)
    graph._codegen = gm.graph._codegen
    gm.graph = graph
    optimize(gm)
