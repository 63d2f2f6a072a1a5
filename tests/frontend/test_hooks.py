"""The model's hooks in the parallelized module: a gradient hook its ``forward`` registers
keeps running, on the whole gradient (``torch.export`` alone would drop it, silently);
module backward hooks, which the traced program could not run, are refused by name;
forward hooks and parameter hooks, whose side effects would not recur, are warned of."""
import warnings

import pytest
import torch
import torch.nn as nn

import fxtp
from fxtp.frontend.hooks import GradientHooks
from tests.helpers import models
from tests.helpers.parity import check_parity, example

PLAN = {"up": fxtp.ColwiseParallel(), "down": fxtp.RowwiseParallel()}
BLOCKS_PLAN = {f"blocks.{i}.{name}": style for i in range(3) for name, style in PLAN.items()}


def unit_max(grad):
    """A hook whose result depends on the whole gradient: on a shard, another number."""
    return grad / grad.abs().amax()


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(models.DIM, 32)
        self.down = nn.Linear(32, models.DIM)
        self.gain = nn.Parameter(torch.ones(models.DIM))


class HookedMlp(Mlp):
    """Two hooks on the colwise projection's output (sharded, so gathered for them): one
    that reads the whole gradient, one that changes nothing."""

    def forward(self, x):
        h = self.up(x * self.gain)
        if h.requires_grad:
            h.register_hook(unit_max)
            h.register_hook(lambda grad: None)
        return self.down(torch.relu(h)) + h.mean(-1, keepdim=True)


class InputHookedMlp(Mlp):
    """A hook on the MLP's scaled input, which every rank holds whole: nothing to gather;
    its gradient is all-reduced before the hook sees it."""

    def forward(self, x):
        x = x * self.gain
        if x.requires_grad:
            x.register_hook(unit_max)
        return self.down(torch.relu(self.up(x)))


HOOKED_BLOCKS = []  # the block each gradient hook was registered by, as the hooks run


class SelfHookedMlp(Mlp):
    """A hook that closes over its block (on a replicated tensor: no fallback, which
    would keep the blocks from being traced once for all)."""

    def forward(self, x):
        x = x * self.gain
        x.register_hook(lambda grad: HOOKED_BLOCKS.append(self))
        return self.down(torch.relu(self.up(x)))


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(SelfHookedMlp() for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def hooked(rank, world, dtype):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        counts = check_parity(rank, world, HookedMlp, PLAN, [example(2, 4, models.DIM)],
                              dtype=dtype)
    return counts, [str(w.message) for w in caught if "fxtp" in str(w.message)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_a_gradient_hook_from_forward_runs_on_the_whole_gradient(ranks, dtype):
    (fwd, bwd), messages = ranks.run(hooked, dtype)[0]
    assert len(messages) == 1, messages
    assert "no sharding rule for gradient_hooks(unit_max, HookedMlp.forward" in messages[0]
    assert fwd == {"all_gather": 1, "all_reduce": 1}  # the gather is the fallback's cost
    assert bwd == {"all_gather": 1, "all_reduce": 1}


def input_hooked(rank, world, dtype):
    return check_parity(rank, world, InputHookedMlp, PLAN, [example(2, 4, models.DIM)],
                        dtype=dtype, strict=True)


def test_a_hook_on_a_replicated_tensor_costs_no_collective(ranks):
    fwd, bwd = ranks.run(input_hooked, torch.float64)[0]
    assert fwd == {"all_reduce": 1}
    assert bwd == {"all_reduce": 1}


def test_hooks_run_in_the_order_registered_and_a_removed_one_not_at_all(fake_group):
    fake_group(2)
    ran = []

    class Ordered(Mlp):
        def forward(self, x):
            h = self.up(x * self.gain)
            h.register_hook(lambda grad: ran.append("first") or grad * 2)
            h.register_hook(lambda grad: ran.append("removed")).remove()
            h.register_hook(lambda grad: ran.append("second"))
            return self.down(h)

    x = torch.randn(2, 4, models.DIM)
    gm = fxtp.parallelize(Ordered(), PLAN, example_inputs=(x,))
    assert len([n for n in gm.graph.nodes if isinstance(n.target, GradientHooks)]) == 1
    assert ran == []  # tracing did not run them
    gm(x).sum().backward()
    assert ran == ["first", "second"]


def test_each_block_runs_its_own_hook(fake_group):
    """(Blocks 1 and 2 are equal in every way a trace sees: one trace would serve both,
    calling block 1's hook for block 2.)"""
    fake_group(2)
    model = Blocks()
    x = torch.randn(2, 4, models.DIM)
    gm = fxtp.parallelize(model, BLOCKS_PLAN, example_inputs=(x,))
    HOOKED_BLOCKS.clear()
    gm(x).sum().backward()
    assert HOOKED_BLOCKS == [model.blocks[2], model.blocks[1], model.blocks[0]]  # last first


def test_strict_mode_refuses_to_gather_for_a_hook(fake_group):
    fake_group(2)
    with pytest.raises(fxtp.ShardingError, match=r"gradient_hooks\(unit_max.*strict"):
        fxtp.parallelize(HookedMlp(), PLAN, example_inputs=(torch.randn(2, 4, models.DIM),),
                         strict=True)


def test_backward_hooks_on_a_module_are_refused_by_name(fake_group):
    fake_group(2)
    model = HookedMlp()
    model.down.register_full_backward_hook(lambda module, grad_in, grad_out: None)
    with pytest.raises(fxtp.TraceError, match=r"module 'down' has backward hooks.*"
                                              r"gm\.get_submodule"):
        fxtp.parallelize(model, PLAN, example_inputs=(torch.randn(2, 4, models.DIM),))


def test_forward_and_parameter_hooks_are_warned_of_by_name(fake_group):
    fake_group(2)
    model = InputHookedMlp()
    model.up.register_forward_hook(lambda module, args, out: None)
    model.down.weight.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.warns(UserWarning, match=r"forward hooks of 'up'.*ran once, while tracing"), \
            pytest.warns(UserWarning, match=r"parameter 'down.weight' stay"):
        fxtp.parallelize(model, PLAN, example_inputs=(torch.randn(2, 4, models.DIM),))


def test_hooks_registered_on_the_result_run_on_every_call(fake_group):
    fake_group(2)
    x = torch.randn(2, 4, models.DIM)
    gm = fxtp.parallelize(InputHookedMlp(), PLAN, example_inputs=(x,))
    ran = []
    gm.get_submodule("up").register_forward_hook(lambda m, args, out: ran.append("forward"))
    gm.get_submodule("down").register_full_backward_hook(lambda m, gi, go: ran.append("back"))
    gm.get_parameter("down.weight").register_post_accumulate_grad_hook(
        lambda p: ran.append("accumulated"))
    for _ in range(2):
        gm(x).sum().backward()
    assert ran == ["forward", "accumulated", "back"] * 2
