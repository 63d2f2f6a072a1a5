"""Planned modules whose ``forward`` takes non-tensor arguments (a dataclass of options, a
callable, ``None``) trace and pass them through untouched; only tensors get layouts, and a
``None`` layout for a non-tensor argument is accepted."""
import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxtp
from fxtp import Replicate, Shard
from tests.helpers import models
from tests.helpers.parity import check_parity, example


@dataclasses.dataclass
class Options:
    scale: float = 2.0
    activation: object = F.gelu


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(models.DIM, 32)
        self.down = nn.Linear(32, models.DIM)

    def forward(self, x, options, mask=None, *, bias=None):
        h = options.activation(self.up(x)) * options.scale
        if mask is not None:
            h = h * mask
        return self.down(h) + (0 if bias is None else bias)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(models.DIM)
        self.ffn = FeedForward()

    def forward(self, x):
        return self.ffn(self.norm(x), Options(3.0, torch.tanh), None, bias=None)


PLAN = {
    "norm": fxtp.SequenceParallel(),
    "ffn": fxtp.PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                   desired_input_layouts=(Replicate(), None, None)),
    "ffn.up": fxtp.ColwiseParallel(),
    "ffn.down": fxtp.RowwiseParallel(output_layouts=Shard(1)),
}


def parity(rank, world):
    plan = {"": fxtp.PrepareModuleInput(input_layouts=Shard(1),
                                        desired_input_layouts=Shard(1)), **PLAN}
    return check_parity(rank, world, Model, plan, [example(2, 8, models.DIM)],
                        input_placements=[Shard(1)], dtype=torch.float64, strict=True)


def test_non_tensor_arguments_pass_through_a_planned_boundary(ranks):
    """Sequence-parallel norm, its output gathered at the planned module's tensor input,
    the rowwise output reduce-scattered back: the dataclass and the Nones untouched."""
    fwd, bwd = ranks.run(parity)[0]
    assert fwd == {"all_gather": 1, "reduce_scatter": 1}
    assert bwd == {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1}


class Window(nn.Module):
    """litgpt's ``input_pos_maxp1``: an int saying how much of a sequence to read."""

    def __init__(self):
        super().__init__()
        self.mlp = models.MLP()

    def forward(self, x, length: int):
        return self.mlp(x)[:, :length]


def test_an_int_declared_dynamic_is_an_input_of_the_program(fake_group):
    """``Dim.DYNAMIC`` on an int argument makes it an input: each call's value is used,
    as on a single device, and only a value of its kind is taken."""
    import pytest
    from torch.export import Dim
    fake_group(2)
    model = Window()
    x = torch.randn(2, 8, models.DIM)
    gm = fxtp.parallelize(model, {"mlp.net1": fxtp.ColwiseParallel(),
                                  "mlp.net2": fxtp.RowwiseParallel()},
                          example_inputs=(x, 4), dynamic_shapes=(None, Dim.DYNAMIC))
    for length in (3, 6):
        assert gm(x, length).shape == model(x, length).shape == (2, length, models.DIM)
    with pytest.raises(fxtp.InputError, match=r"input 'length' must be of type int \(declared "
                                              r"dynamic in dynamic_shapes\); got 2\.5"):
        gm(x, 2.5)
