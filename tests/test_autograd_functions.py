"""Custom ``torch.autograd.Function`` s run their own backward in the parallelized module:
tracing keeps each call whole (``torch.export`` alone would trace its forward's ops and
differentiate those, silently), fed replicated inputs, gathered where they are sharded."""
import warnings

import pytest
import torch
import torch.nn as nn

import fxtp
from fxtp.autograd_functions import Apply
from tests import models
from tests.parity import check_parity, example

PLAN = {"up": fxtp.ColwiseParallel(), "down": fxtp.RowwiseParallel()}


class Quantize(torch.autograd.Function):
    """Rounds to quarters; the gradient passes straight through, scaled (the forward's own
    derivative is zero almost everywhere)."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class Router(torch.autograd.Function):
    """PhiMoE's pattern: the output is the gate's weight times a mask; the backward ignores
    the mask (straight through) and returns a gradient for the scores only."""

    @staticmethod
    def forward(ctx, scores, mask):
        gates = scores.softmax(-1)
        ctx.save_for_backward(gates)
        return gates * mask

    @staticmethod
    def backward(ctx, grad):
        (gates,) = ctx.saved_tensors
        return gates * (grad - (grad * gates).sum(-1, keepdim=True)), None


class QuantizedMlp(nn.Module):
    """The function on the colwise projection's output: sharded, so gathered."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(models.DIM, 32)
        self.down = nn.Linear(32, models.DIM)

    def forward(self, x):
        return self.down(Quantize.apply(self.up(x), 3.0))


class RoutedMlp(nn.Module):
    """The function on a replicated router's scores: nothing to gather."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(models.DIM, 4)
        self.up = nn.Linear(models.DIM, 32)
        self.down = nn.Linear(32, models.DIM)

    def forward(self, x):
        scores = self.router(x)
        mask = (scores > scores.mean(-1, keepdim=True)).to(x.dtype) * 0.5 + 0.5
        weight = Router.apply(scores, mask)
        return self.down(self.up(x)) * weight[..., :1]  # (the sum's true gradient is zero)


def quantized(rank, world, dtype):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        counts = check_parity(rank, world, QuantizedMlp, PLAN, [example(2, 4, models.DIM)],
                              dtype=dtype)
    return counts, [str(w.message) for w in caught if "fxtp" in str(w.message)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_the_function_runs_its_own_backward_on_gathered_inputs(ranks, dtype):
    (fwd, bwd), messages = ranks.run(quantized, dtype)[0]
    assert len(messages) == 1, messages
    assert "no sharding rule for tests.test_autograd_functions.Quantize.apply" in messages[0]
    assert fwd == {"all_gather": 1, "all_reduce": 1}  # the gather is the fallback's cost
    assert bwd == {"all_gather": 1, "all_reduce": 1}


def routed(rank, world, dtype):
    return check_parity(rank, world, RoutedMlp, PLAN, [example(2, 4, models.DIM)],
                        dtype=dtype, strict=True)


def test_a_function_on_replicated_values_costs_no_collective(ranks):
    fwd, bwd = ranks.run(routed, torch.float64)[0]
    # the MLP's all-reduce forward; backward, the colwise input's and the router's input
    # gradient meet in one all-reduce
    assert fwd == {"all_reduce": 1}
    assert bwd == {"all_reduce": 1}


def test_the_call_is_one_node_and_strict_mode_refuses_a_gather(fake_group):
    fake_group(2)
    x = torch.randn(2, 4, models.DIM)
    gm = fxtp.parallelize(RoutedMlp(), PLAN, example_inputs=(x,), strict=True)
    calls = [n for n in gm.graph.nodes if isinstance(n.target, Apply)]
    assert [n.target.function for n in calls] == [Router]
    with pytest.raises(fxtp.ShardingError, match=r"Quantize\.apply.*strict"):
        fxtp.parallelize(QuantizedMlp(), PLAN, example_inputs=(x,), strict=True)


def test_without_gradients_the_forward_is_traced_and_sharded(fake_group):
    fake_group(2)
    with torch.no_grad():
        gm = fxtp.parallelize(QuantizedMlp(), PLAN,
                              example_inputs=(torch.randn(2, 4, models.DIM),), strict=True)
    assert not [n for n in gm.graph.nodes if isinstance(n.target, Apply)]
    assert gm.fxtp.fallbacks == []
