"""Values nothing reads are dropped before placement (their inputs are then placed for the
values that are read); ops with effects stay."""
import torch

from fxtp.passes.context import PassContext
from fxtp.passes.unused import drop_unused
from tests.helpers.oracle import record

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
