"""Regions export wraps in higher-order ops: autocast and grad-mode regions are inlined with
their meaning kept; other higher-order ops are a TraceError naming them and the module.

Autocast: the region's ops run between ``_enter_autocast`` / ``_exit_autocast`` calls, so
each computes in the dtype single-device autocast gives it (bf16 matmuls inside, fp32
outside), planned modules inside the region keep their boundaries, and the collectives of
the plan are Megatron's minimum.
"""
import pytest
import torch
import torch.nn as nn

import fxtp
from fxtp.passes.modules import inline_program
from tests.helpers import models
from tests.helpers.compiled import check_compiled
from tests.helpers.models import FlexAttention
from tests.helpers.parity import check_parity, example

PLAN = {"blocks.*.attention.w[qkv]": fxtp.ColwiseParallel(),
        "blocks.*.attention.wo": fxtp.RowwiseParallel(),
        "blocks.*.feed_forward.net1": fxtp.ColwiseParallel(),
        "blocks.*.feed_forward.net2": fxtp.RowwiseParallel()}


class Mixed(nn.Module):
    """Two blocks: the first under ``torch.autocast(bf16)``, the second in fp32."""

    def __init__(self, enabled=True):
        super().__init__()
        self.enabled = enabled
        self.blocks = nn.ModuleList(models.Block() for _ in range(2))

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.enabled):
            h = self.blocks[0](x)
        return self.blocks[1](h.float())


def autocast_parity(rank, world, enabled):
    return check_parity(rank, world, lambda: Mixed(enabled), PLAN,
                        [example(2, 8, models.DIM)], dtype=torch.float32, strict=True,
                        compare_dtype=torch.bfloat16 if enabled else torch.float32,
                        steps=1 if enabled else 3)


@pytest.mark.parametrize("enabled", [True, False], ids=["bf16", "disabled"])
def test_autocast_region_matches_single_device_autocast(ranks, enabled):
    """bf16 tolerance where autocast is on (forward, every gradient, the parameters after
    one AdamW step: further steps compound bf16 rounding, which Adam's per-element
    normalization amplifies); fp32's, over 3 steps, where the region is disabled."""
    assert ranks.run(autocast_parity, enabled)[0] == ({"all_reduce": 4}, {"all_reduce": 4})


def test_autocast_keeps_its_dtypes(fake_group):
    """Inside the region the block's matmuls give bf16, as on a single device; outside,
    fp32."""
    fake_group(2)
    gm = fxtp.parallelize(Mixed(), PLAN, example_inputs=(torch.randn(2, 8, models.DIM),))
    linears = [n for n in inline_program(gm).nodes if n.target is torch.ops.aten.linear.default]
    dtypes = {n.meta["val"].dtype for n in linears}
    assert dtypes == {torch.bfloat16, torch.float32}
    assert "_enter_autocast" in gm.code and "_exit_autocast" in gm.code
    assert gm(torch.randn(2, 8, models.DIM)).dtype == torch.float32


def compiled_autocast(rank, world):
    return check_compiled(rank, world, Mixed, PLAN, [example(2, 8, models.DIM)],
                          dtype=torch.float32, compare_dtype=torch.bfloat16)


def test_autocast_region_compiles_whole(ranks2):
    counts = ranks2.run(compiled_autocast)[0]
    assert counts["eager"] == counts["compiled"] == ({"all_reduce": 4}, {"all_reduce": 4})


class WithCond(nn.Module):
    """A data-dependent branch between a colwise and a rowwise projection. ``agree``: both
    branches act elementwise (each keeps the shards); otherwise one sorts the sharded
    features (it needs them whole)."""

    def __init__(self, agree=True):
        super().__init__()
        self.agree = agree
        self.up = nn.Linear(models.DIM, 32)
        self.down = nn.Linear(32, models.DIM)

    def forward(self, x):
        h = self.up(x)
        other = (lambda h: h.tanh() * 2) if self.agree else (lambda h: h.sort(-1).values)
        h = torch.cond(h.sum() > 0, lambda h: h.relu(), other, (h,))
        return self.down(h)


COND_PLAN = {"up": fxtp.ColwiseParallel(), "down": fxtp.RowwiseParallel()}


def cond_parity(rank, world, agree, sign):
    x = example(2, 4, models.DIM) * sign  # the sign picks the branch
    return check_parity(rank, world, lambda: WithCond(agree), COND_PLAN, [x],
                        dtype=torch.float64, strict=agree)


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["true-branch", "false-branch"])
def test_cond_branches_run_on_shards(ranks, sign):
    """The predicate (a sum of shards) is all-reduced; each branch runs on the colwise
    shards; the rowwise projection reduces after: 2 all-reduces forward, 1 backward."""
    assert ranks.run(cond_parity, True, sign)[0] == ({"all_reduce": 2}, {"all_reduce": 1})


def test_cond_branches_that_disagree_are_reconciled_and_reported(ranks2, fake_group):
    ranks2.run(cond_parity, False, -1.0)
    fake_group(2)
    gm = fxtp.parallelize(WithCond(agree=False), COND_PLAN,
                          example_inputs=(torch.randn(2, 4, models.DIM),))
    assert any("branches give output 0 as S(2) and R; both give it replicated" in m
               for m in gm.fxtp.fallbacks), gm.fxtp.fallbacks


class WithUnsupported(nn.Module):
    """A recurrence written with ``scan`` (a higher-order op fxtp does not parallelize)."""

    def forward(self, x):
        from torch._higher_order_ops.scan import scan
        return scan(lambda carry, row: (carry + row, carry * 2), x[0], x)[1]


def test_an_unsupported_higher_order_op_is_a_trace_error_naming_it(fake_group):
    fake_group(2)
    with pytest.raises(fxtp.TraceError, match=r"module '<root>' calls the higher-order op "
                                              r"scan .*cannot parallelize"):
        fxtp.parallelize(WithUnsupported(), {}, example_inputs=(torch.randn(3, 4),))


FLEX_PLAN = {"w[qkv]": fxtp.ColwiseParallel(), "wo": fxtp.RowwiseParallel()}


def flex_forward(rank, world):
    torch.manual_seed(0)
    model = FlexAttention().requires_grad_(False)  # CPU flex attention cannot trace grads
    x = example(2, 16, 32)
    gm = fxtp.parallelize(model, FLEX_PLAN, example_inputs=(x,), strict=True)
    with torch.no_grad(), fxtp.count_collectives() as counts:
        out = gm(x)
    torch.testing.assert_close(out, model(x).detach())
    return dict(counts.counts)


def test_flex_attention_shards_by_heads_with_global_head_indices(ranks):
    """Forward only (torch has no CPU backward for flex_attention): each rank attends with
    its heads, its score function sees their global indices; one all-reduce after wo."""
    assert ranks.run(flex_forward)[0] == {"all_reduce": 1}
