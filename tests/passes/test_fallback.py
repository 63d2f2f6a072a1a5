"""Fallbacks: an op without a sharding rule, or whose rule cannot keep a sharded input
sharded, gathers it to Replicate with a warning naming op, module and reason (still
correct), or raises under strict=True."""
import warnings

import pytest
import torch

import fxtp
from tests.helpers import models
from tests.helpers.models import UNRULED_PLAN, Unruled
from tests.helpers.parity import check_parity, example


def unruled(rank, world, dtype):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        counts = check_parity(rank, world, Unruled, UNRULED_PLAN,
                              [example(2, 4, models.DIM)], dtype=dtype)
    return counts, [str(w.message) for w in caught if "fxtp" in str(w.message)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_op_without_rule_is_gathered_correctly_and_reported(ranks, dtype):
    (fwd, bwd), messages = ranks.run(unruled, dtype)[0]
    assert len(messages) == 1
    assert "no sharding rule for aten._fft_r2c.default" in messages[0]
    assert "module 'mix'" in messages[0]
    assert fwd == {"all_gather": 1, "all_reduce": 1}  # the gather is the fallback's cost
    # backward: the shard before `down` all-gathers its gradient; the colwise input
    # gradient is all-reduced
    assert bwd == {"all_gather": 1, "all_reduce": 1}


def test_strict_mode_turns_the_fallback_into_an_error(fake_group):
    fake_group(2)
    with pytest.raises(fxtp.ShardingError, match=r"aten\._fft_r2c\.default.*module 'mix'.*strict"):
        fxtp.parallelize(Unruled(), UNRULED_PLAN, example_inputs=(torch.randn(2, 4, models.DIM),),
                         strict=True)


def test_replicated_inputs_need_no_rule_and_raise_no_warning(fake_group):
    fake_group(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gm = fxtp.parallelize(Unruled(), {"down": fxtp.ColwiseParallel()},
                              example_inputs=(torch.randn(2, 4, models.DIM),), strict=True)
    assert gm.fxtp.fallbacks == []


class SortMix(Unruled):
    """A sort over the sharded feature dim has a rule, whose only strategy for that dim is
    Replicate: the gather is reported like a missing rule, naming op, module and
    reason."""

    def forward(self, x):
        return self.down(torch.sort(self.up(x), dim=-1).values)


def sort_mix(rank, world):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        counts = check_parity(rank, world, SortMix, UNRULED_PLAN, [example(2, 4, models.DIM)],
                              dtype=torch.float64)
    return counts, [str(w.message) for w in caught if "fxtp" in str(w.message)]


def test_an_op_that_cannot_shard_its_dim_gathers_it_correctly_and_says_so(ranks):
    (fwd, bwd), messages = ranks.run(sort_mix)[0]
    assert fwd == {"all_gather": 1, "all_reduce": 1}
    assert bwd == {"all_gather": 1, "all_reduce": 1}
    assert messages == ["fxtp: aten.sort.default (node 'sort' in module '<root>') gathers "
                        "input 0 (S(2), shape (2, 4, 32)) to R: no strategy of its rule keeps "
                        "that dim sharded"]


def test_a_head_count_that_cannot_be_dealt_whole_is_a_fallback(fake_group):
    """3 heads on 4 ranks: fewer heads than ranks, and 3 does not divide 4, so no rank
    group can hold a whole head (6 heads would be dealt 2, 2, 2, 0:
    ``tests/passes/test_uneven.py``).
    The colwise projection's output cannot be viewed as head shards; the gather is reported
    with the module and the sizes."""
    fake_group(4)
    model = models.Attention(dim=48, n_heads=3)
    with pytest.warns(UserWarning, match="size 3") as caught:
        gm = fxtp.parallelize(model, {"wq": fxtp.ColwiseParallel(),
                                      "wk": fxtp.ColwiseParallel(),
                                      "wv": fxtp.ColwiseParallel(),
                                      "wo": fxtp.RowwiseParallel()},
                              example_inputs=(torch.randn(2, 4, 48),))
    assert [str(w.message) for w in caught] == ["fxtp: " + m for m in gm.fxtp.fallbacks]
    assert len(gm.fxtp.fallbacks) == 3  # q, k and v
    for message in gm.fxtp.fallbacks:
        assert ("aten.view.default" in message or "aten.reshape.default" in message) and \
            "gathers input 0 (S(2), shape (2, 4, 48))" \
            in message and "dim 2 of output 0 (size 3) does not divide by the world size 4" \
            in message
