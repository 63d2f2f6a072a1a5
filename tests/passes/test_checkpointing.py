"""Activation checkpointing survives parallelization.

A model's ``torch.utils.checkpoint`` regions (reentrant ones recomputed non-reentrantly),
and the modules named by
``parallelize(..., checkpoint=[...])``, run under checkpoint in the per-rank program: the
activations saved for backward shrink as on a single device, numbers and collective counts
stay exactly those of the uncheckpointed program (recomputation issues no collective again:
fxtp's default policy saves collective results), and a model's own selective-checkpoint
policy is the one used.
"""
import functools

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

import fxtp
from tests.helpers import models
from tests.helpers.parity import check_parity, example

L = 4
PLAN = {"layers.*.attention.w[qkv]": fxtp.ColwiseParallel(),
        "layers.*.attention.wo": fxtp.RowwiseParallel(),
        "layers.*.feed_forward.net1": fxtp.ColwiseParallel(),
        "layers.*.feed_forward.net2": fxtp.RowwiseParallel()}
TP_COUNTS = ({"all_reduce": 2 * L}, {"all_reduce": 2 * L})  # Megatron's minimum


class Stack(nn.Module):
    """``L`` blocks, each called through ``checkpoint`` when ``checkpointed`` (with the
    selective-checkpoint ``context_fn`` when given; ``"reentrant"``: the reentrant form)."""

    def __init__(self, checkpointed=False, context_fn=None):
        super().__init__()
        self.checkpointed, self.context_fn = checkpointed, context_fn
        self.layers = nn.ModuleList(models.Block() for _ in range(L))

    def forward(self, x):
        for layer in self.layers:
            if not self.checkpointed:
                x = layer(x)
            elif self.context_fn is None:
                x = checkpoint(layer, x, use_reentrant=self.checkpointed == "reentrant")
            else:
                x = checkpoint(layer, x, use_reentrant=False, context_fn=self.context_fn)
        return x


def saved_bytes(module, x) -> int:
    """Bytes of the tensors autograd saves for backward in one forward of ``module``."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
    out.sum().backward()
    return total


def parity(rank, world, checkpointed, option):
    return check_parity(rank, world, lambda: Stack(checkpointed), PLAN,
                        [example(2, 8, models.DIM)], dtype=torch.float64, strict=True,
                        checkpoint=["layers.*"] if option else ())


@pytest.mark.parametrize("checkpointed,option",
                         [(True, False), ("reentrant", False), (False, True)],
                         ids=["in-model", "in-model-reentrant", "parallelize-option"])
def test_checkpointed_blocks_match_single_device_with_the_same_collectives(
        ranks, checkpointed, option):
    """strict=True: no fallback. Backward recomputes each block and issues exactly the
    uncheckpointed program's collectives, none twice."""
    assert ranks.run(parity, checkpointed, option)[0] == TP_COUNTS


def test_checkpointing_at_least_halves_the_saved_activations(fake_group):
    fake_group(2)
    x = torch.randn(2, 16, models.DIM)
    plain = saved_bytes(fxtp.parallelize(Stack(), PLAN, example_inputs=(x,)), x)
    in_model = fxtp.parallelize(Stack(checkpointed=True), PLAN, example_inputs=(x,))
    by_option = fxtp.parallelize(Stack(), PLAN, example_inputs=(x,), checkpoint=["layers.*"])
    reentrant = fxtp.parallelize(Stack("reentrant"), PLAN, example_inputs=(x,))
    for gm in (in_model, reentrant):
        regions = [n for n, _ in gm.named_modules() if ".checkpoint_" in n]
        assert regions == [f"layers.{i}.checkpoint_0" for i in range(L)]  # each in its block
    for gm in (in_model, by_option, reentrant):
        assert saved_bytes(gm, x) <= plain / 2, (saved_bytes(gm, x), plain)
        assert fxtp.explain(gm).summary.forward.counts == {"all_reduce": 2 * L}


def _save_matmuls(calls, ctx, op, *args, **kwargs):
    calls.append(op)
    return CheckpointPolicy.MUST_SAVE if op in (torch.ops.aten.mm.default,
                                                 torch.ops.aten.addmm.default) else \
        CheckpointPolicy.PREFER_RECOMPUTE


def test_a_models_own_selective_policy_is_kept(fake_group):
    fake_group(2)
    calls = []
    policy = functools.partial(create_selective_checkpoint_contexts,
                               functools.partial(_save_matmuls, calls))
    x = torch.randn(2, 16, models.DIM)
    gm = fxtp.parallelize(Stack(True, context_fn=policy), PLAN, example_inputs=(x,))
    calls.clear()
    gm(x).sum().backward()
    assert torch.ops.aten.mm.default in calls or torch.ops.aten.addmm.default in calls


def test_a_checkpoint_pattern_matching_nothing_is_an_error(fake_group):
    fake_group(2)
    with pytest.raises(fxtp.PlanError, match=r"checkpoint pattern 'blocks\.\*'.*layers\.0"):
        fxtp.parallelize(Stack(), PLAN, example_inputs=(torch.randn(2, 4, models.DIM),),
                         checkpoint=["blocks.*"])


