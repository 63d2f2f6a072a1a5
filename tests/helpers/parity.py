"""Single-device parity: run a model and its fxtp GraphModule side by side on one rank."""
from __future__ import annotations

import copy

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import fxtp
from fxtp.passes.placement import BlockShard, UnitShard

LR = 1e-2
TIGHT = dict(rtol=1e-9, atol=1e-11)  # fp64 outputs and gradients


def tolerance(dtype, like=None, steps=0):
    """Tolerance for a value computed after ``steps`` AdamW steps.

    fp64: tight. fp32: torch's default rtol and atol, the atol taken relative to the
    largest magnitude in the reference ``like`` (sharded sums round in another order).
    Adam divides each gradient by its own running magnitude, amplifying gradient rounding
    errors into parameter differences: after ``steps`` steps parameters may differ by 1e-5
    (fp64) or 1e-2 (fp32) of the distance they moved, and fp32 outputs and gradients by
    that drift relative to their magnitude. A wrong gradient is off by whole steps.
    bf16 (8 significant bits; sums of many terms round differently in every fused kernel):
    torch's rtol, an atol of 5% of ``like``'s magnitude, and for each step the two learning
    rates by which Adam may move an element whose gradient is rounding noise. That catches
    gradients off by whole factors, not rounding."""
    scale = max(1.0, like.abs().max().item()) if like is not None and like.numel() else 1.0
    drift = (1e-5 if dtype == torch.float64 else 1e-2) * LR * steps
    if dtype == torch.bfloat16:
        return dict(rtol=1.6e-2, atol=5e-2 * scale + 2 * LR * steps)
    if like is None and steps:  # parameters after the steps
        return dict(rtol=1e-7 if dtype == torch.float64 else 1.3e-6, atol=drift)
    if dtype == torch.float64:
        return TIGHT
    return dict(rtol=1.3e-6, atol=1e-5 * scale + drift * scale)


def noise_floor(grads, dtype) -> float:
    """Gradient magnitude below which an element's rounding error (about eps times the
    largest gradient, summed in another order) exceeds 1% of it. Adam normalizes each
    element by its own magnitude, so such elements' steps may differ by more than the 1%
    of a step the after-steps tolerance allows (an exactly-zero true gradient becomes +-lr
    steps of random sign): see :func:`step_like_reference`."""
    return 100 * torch.finfo(dtype).eps * max(g.abs().max().item() for g in grads
                                              if g is not None)


def step_like_reference(grad: torch.Tensor, expected: torch.Tensor, floor: float) -> None:
    """Once ``grad`` is checked against ``expected``, give its rounding-noise elements
    (``expected`` at most ``floor``, :func:`noise_floor`) ``expected``'s values in place:
    optimizer steps, and outputs after them, then compare what tensor parallelism computes
    rather than how rounding noise fell."""
    noise = expected.abs() <= floor
    grad[noise] = expected[noise]


