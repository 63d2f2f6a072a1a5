"""``gm.train()`` / ``gm.eval()`` switch the program: a trace records the mode the model was
in (dropout on or off, batch statistics or running ones), so evaluating the module one
trains runs the eval program, as on a single device."""
import copy

import pytest
import torch
import torch.nn as nn

import fxtp
from fxtp.passes.graph import PLACEMENT
from tests.helpers import models
from tests.helpers.parity import example, local_of, tolerance

PLAN = {"up": fxtp.ColwiseParallel(), "down": fxtp.RowwiseParallel()}


class NormedMlp(nn.Module):
    """Batch norm (running statistics in eval) before an MLP with dropout inside."""

    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(models.DIM)
        self.up = nn.Linear(models.DIM, 32)
        self.drop = nn.Dropout(0.5)
        self.down = nn.Linear(32, models.DIM)

    def forward(self, x):
        return self.down(self.drop(torch.relu(self.up(self.norm(x)))))


def trained_then_evaluated(rank, world, dtype):
    torch.manual_seed(0)
    model = NormedMlp().to(dtype)
    ref = copy.deepcopy(model)
    x = example(8, models.DIM).to(dtype)
    gm = fxtp.parallelize(model, PLAN, example_inputs=(x,))
    assert gm.training and ref.training
    out = gm(x)  # a training step: batch statistics, dropout, running statistics updated
    out.sum().backward()
    ref(x)
    tol = tolerance(dtype)
    for name in ("norm.running_mean", "norm.running_var"):
        torch.testing.assert_close(local_of(gm.get_buffer(name)), ref.get_buffer(name), **tol)
    gm.eval(), ref.eval()
    with torch.no_grad(), fxtp.count_collectives() as counts:
        first = gm(x)
    torch.testing.assert_close(first, ref(x).detach(), **tol)
    assert torch.equal(gm(x), first)  # no dropout
    gm.train(), ref.train()
    assert not torch.equal(gm(x), gm(x))  # dropout again, running statistics updated twice
    ref(x), ref(x)
    gm.eval(), ref.eval()
    torch.testing.assert_close(gm(x), ref(x).detach(), **tol)
    return dict(counts.counts), gm.fxtp.fallbacks


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_evaluating_the_trained_module_runs_the_eval_program(ranks, dtype):
    counts, fallbacks = ranks.run(trained_then_evaluated, dtype)[0]
    assert counts == {"all_reduce": 1}
    assert fallbacks == []


def test_a_module_traced_for_serving_trains_with_dropout(fake_group):
    fake_group(2)
    model = NormedMlp().eval()
    x = torch.randn(8, models.DIM)
    gm = fxtp.parallelize(model, PLAN, example_inputs=(x,))
    assert not gm.training
    assert torch.equal(gm(x), gm(x))
    gm.train()
    assert gm.training and all(m.training for m in gm.modules())
    assert not torch.equal(gm(x), gm(x))
    assert not model.training  # the user's model is left as it was


def test_a_copy_switches_its_own_program(fake_group):
    """An EMA model is a ``copy.deepcopy`` of the module being trained: it evaluates with
    the eval program while the original keeps training, and keeps fxtp's bookkeeping."""
    fake_group(2)
    x = torch.randn(8, models.DIM)
    gm = fxtp.parallelize(NormedMlp(), PLAN, example_inputs=(x,))
    ema = copy.deepcopy(gm).eval()
    assert gm.training and torch.equal(ema(x), ema(x))
    assert ema.fxtp.param_placements == gm.fxtp.param_placements
    assert ema.state_dict().keys() == gm.state_dict().keys()
    gm.eval()
    torch.testing.assert_close(gm(x), ema(x), rtol=0, atol=0)
    gm.train()
    assert not torch.equal(gm(x), gm(x)) and not ema.training
    assert torch.equal(ema(x), ema(x))


class DropoutBlocks(nn.Module):
    """Two residual MLP blocks, each with dropout inside."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(models.DIM, 32), nn.ReLU(), nn.Dropout(0.5),
                          nn.Linear(32, models.DIM)) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


BLOCKS_PLAN = {"blocks.*.0": fxtp.ColwiseParallel(), "blocks.*.3": fxtp.RowwiseParallel()}


def one_block_evaluated(rank, world):
    torch.manual_seed(0)
    model = DropoutBlocks().double()
    ref = copy.deepcopy(model)
    x = example(8, models.DIM).double()
    gm = fxtp.parallelize(model, BLOCKS_PLAN, example_inputs=(x,), modules=["blocks.*"])
    for module in (gm, ref):
        module.blocks[0].eval()
    assert gm.training and not gm.blocks[0].training and gm.blocks[1].training
    outs = []
    for module in (gm, ref, gm):
        torch.manual_seed(1)  # the same dropout draws: the whole mask, on every rank
        outs.append(module(x).detach())
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(outs[2], outs[0], rtol=0, atol=0)
    for module in (gm, ref):
        module.blocks[0].train()
        module.blocks[1].eval()
    torch.manual_seed(2)
    out = gm(x)
    torch.manual_seed(2)
    torch.testing.assert_close(out, ref(x), rtol=1e-12, atol=1e-12)
    gm.eval(), ref.eval()
    assert not any(m.training for m in gm.modules())
    torch.testing.assert_close(gm(x), ref(x), rtol=1e-12, atol=1e-12)


def test_a_block_evaluated_alone_runs_its_eval_program(ranks):
    """``gm.blocks[0].eval()`` switches that block only, as on a single device: with the
    same seed, the other block's dropout draws the same masks."""
    ranks.run(one_block_evaluated)


def test_a_block_whose_ends_differ_between_modes_is_refused_alone(fake_group):
    fake_group(2)
    x = torch.randn(8, models.DIM)
    gm = fxtp.parallelize(DropoutBlocks(), BLOCKS_PLAN, example_inputs=(x,),
                          modules=["blocks.*"])
    gm.eval()
    gm.train()  # both programs traced; make the eval one lay blocks.1's input out otherwise
    programs, _ = gm.__dict__["_fxtp_programs"]
    index = [path for path, _ in programs.modules].index("blocks.1")
    graph = programs.graphs[False][index][0]
    next(n for n in graph.nodes if n.op == "placeholder").meta[PLACEMENT] = fxtp.Shard(0)
    with pytest.raises(fxtp.TraceError, match=r"'blocks\.1' cannot run its eval program "
                                              r"alone.*gm\.eval\(\)"):
        gm.blocks[1].eval()
    gm.eval()  # the whole result switches
    assert not gm.blocks[1].training
