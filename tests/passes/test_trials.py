"""A trial a cost check rejects leaves no trace: the graph after it is the graph before it,
node for node (the same node objects, in the same order, with the same targets, arguments
and ``meta``), whatever the trial added, erased, moved or edited."""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

import fxtp
from fxtp.passes.graph import FALLBACKS, RELAID
from fxtp.passes.program_cost import kept_if_cheaper
from fxtp.passes.snapshot import Snapshot
from tests.helpers.parity import check_parity, example

aten = torch.ops.aten


def graph_state(graph: fx.Graph) -> list:
    return [(n, n.name, n.op, n.target, n.args, n.kwargs, dict(n.meta)) for n in graph.nodes]


def chain() -> fx.GraphModule:
    """``relu(x) * -x + exp(x)``."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(aten.relu.default, (x,))
    b = graph.call_function(aten.neg.default, (x,))
    d = graph.call_function(aten.exp.default, (x,))
    c = graph.call_function(aten.mul.Tensor, (a, b))
    graph.output(graph.call_function(aten.add.Tensor, (c, d)))
    for n in graph.nodes:
        n.meta["tag"] = n.name
    return fx.GraphModule(nn.Module(), graph)


def everything_a_pass_may_do(gm: fx.GraphModule) -> list:
    """Erase a node, add others, move one, edit arguments, targets and ``meta``."""
    x, a, b, d, c, e, out = gm.graph.nodes
    with gm.graph.inserting_before(e):
        added = gm.graph.call_function(aten.abs.default, (x,))
        twice = gm.graph.call_function(aten.add.Tensor, (added, added))
    e.args = (c, twice)
    gm.graph.erase_node(d)
    a.prepend(b)
    a.target = aten.sigmoid.default
    a.meta["tag"] = "edited"
    x.meta.clear()
    return []


def test_a_rejected_trial_restores_the_graph_node_for_node():
    gm = chain()
    before = graph_state(gm.graph)
    gm.meta[FALLBACKS] = ["before"]
    assert not kept_if_cheaper(gm, 2, lambda: everything_a_pass_may_do(gm))  # no saving
    assert graph_state(gm.graph) == before and gm.meta[FALLBACKS] == ["before"]
    gm.graph.lint()
    gm.recompile()
    x = torch.randn(4)
    assert torch.equal(gm(x), torch.relu(x) * -x + torch.exp(x))


def test_a_snapshot_restores_the_very_nodes_erased():
    gm = chain()
    erased = list(gm.graph.nodes)[3]
    snapshot = Snapshot(gm.graph)
    everything_a_pass_may_do(gm)
    snapshot.restore()
    assert erased in list(gm.graph.nodes) and not erased._erased
    assert len(gm.graph.nodes) == len(snapshot.nodes)
    assert list(gm.graph.find_nodes(op="call_function", target=aten.exp.default)) == [erased]


class NormThenHead(nn.Module):
    """A sequence-parallel RMSNorm feeding a colwise linear gathered to replicated output,
    then an unplanned RMSNorm: the unpin trial decomposes a norm it then rejects."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(norm=nn.RMSNorm(8), fc=nn.Linear(8, 8)))
                                    for _ in range(2))
        self.final = nn.RMSNorm(8)

    def forward(self, x):
        for block in self.blocks:
            x = x + block.fc(block.norm(x))
        return self.final(x)


def norm_then_head(rank, world):
    plan = {"blocks.*.norm": fxtp.SequenceParallel(),
            "blocks.*.fc": fxtp.ColwiseParallel(output_layouts=fxtp.Replicate())}
    return check_parity(rank, world, NormThenHead, plan, [example(2, 4, 8)],
                        dtype=torch.float64)


def test_a_rejected_trial_that_decomposed_a_norm_leaves_a_valid_program(ranks):
    """Per block, forward: the norm's output and the linear's gathered; backward: the
    first gather's gradient reduce-scattered, the norm weight's gradient summed, and the
    replicated input's gradient gathered from its sequence shards."""
    assert ranks.run(norm_then_head)[0] == (
        {"all_gather": 4}, {"reduce_scatter": 2, "all_reduce": 2, "all_gather": 2})


def test_a_rejected_unfuse_trial_restores_the_graph_node_for_node(fake_group, monkeypatch):
    """2 KV heads at 4 ranks: the unfuse pass computes the fused q / k / v projection by
    parts; told the result falls back more, it puts the placed graph back as it was."""
    from fxtp.passes import place
    from fxtp.passes.unfuse import unfuse_splits
    from tests.helpers import models
    seen = {}

    def rejected(gm, ctx):
        seen["before"], fallbacks = graph_state(gm.graph), gm.meta[FALLBACKS]
        place = ctx.place

        def falls_back_more(gm, ctx):
            seen["linears"] = len(gm.graph.find_nodes(op="call_function",
                                                      target=aten.linear.default))
            placed = place(gm, ctx)
            placed.meta[FALLBACKS] = placed.meta[FALLBACKS] + ["more"] * len(gm.graph.nodes)
            return placed
        assert not unfuse_splits(gm, ctx.but(place=falls_back_more)).meta[RELAID]
        seen["after"] = graph_state(gm.graph)
        seen["fused"] = len(gm.graph.find_nodes(op="call_function", target=aten.linear.default))
        assert gm.meta[FALLBACKS] == fallbacks
        return gm
    monkeypatch.setattr(place, "TRIALS", tuple(rejected if t is unfuse_splits else t
                                               for t in place.TRIALS))
    fake_group(4)
    fxtp.parallelize(models.FusedStack(2, split="gqa"), models.FUSED_PLAN,
                     example_inputs=(example(2, 8, 16),))
    assert seen["linears"] == seen["fused"] + 2 * 2  # 3 for each fused qkv while tried
    assert seen["after"] == seen["before"]