def example(*shape, seed=1):
    """An input tensor that is the same on every rank."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def local_part(full: torch.Tensor, placement, rank: int, world: int) -> torch.Tensor:
    """The part of ``full`` a rank holds under ``placement``: ``Shard(d)`` a contiguous
    chunk; ``_StridedShard(d, k)`` its chunk of each of the ``k`` blocks, concatenated;
    ``BlockShard(d, sizes)`` the same over blocks of those sizes; ``UnitShard(d, n)`` its
    ``torch.chunk`` of the ``n`` units, or its group's unit."""
    if isinstance(placement, (_StridedShard, BlockShard)):
        cut = placement.blocks if isinstance(placement, BlockShard) else \
            [full.shape[placement.dim] // placement.split_factor] * placement.split_factor
        return torch.cat([local_part(block, Shard(placement.dim), rank, world)
                          for block in full.split(list(cut), placement.dim)], placement.dim)
    if isinstance(placement, Shard):
        return full.chunk(world, placement.dim)[rank]
    if isinstance(placement, UnitShard):
        d, units = placement.dim, placement.units
        if units == 1:  # held whole by every rank
            return full
        if units < world:  # each unit held by world / units consecutive ranks
            return full.chunk(units, d)[rank * units // world]
        chunks = full.unflatten(d, (units, -1)).chunk(world, d)  # may be fewer than world
        return chunks[rank].flatten(d, d + 1) if rank < len(chunks) else full.narrow(d, 0, 0)
    return full


def local_of(t: torch.Tensor) -> torch.Tensor:
    """A DTensor parameter's (or gradient's) local tensor; a plain tensor as is."""
    return t.to_local() if isinstance(t, DTensor) else t


def check_parity(rank, world, make_model, plan, inputs, *, dtype, steps=3,
                 input_placements=None, input_grads=True, inputs_per_step=None,
                 kwargs=None, output=lambda out: out, with_bytes=False, post=None,
                 compare_dtype=None, output_index=0, **parallelize_kwargs):
    """Assert forward outputs, every parameter and input gradient, and parameters after
    ``steps`` AdamW steps match the single-device model. ``inputs`` are traced; step ``s``
    runs ``inputs_per_step[s]`` when given (other shapes, for dynamic dims). Returns
    collective counts of the first step: ``(forward counts, backward counts)``.
    ``kwargs`` are passed to every call; ``output`` picks the tensor to compare from what
    the model returns (``lambda o: o.logits`` for Hugging Face models). ``with_bytes`` adds
    the bytes each rank sent into each kind of collective: ``(fwd, bwd, fwd_bytes,
    bwd_bytes)``. ``post`` transforms the parallelized GraphModule in place before use
    (a graph pass such as :func:`fxtp.passes.optimize.optimize`). ``compare_dtype``: the
    dtype whose tolerance applies (a model computing in bf16 under autocast).
    ``output_index``: the position of ``output``'s pick among the graph's outputs."""
    tol_dtype = compare_dtype or dtype
    torch.manual_seed(0)
    model = make_model().to(dtype)
    before = copy.deepcopy(model.state_dict())
    ref = copy.deepcopy(model)
    def cast(xs):
        return [x.to(dtype) if x.is_floating_point() else x for x in xs]
    full_inputs = cast(inputs)
    placements = input_placements or [None] * len(full_inputs)
    kwargs = kwargs or {}
    gm = fxtp.parallelize(model, plan, example_inputs=full_inputs, example_kwargs=kwargs,
                          **parallelize_kwargs)
    if post is not None:
        post(gm)
    params = {_unwrapped(n): p for n, p in gm.named_parameters()}
    assert set(params) == {n for n, _ in ref.named_parameters()}
    opt = torch.optim.AdamW(gm.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    counts = None
    for step in range(steps):
        step_inputs = cast(inputs_per_step[step]) if inputs_per_step else full_inputs
        xs = [x.clone().requires_grad_(input_grads) for x in step_inputs]
        local_xs = [local_part(x.detach(), p, rank, world).clone().requires_grad_(input_grads)
                    for x, p in zip(xs, placements)]
        torch.manual_seed(1000 + step)  # both draw the same random numbers (dropout)
        with fxtp.count_collectives() as fwd:
            out = local_of(output(gm(*local_xs, **kwargs)))  # a DTensor where the plan says
        torch.manual_seed(1000 + step)
        ref_out = output(ref(*xs, **kwargs))
        out_placement = gm.fxtp.output_placements[output_index]
        expected = local_part(ref_out, out_placement, rank, world)
        torch.testing.assert_close(out, expected, **tolerance(tol_dtype, expected, step),
                                   msg=lambda m: f"step {step} output: {m}")
        weight = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(step),
                             dtype=dtype)
        (ref_out * weight).sum().backward()
        with fxtp.count_collectives() as bwd:
            (out * local_part(weight, out_placement, rank, world)).sum().backward()
        floor = noise_floor([q.grad for q in ref.parameters()], tol_dtype)
        for name, p in params.items():
            if ref.get_parameter(name).grad is None:  # the forward does not use it
                assert p.grad is None, f"step {step}: {name} has a gradient, single device none"
                continue
            ref_grad = local_part(ref.get_parameter(name).grad, gm.fxtp.param_placements[name],
                                  rank, world)
            torch.testing.assert_close(local_of(p.grad), ref_grad,
                                       **tolerance(tol_dtype, ref_grad, step),
                                       msg=lambda m: f"step {step} grad of {name}: {m}")
            step_like_reference(local_of(p.grad), ref_grad, floor)
        for i, (x, lx, pl) in enumerate(zip(xs, local_xs, placements) if input_grads else ()):
            torch.testing.assert_close(lx.grad, local_part(x.grad, pl, rank, world),
                                       **tolerance(tol_dtype, x.grad, step),
                                       msg=lambda m: f"step {step} grad of input {i}: {m}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        counts = counts or (dict(fwd.counts), dict(bwd.counts)) + \
            ((dict(fwd.bytes), dict(bwd.bytes)) if with_bytes else ())
    for name, p in params.items():
        expected = local_part(ref.get_parameter(name).detach(), gm.fxtp.param_placements[name],
                              rank, world)
        torch.testing.assert_close(
            local_of(p.detach()), expected, **tolerance(tol_dtype, steps=steps),
            msg=lambda m: f"{name} after {steps} AdamW steps: {m}")
    for name, t in model.state_dict().items():
        assert torch.equal(t, before[name]), f"parallelize modified the user's {name}"
    return counts


def _unwrapped(name: str) -> str:
    """``name`` without the prefixes a checkpoint wrapper and ``torch.compile`` put before a
    wrapped block's own."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
    return name.replace(_CHECKPOINT_PREFIX, "").replace("_orig_mod.", "")


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t
