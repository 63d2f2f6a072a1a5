"""Values nothing reads are dropped before placement (their inputs are then placed for the
values that are read); ops with effects stay."""
import torch
import torch.nn as nn

import fxtp
from fxtp.passes.context import PassContext
from fxtp.passes.unused import drop_unused
from tests.helpers.oracle import record
from tests.helpers.parity import check_parity, example

aten = torch.ops.aten


def program(x, w):
    (w.double() * 2).sum()                   # nothing reads it
    torch.rand(3)                            # random: the generator moves as on one device
    x.add_(1)                                # in place: the caller sees it
    return x * w


def test_pure_values_nothing_reads_are_dropped_and_effects_stay():
    gm, _ = record(program, [torch.randn(4, 3), torch.randn(3)])
    before = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    drop_unused(gm, PassContext(world=1))
    after = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert len(before) - len(after) == 3  # the cast, the product and the sum
    assert aten.sum.default in before and aten.sum.default not in after
    assert aten.rand.default in after and aten.add_.Tensor in after
    assert aten.mul.Tensor in after  # x * w, returned


def test_values_kept_by_the_caller_stay():
    gm, _ = record(program, [torch.randn(4, 3), torch.randn(3)])
    total = next(n for n in gm.graph.nodes if n.target is aten.sum.default)
    count = len(gm.graph.nodes)
    drop_unused(gm, PassContext(world=1, kept=frozenset({total})))
    assert len(gm.graph.nodes) == count


class CalledForNothing(nn.Module):
    """``aux`` is called and its result dropped (DeepSeek-V4 computes a compressor's
    projection it reads only in other configurations)."""

    def __init__(self):
        super().__init__()
        self.up, self.aux, self.down = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        self.aux(x)
        return self.down(self.up(x))


def called_for_nothing(rank, world):
    plan = {"up": fxtp.ColwiseParallel(), "aux": fxtp.ColwiseParallel(),
            "down": fxtp.RowwiseParallel()}
    return check_parity(rank, world, CalledForNothing, plan, [example(2, 6, 8)],
                        dtype=torch.float64, strict=True)


def test_a_planned_module_whose_result_nothing_reads_is_kept_as_a_call(ranks2):
    """Its boundary is kept for the plan, so it is outlined as a submodule whose call gives
    nothing (outlining it raised an IndexError); Megatron's all-reduce each way."""
    assert ranks2.run(called_for_nothing)[0] == ({"all_reduce": 1}, {"all_reduce": 1})
