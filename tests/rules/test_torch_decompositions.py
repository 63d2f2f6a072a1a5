"""Ops with a kernel of their own but no rule (torch tags them no ``pointwise``): where a
sharded or partial value reaches one, it becomes torch's own decomposition of it
(``torch._decomp``), whose ops have rules, instead of a gather. Regression and
preference-tuning losses on a sequence-parallel output, and activations on a colwise
shard, stay sharded: Megatron's collectives and one all-reduce of the loss, no fallback."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Shard

import fxtp
from tests.helpers.parity import check_parity, example

D, H = 16, 32
# name: the loss of the sequence-sharded prediction y against a replicated target t
LOSSES = {
    "mse_loss": lambda y, t: F.mse_loss(y, t),
    "mse_loss_sum": lambda y, t: F.mse_loss(y, t, reduction="sum"),
    "huber_loss": lambda y, t: F.huber_loss(y, t, delta=0.5),
    "smooth_l1_loss": lambda y, t: F.smooth_l1_loss(y, t, beta=0.5),
    "soft_margin_loss": lambda y, t: F.soft_margin_loss(y, t.sign()),
    "binary_cross_entropy_with_logits": lambda y, t: F.binary_cross_entropy_with_logits(
        y, t.sigmoid(), pos_weight=torch.linspace(0.5, 2, D, dtype=t.dtype)),
    "binary_cross_entropy": lambda y, t: F.binary_cross_entropy(y.sigmoid(), t.sigmoid()),
    "logsigmoid": lambda y, t: -F.logsigmoid(y - t).mean(),  # DPO's form
    "rsub": lambda y, t: torch.rsub(y, t).square().mean(),
    "floor_divide": lambda y, t: (y * torch.floor_divide(t, 0.5)).mean(),
}


class Regressor(nn.Module):
    """An MLP whose output leaves it sharded along the sequence (SP's layout), then a
    loss."""

    def __init__(self, loss):
        super().__init__()
        self.up, self.down, self.loss = nn.Linear(D, H), nn.Linear(H, D), loss

    def forward(self, x, target):
        return LOSSES[self.loss](self.down(F.gelu(self.up(x))), target)


SP_OUT = {"up": fxtp.ColwiseParallel(), "down": fxtp.RowwiseParallel(output_layouts=Shard(1))}


def loss_parity(rank, world, loss, dtype):
    return check_parity(rank, world, lambda: Regressor(loss), SP_OUT,
                        [example(2, 8, D), example(2, 8, D, seed=2)], dtype=dtype,
                        input_grads=False, strict=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_a_loss_of_a_sequence_sharded_output_matches_single_device(ranks, loss, dtype):
    """Forward the rowwise projection's reduce-scatter and one all-reduce of the loss's
    partial sums; backward the reduce-scatter's all-gather and the all-reduce of the
    rowwise bias's gradient (added to sequence shards, as in SP). Before, the prediction
    was gathered (strict mode: an error)."""
    assert ranks.run(loss_parity, loss, dtype)[0] == \
        ({"reduce_scatter": 1, "all_reduce": 1}, {"all_gather": 1, "all_reduce": 1})


# name: an elementwise function of the colwise shard h whose kernel torch tags no pointwise
ACTIVATIONS = {
    "hardswish": F.hardswish,  # MobileNetV3's
    "prelu": lambda h: F.prelu(h, torch.tensor([0.25], dtype=h.dtype)),
    "polar": lambda h: torch.view_as_real(torch.polar(h.abs(), h)).sum(-1),
    "aminmax": lambda h: h - torch.aminmax(h, dim=-1, keepdim=True).min,
}
# beyond Megatron's all-reduce each way: aminmax's min over the sharded features, its
# replicated result's gradient read by every shard, and the count of its ties
EXTRA = {"aminmax": ({"all_reduce": 1}, {"all_reduce": 2})}


class ActivatedMLP(nn.Module):
    def __init__(self, activation):
        super().__init__()
        self.up, self.down, self.activation = nn.Linear(D, H), nn.Linear(H, D), activation

    def forward(self, x):
        return self.down(ACTIVATIONS[self.activation](self.up(x)))


def activation_parity(rank, world, activation, dtype):
    return check_parity(rank, world, lambda: ActivatedMLP(activation),
                        {"up": fxtp.ColwiseParallel(), "down": fxtp.RowwiseParallel()},
                        [example(2, 8, D)], dtype=dtype, strict=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_an_elementwise_op_torch_tags_no_pointwise_keeps_the_shard(ranks, activation, dtype):
    """Megatron's one all-reduce each way, as for GELU (and :data:`EXTRA`'s)."""
    extra = EXTRA.get(activation, ({}, {}))
    assert ranks.run(activation_parity, activation, dtype)[0] == \
        tuple({"all_reduce": 1 + e.get("all_reduce", 0)} for e in extra)


class Sampled(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x):
        return self.down(torch.bernoulli(self.up(x).sigmoid()))


def test_a_random_op_is_not_decomposed_onto_shards(fake_group):
    """``bernoulli`` has a decomposition, but a shard would draw other numbers than its
    part of the whole: it stays a reported gather (strict: an error naming it)."""
    fake_group(2)
    with pytest.raises(fxtp.ShardingError, match=r"aten\.bernoulli\.default"):
        fxtp.parallelize(Sampled(), {"up": fxtp.ColwiseParallel(),
                                     "down": fxtp.RowwiseParallel()},
                         example_inputs=(torch.randn(2, 8, D),), strict=True)
