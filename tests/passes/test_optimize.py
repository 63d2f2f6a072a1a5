"""Post-rewrite passes (passes/optimize.py): fewer collectives forward and backward, the
same numbers. Eager, on 2 and 4 gloo ranks, counted exactly."""
import warnings

import torch
import torch.distributed as dist
import torch.fx as fx

import fxtp
from fxtp.kernels import collectives as C
from fxtp.passes.optimize import optimize
from tests.helpers import models
from tests.helpers.compiled import optimize_whole
from tests.helpers.parity import TIGHT, check_parity, example as _x

B, T, D = models.BATCH, models.SEQ, models.DIM


def redundant(rank, world, post):
    return check_parity(rank, world, models.Redundant, models.REDUNDANT_PLAN, [_x(B, T, D)],
                        dtype=torch.float64, post=post, with_bytes=True)


def test_round_trip_cancels_and_independent_reductions_share_one(ranks):
    """``first``'s partial output is reduce-scattered only to be gathered back by
    ``second``; ``left`` and ``right`` all-reduce independently."""
    fwd, bwd, _, bwd_bytes = ranks.run(redundant, None)[0]
    assert fwd == {"reduce_scatter": 1, "all_gather": 1, "all_reduce": 3}
    # the gather's backward reduce-scatters the partial gradient, the reduce-scatter's
    # gathers it
    assert bwd == {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}
    fwd, bwd, _, opt_bwd_bytes = ranks.run(redundant, optimize_whole)[0]
    assert fwd == {"all_reduce": 3}  # the round trip is one all-reduce; left and right share one
    assert bwd == {"all_reduce": 3}  # reduce-scatter + all-gather became one all-reduce
    assert sum(opt_bwd_bytes.values()) < sum(bwd_bytes.values())


class TwoSorts(torch.nn.Module):
    """Two colwise projections, each sorted over its sharded features: sort needs its dim
    whole, so each output is gathered (a reported fallback)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(D, D), torch.nn.Linear(D, D)

    def forward(self, x):
        return torch.sort(self.a(x), -1).values + torch.sort(self.b(x), -1).values


def two_sorts(rank, world, post):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the two fallbacks
        return check_parity(rank, world, TwoSorts, {"a": fxtp.ColwiseParallel(),
                                                    "b": fxtp.ColwiseParallel()},
                            [_x(B, T, D)], dtype=torch.float64, post=post, with_bytes=True)


def test_independent_gathers_share_one_collective(ranks2):
    """The two gathers are independent: bucketed they issue once, moving the same bytes.
    Backward: their gradients are replicated (local chunks) and the input's partial
    gradient is all-reduced once."""
    fwd, bwd, fwd_bytes, bwd_bytes = ranks2.run(two_sorts, None)[0]
    assert (fwd, bwd) == ({"all_gather": 2}, {"all_reduce": 1})
    opt = ranks2.run(two_sorts, optimize_whole)[0]
    assert opt[:2] == ({"all_gather": 1}, {"all_reduce": 1})
    assert (opt[2], opt[3]) == (fwd_bytes, bwd_bytes)  # the same bytes in fewer messages


def hand_built(rank, world, post):
    """A graph written directly in fxtp's collectives, with every kind of redundancy;
    each rank feeds its own data. Returns counts, outputs and input gradients."""
    group = dist.group.WORLD.group_name
    shapes = {"a": (4, 6), "b": (2, 3), "c": (3, 2), "d": (4, 6), "e": (2, 8), "f": (6, 4),
              "h": (4, 6), "k": (2, 4), "p": (5,), "q": (2, 3)}
    inputs = {n: _x(*s, seed=10 * rank + i).double().requires_grad_()
              for i, (n, s) in enumerate(shapes.items())}
    graph = fx.Graph()
    x = {}
    for name, value in inputs.items():
        x[name] = graph.placeholder(name)
        x[name].meta["val"] = value

    def call(fn, *args):
        return graph.call_function(fn, args)
    outs = [
        call(C.all_reduce, x["a"], group), call(C.all_reduce, x["a"], group),  # twice
        call(C.all_gather, x["b"], 0, rank, world, group),  # independent gathers
        call(C.all_gather, x["c"], 1, rank, world, group),
        call(C.reduce_scatter, x["d"], 0, world, group),  # independent reduce-scatters
        call(C.reduce_scatter, x["e"], 1, world, group),
        call(C.all_gather, call(C.reduce_scatter, x["f"], 1, world, group), 1, rank, world,
             group),  # reduce-scatter then gather: an all-reduce
        call(C.shard, x["h"], 0, rank, world, group),  # independent shards (backward)
        call(C.shard, x["k"], 1, rank, world, group),
        call(C.grad_sync, x["p"], group), call(C.grad_sync, x["q"], group),
    ]
    graph.output(tuple(outs))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    if post:
        post(gm)
    with fxtp.count_collectives() as fwd:
        results = gm(*inputs.values())
    loss = sum((r * _x(*r.shape, seed=100 + i).double()).sum() for i, r in enumerate(results))
    with fxtp.count_collectives() as bwd:
        loss.backward()
    return (dict(fwd.counts), dict(bwd.counts), [r.detach() for r in results],
            {n: v.grad for n, v in inputs.items()})


def test_hand_built_graph_with_every_redundancy(ranks):
    fwd, bwd, ref_out, ref_grads = zip(*ranks.run(hand_built, None))
    assert fwd[0] == {"all_reduce": 2, "all_gather": 3, "reduce_scatter": 3}
    assert bwd[0] == {"all_reduce": 2, "all_gather": 5}
    opt_fwd, opt_bwd, out, grads = zip(*ranks.run(hand_built, optimize))
    # merged, fused into an all-reduce, and each kind bucketed
    assert opt_fwd[0] == {"all_reduce": 1, "all_gather": 1, "reduce_scatter": 1}
    assert opt_bwd[0] == {"all_reduce": 1, "all_gather": 2}
    for rank in range(ranks.world):
        for got, want in zip(out[rank], ref_out[rank]):
            torch.testing.assert_close(got, want, **TIGHT)
        for name, want in ref_grads[rank].items():
            torch.testing.assert_close(grads[rank][name], want, **TIGHT, msg=name)