def compiled(rank, world):
    from tests.helpers.compiled import check_compiled
    return check_compiled(rank, world, lambda: Stack(True), PLAN, [example(2, 8, models.DIM)])


def test_checkpointed_program_compiles_whole_and_matches_eager(ranks2):
    """torch.compile(gm, fullgraph=True): one graph; the recomputed blocks issue no
    collective again in inductor's backward either."""
    counts = ranks2.run(compiled)[0]
    assert counts["eager"] == TP_COUNTS
    assert counts["compiled"] == TP_COUNTS


TORCHTITAN_SAVES = {torch.ops.aten.mm.default,
                    torch.ops.aten._scaled_dot_product_flash_attention.default,
                    torch.ops.aten._scaled_dot_product_efficient_attention.default,
                    torch.ops._c10d_functional.reduce_scatter_tensor.default,
                    torch.ops.aten.max.default}


def torchtitan_op_sac():
    """torchtitan's selective "op" checkpointing ``context_fn``: every other matmul,
    attention and reduce-scatter results are saved, everything else is recomputed."""
    matmuls = {"forward": 0, "recompute": 0}

    def policy(ctx, op, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if op is torch.ops.aten.mm.default:
            matmuls[mode] += 1
        save = op in TORCHTITAN_SAVES and not (op is torch.ops.aten.mm.default and
                                               matmuls[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


def wrap_blocks_with_torchtitan_sac(gm):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    for name, block in list(gm.layers.named_children()):
        gm.layers.register_module(name, checkpoint_wrapper(
            block, context_fn=torchtitan_op_sac, preserve_rng_state=False))


def sac_after_parallelize(rank, world, sac):
    from tests.helpers import transformer_models as tm
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    return check_parity(rank, world, lambda: tm.Llama(tm.LlamaConfig(n_layers=2)),
                        tm.llama_sp_plan(), [tokens], dtype=torch.float64, strict=True,
                        input_grads=False, post=wrap_blocks_with_torchtitan_sac if sac else None)


def test_torchtitans_selective_checkpointing_per_block_trains_as_single_device(ranks2):
    """torchtitan applies its op-level selective checkpointing to each block after TP:
    ``checkpoint_wrapper(gm.layers[i], context_fn=...)``. Numbers are single device's; the
    recomputation issues again exactly the collectives the policy does not save: each
    block's two sequence-parallel all-gathers, and no reduce-scatter."""
    plain = ranks2.run(sac_after_parallelize, False)[0]
    sac = ranks2.run(sac_after_parallelize, True)[0]
    assert plain == ({"reduce_scatter": 5, "all_gather": 6},
                     {"reduce_scatter": 5, "all_reduce": 3, "all_gather": 5})
    assert sac == (plain[0], {**plain[1], "all_gather": 5 + 2 * 2})


class ScaledInPlace(nn.Module):
    """A region that writes in place into a planned projection's output: ``u = up(x);
    u.mul_(0.5)``."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32, bias=False), nn.Linear(32, 16, bias=False)

    def body(self, x):
        u = self.up(x)
        u.mul_(0.5)
        return self.down(torch.relu(u))

    def forward(self, x):
        return checkpoint(self.body, x, use_reentrant=False)


class ResidualInPlace(nn.Module):
    """A region that adds the residual in place into a row-parallel output: ``a = o(x);
    a.add_(x)``."""

    def __init__(self):
        super().__init__()
        self.o, self.mlp = nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False)

    def body(self, x):
        a = self.o(x)
        a.add_(x)
        return a + self.mlp(torch.tanh(a))

    def forward(self, x):
        return checkpoint(self.body, x, use_reentrant=False)


def written_in_region(rank, world, make_model, plan):
    return check_parity(rank, world, make_model, plan, [example(2, 8, 16)],
                        dtype=torch.float64, strict=True)


@pytest.mark.parametrize("make_model, plan, counts", [
    (ScaledInPlace, {"up": fxtp.RowwiseParallel(input_layouts=fxtp.Replicate())},
     ({"all_reduce": 1}, {"all_gather": 1})),
    (ScaledInPlace, {"up": fxtp.ColwiseParallel(), "down": fxtp.RowwiseParallel()},
     ({"all_reduce": 1}, {"all_reduce": 1})),
    (ResidualInPlace, {"o": fxtp.RowwiseParallel()},
     ({"all_reduce": 1}, {"all_gather": 1})),
    (ResidualInPlace, {"o": fxtp.RowwiseParallel(), "mlp": fxtp.ColwiseParallel()},
     ({"all_reduce": 1}, {"all_gather": 2, "all_reduce": 1}))],
    ids=["all_reduced", "column_shard", "residual", "residual_then_colwise"])
def test_a_region_may_write_what_a_planned_module_or_collective_returned(
        ranks, make_model, plan, counts):
    """The region stays whole around the planned module (backward recomputes it, as on one
    device), and the write goes into a copy of a collective's result: the saved result is
    what recomputation reads back. No collective is issued twice."""
    assert ranks.run(written_in_region, make_model, plan)[0] == counts
