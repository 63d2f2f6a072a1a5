"""Custom ``torch.autograd.Function`` s run their own backward in the parallelized module:
tracing keeps each call whole (``torch.export`` alone would trace its forward's ops and
differentiate those, silently). An elementwise function (its forward and backward traced
on the call's shapes run only pointwise ops) runs on shards; any other is fed replicated
inputs, gathered where they are sharded."""
import warnings

import pytest
import torch
import torch.nn as nn

import fxtp
from fxtp.frontend.autograd_functions import Apply, is_elementwise
from tests.helpers import models
from tests.helpers.parity import check_parity, example

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


class RowQuantize(torch.autograd.Function):
    """Rounds each row to quarters of its largest magnitude, the gradient straight through:
    the scale reads the whole row, so the function is not elementwise."""

    @staticmethod
    def forward(ctx, x):
        scale = x.abs().amax(-1, keepdim=True) / 4
        return torch.round(x / scale) * scale

    @staticmethod
    def backward(ctx, grad):
        return grad * 0.5


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
    """The function on the colwise projection's output, which is sharded."""

    def __init__(self, rows=False):
        super().__init__()
        self.rows = rows
        self.up = nn.Linear(models.DIM, 32)
        self.down = nn.Linear(32, models.DIM)

    def forward(self, x):
        h = self.up(x)
        return self.down(RowQuantize.apply(h) if self.rows else Quantize.apply(h, 3.0))


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


def quantized(rank, world, dtype, rows):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        counts = check_parity(rank, world, lambda: QuantizedMlp(rows), PLAN,
                              [example(2, 4, models.DIM)], dtype=dtype)
    return counts, [str(w.message) for w in caught if "fxtp" in str(w.message)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_an_elementwise_function_runs_its_own_backward_on_shards(ranks, dtype):
    """A straight-through estimator: no gather, Megatron's two all-reduces."""
    (fwd, bwd), messages = ranks.run(quantized, dtype, False)[0]
    assert messages == []
    assert fwd == {"all_reduce": 1}
    assert bwd == {"all_reduce": 1}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_the_function_runs_its_own_backward_on_gathered_inputs(ranks, dtype):
    (fwd, bwd), messages = ranks.run(quantized, dtype, True)[0]
    assert len(messages) == 1, messages
    assert "no sharding rule for tests.frontend.test_autograd_functions.RowQuantize.apply" in \
        messages[0]
    assert fwd == {"all_gather": 1, "all_reduce": 1}  # the gather is the fallback's cost
    assert bwd == {"all_gather": 1, "all_reduce": 1}


def quantized_dynamic(rank, world):
    from torch.export import Dim
    inputs = [[example(2, t, models.DIM)] for t in (6, 3, 5)]
    return check_parity(rank, world, QuantizedMlp, PLAN, [example(2, 4, models.DIM)],
                        dtype=torch.float64, strict=True, inputs_per_step=inputs,
                        dynamic_shapes=({1: Dim("seq", min=2, max=16)},))


def test_an_elementwise_function_on_a_dynamic_dim_runs_on_shards(ranks):
    """The call is judged elementwise at the sizes traced; every length then runs at
    parity with Megatron's two all-reduces."""
    assert ranks.run(quantized_dynamic)[0] == ({"all_reduce": 1}, {"all_reduce": 1})


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
    with pytest.raises(fxtp.ShardingError, match=r"RowQuantize\.apply.*strict"):
        fxtp.parallelize(QuantizedMlp(rows=True), PLAN, example_inputs=(x,), strict=True)
    gm = fxtp.parallelize(QuantizedMlp(), PLAN, example_inputs=(x,), strict=True)
    assert [n.target.elementwise for n in gm.graph.nodes if isinstance(n.target, Apply)] \
        == [True]


def test_without_gradients_the_forward_is_traced_and_sharded(fake_group):
    fake_group(2)
    with torch.no_grad():
        gm = fxtp.parallelize(QuantizedMlp(), PLAN,
                              example_inputs=(torch.randn(2, 4, models.DIM),), strict=True)
    assert not [n for n in gm.graph.nodes if isinstance(n.target, Apply)]
    assert gm.fxtp.fallbacks == []


class Summing(torch.autograd.Function):
    """Elementwise forward, a backward that adds up the row: not elementwise."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad.sum(-1, keepdim=True).expand_as(grad)


class Scaled(torch.autograd.Function):
    """``x * y`` by the new-style ``setup_context``, saving both for backward."""

    @staticmethod
    def forward(x, y):
        return x * y

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        return grad * y, grad * x


class Dropped(torch.autograd.Function):
    """Random in forward: a shard would draw other numbers than the whole."""

    @staticmethod
    def forward(ctx, x):
        return torch.nn.functional.dropout(x, 0.5)

    @staticmethod
    def backward(ctx, grad):
        return grad


@pytest.mark.parametrize("function,args,expected", [
    (Quantize, [torch.randn(2, 3, 8), 3.0], True),
    (Scaled, [torch.randn(2, 8), torch.randn(2, 8)], True),
    (RowQuantize, [torch.randn(2, 3, 8)], False),
    (Summing, [torch.randn(2, 8)], False),
    (Scaled, [torch.randn(2, 8), torch.randn(8)], False),  # broadcasting: shapes differ
    (Dropped, [torch.randn(2, 8)], False),
], ids=["straight_through", "setup_context", "row_scale", "summing_backward",
        "broadcast", "random"])
def test_a_function_is_elementwise_only_if_forward_and_backward_are(function, args,
                                                                    expected):
    assert is_elementwise(function, args, {}) is expected
