"""Ops without a sharding rule: gathered to Replicate with a warning (still correct), or an
error under strict=True."""
import warnings

import pytest
import torch
import torch.nn as nn

import fxtp
from tests import models
from tests.parity import check_parity, example

PLAN = {"up": fxtp.ColwiseParallel(), "down": fxtp.RowwiseParallel()}


class CumsumMix(nn.Module):
    def forward(self, h):
        return torch.cumsum(h, dim=-1)  # mixes the sharded features: no rule in fxtp


class Unruled(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(models.DIM, 32)
        self.mix = CumsumMix()
        self.down = nn.Linear(32, models.DIM)

    def forward(self, x):
        return self.down(self.mix(self.up(x)))


def unruled(rank, world, dtype):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        counts = check_parity(rank, world, Unruled, PLAN,
                              [example(2, 4, models.DIM)], dtype=dtype)
    return counts, [str(w.message) for w in caught if "fxtp" in str(w.message)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_op_without_rule_is_gathered_correctly_and_reported(ranks, dtype):
    (fwd, bwd), messages = ranks.run(unruled, dtype)[0]
    assert len(messages) == 1
    assert "aten.cumsum.default" in messages[0] and "module 'mix'" in messages[0]
    assert fwd == {"all_gather": 1, "all_reduce": 1}  # the gather is the fallback's cost
    # backward: the shard before `down` all-gathers its gradient; the colwise input
    # gradient is all-reduced
    assert bwd == {"all_gather": 1, "all_reduce": 1}


def test_strict_mode_turns_the_fallback_into_an_error(fake_group):
    fake_group(2)
    with pytest.raises(fxtp.ShardingError, match=r"aten\.cumsum\.default.*module 'mix'.*strict"):
        fxtp.parallelize(Unruled(), PLAN, example_inputs=(torch.randn(2, 4, models.DIM),),
                         strict=True)


def test_replicated_inputs_need_no_rule_and_raise_no_warning(fake_group):
    fake_group(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gm = fxtp.parallelize(Unruled(), {"down": fxtp.ColwiseParallel()},
                              example_inputs=(torch.randn(2, 4, models.DIM),), strict=True)
    assert gm.fxtp.fallbacks == []


class SoftmaxMix(Unruled):
    """softmax over the sharded feature dim has a rule, whose only valid strategy for that
    dim is Replicate: the rule itself asks for the gather (no warning: nothing is missing)."""

    def forward(self, x):
        return self.down(torch.softmax(self.up(x), dim=-1))


def softmax_mix(rank, world):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return check_parity(rank, world, SoftmaxMix, PLAN, [example(2, 4, models.DIM)],
                            dtype=torch.float64)


def test_an_op_that_cannot_shard_its_dim_gathers_it_correctly(ranks):
    fwd, bwd = ranks.run(softmax_mix)[0]
    assert fwd == {"all_gather": 1, "all_reduce": 1}
    assert bwd == {"all_gather": 1, "all_reduce": 1}
