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
from tests import models
from tests.compiled import check_compiled
from tests.parity import check_parity, example

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
    linears = [n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    dtypes = {n.meta["val"].dtype for n in linears}
    assert dtypes == {torch.bfloat16, torch.float32}
    assert "_enter_autocast" in gm.code and "_exit_autocast" in gm.code
    assert gm(torch.randn(2, 8, models.DIM)).dtype == torch.float32


def compiled_autocast(rank, world):
    return check_compiled(rank, world, Mixed, PLAN, [example(2, 8, models.DIM)],
                          dtype=torch.float32)


def test_autocast_region_compiles_whole(ranks2):
    counts = ranks2.run(compiled_autocast)[0]
    assert counts["eager"] == counts["compiled"] == ({"all_reduce": 4}, {"all_reduce": 4})


class WithCond(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(models.DIM, 32)
        self.down = nn.Linear(32, models.DIM)

    def forward(self, x):
        h = self.up(x)
        h = torch.cond(h.sum() > 0, lambda h: h.relu(), lambda h: h.tanh(), (h,))
        return self.down(h)


def test_an_unsupported_higher_order_op_is_a_trace_error_naming_it(fake_group):
    fake_group(2)
    with pytest.raises(fxtp.TraceError, match=r"module '<root>' calls the higher-order op "
                                              r"cond .*cannot parallelize"):
        fxtp.parallelize(WithCond(), {"up": fxtp.ColwiseParallel(),
                                      "down": fxtp.RowwiseParallel()},
                         example_inputs=(torch.randn(2, 4, models.DIM),))
