"""One rank's error is every rank's, and programs run on every rank, empty shards included.

A stage of ``parallelize`` that fails on some ranks only fails on all of them: the failing
ranks raise their own error, the others a :class:`fxtp.RankError` naming them (or the kind
``parallelize`` retries on, so every rank takes the same way), never a hang in the next
collective. Every op of each rank's program is run on that rank's local shapes before
``parallelize`` returns, so an op failing on one rank's shapes fails every rank there, not
at the first call. Localized shapes are valid on a rank holding none of a dim, and fxtp's
own placements can be constants of generated code.
"""
from __future__ import annotations

import datetime
import importlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxtp
from fxtp import Shard
from fxtp.passes.errors import StampMismatch
from tests.helpers.parity import check_parity, example

PLAN = {"up": fxtp.ColwiseParallel(), "down": fxtp.RowwiseParallel()}


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def fail_on_one_rank(rank, world, stage_function, error):
    """Make ``stage_function`` of :mod:`fxtp.pipeline` raise ``error`` on the last rank;
    return what ``parallelize`` raised on this rank, and a collective run after it."""
    module = importlib.import_module("fxtp.pipeline")
    original = getattr(module, stage_function)

    def failing(*args, **kwargs):
        if rank == world - 1:
            raise error
        return original(*args, **kwargs)
    setattr(module, stage_function, failing)
    try:
        fxtp.parallelize(MLP(), PLAN, example_inputs=(torch.randn(2, 8),))
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        raised = (type(e).__name__, str(e))
    finally:
        setattr(module, stage_function, original)
    ones = torch.ones(1)
    torch.distributed.all_reduce(ones)  # the group is usable: no rank is left waiting
    return raised, ones.item()


@pytest.mark.parametrize("stage_function, stage", [("trace", "tracing the model"),
                                                   ("localize", "placing and rewriting")])
def test_a_stage_failing_on_one_rank_fails_on_every_rank(ranks, stage_function, stage):
    results = ranks.run(fail_on_one_rank, stage_function, KeyError("internal"))
    world = len(results)
    assert results[-1] == (("KeyError", "'internal'"), world)
    for name, message in [raised for raised, _ in results[:-1]]:
        assert name == "RankError"
        assert f"failed on rank(s) [{world - 1}]" in message and stage in message


def test_ranks_agree_on_the_kind_parallelize_retries_on(ranks2):
    """A stamped block mismatching on one rank only: every rank retries with blocks traced
    in full (here the retry fails alike on the rank still raising)."""
    results = ranks2.run(fail_on_one_rank, "seed",
                         StampMismatch("stamp"))
    assert [name for (name, _), _ in results] == ["StampMismatch", "StampMismatch"]


class SixHeads(nn.Module):
    """Heads viewed with ``-1`` for their size: 6 heads at 4 ranks are dealt 2, 2, 2, 0,
    and the last rank views its empty projection."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(24, 24) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, 6, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(a.transpose(1, 2).reshape(b, s, -1))


def six_heads(rank, world):
    plan = {"q": fxtp.ColwiseParallel(), "k": fxtp.ColwiseParallel(),
            "v": fxtp.ColwiseParallel(), "o": fxtp.RowwiseParallel()}
    return check_parity(rank, world, SixHeads, plan, [example(2, 4, 24)],
                        dtype=torch.float64, strict=True)


def test_a_rank_holding_no_heads_runs_views_written_with_minus_one(ranks4):
    assert ranks4.run(six_heads)[0] == ({"all_reduce": 1}, {"all_reduce": 1})


class UnevenNorm(nn.Module):
    """Six colwise features (dealt 2, 2, 2, 0 at 4 ranks) meeting an RMSNorm over them,
    which fxtp decomposes into sums of the ranks' partial sums."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 6), nn.Linear(6, 8)

    def forward(self, x):
        return self.down(F.rms_norm(self.up(x), (6,)))


def uneven_norm(rank, world):
    return check_parity(rank, world, UnevenNorm, PLAN, [example(2, 4, 8)],
                        dtype=torch.float64, strict=True)


def test_features_dealt_unevenly_meet_a_decomposed_norm(ranks4):
    """Each way: the norm's sum of squares over the ranks' features, and the rowwise
    projection's partial sums."""
    assert ranks4.run(uneven_norm)[0] == ({"all_reduce": 2}, {"all_reduce": 2})


def six_heads_localized_with_minus_one(rank, world):
    """:class:`SixHeads` with the ``-1`` of its views kept on the rank holding no heads, as
    fxtp once localized them: that rank's reshape is ambiguous for its empty shard."""
    rules = importlib.import_module("fxtp.passes.rules.base")
    original = rules.localize_shape

    def minus_one_kept(shape, placement, group, graph, before):
        local = original(shape, placement, group, graph, before)
        return [-1 if s == -1 else s2 for s, s2 in zip(shape, local)]
    rules.localize_shape = minus_one_kept
    plan = {"q": fxtp.ColwiseParallel(), "k": fxtp.ColwiseParallel(),
            "v": fxtp.ColwiseParallel(), "o": fxtp.RowwiseParallel()}
    try:
        fxtp.parallelize(SixHeads(), plan, example_inputs=(torch.randn(2, 4, 24),))
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        raised = (type(e).__name__, str(e))
    finally:
        rules.localize_shape = original
    ones = torch.ones(1)
    torch.distributed.all_reduce(ones)
    return raised, ones.item()


def test_an_op_failing_on_one_ranks_shapes_fails_parallelize_on_every_rank(ranks4):
    """Each rank runs its program's ops on its local shapes (meta tensors) before
    ``parallelize`` returns: the rank whose reshape cannot run names it, the others name
    that rank, and none is left waiting at the first call."""
    results = ranks4.run(six_heads_localized_with_minus_one)
    (name, message), total = results[-1]
    assert (name, total) == ("ShardingError", 4)
    assert "aten.reshape.default" in message and "rank 3 of 4" in message and \
        "[(2, 4, 0)]" in message
    for (name, message), _ in results[:-1]:
        assert name == "ShardingError" and "failed on rank(s) [3]" in message


class Tokens(nn.Module):
    """Each rank embeds its part of the sequence, then the projection gathers it."""

    def __init__(self):
        super().__init__()
        self.embed, self.up, self.down = nn.Embedding(10, 8), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, tokens):
        return self.down(torch.relu(self.up(self.embed(tokens))))


def bad_token_on_last_rank(rank, world):
    """The first call gets a token id out of range in the last rank's part of the sequence
    only; the second gets good ids everywhere. A group with a shorter timeout than the
    pool's: a rank left waiting fails within a minute (ranks of a loaded machine may run
    seconds apart while they parallelize)."""
    group = torch.distributed.new_group(timeout=datetime.timedelta(seconds=60))
    plan = {"": fxtp.PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Shard(1)),
            "up": fxtp.ColwiseParallel(input_layouts=Shard(1)), "down": fxtp.RowwiseParallel()}
    torch.manual_seed(0)
    model = Tokens()
    tokens = torch.randint(0, 10, (2, 4 * world))
    bad = tokens.clone()
    bad[0, -1] = 10
    raised = []
    try:
        gm = fxtp.parallelize(model, plan, group, example_inputs=(tokens,))
        for ids in (bad, tokens):
            try:
                out = gm(ids.chunk(world, 1)[rank])
            except Exception as e:  # noqa: BLE001 - what each rank raised is the result
                raised.append((type(e).__name__, str(e)))
        torch.testing.assert_close(out, model(tokens))
    finally:
        torch.distributed.destroy_process_group(group)
    return raised, gm.fxtp.fallbacks


def test_an_error_at_the_first_call_on_some_ranks_fails_it_on_every_rank(ranks):
    """Until a call succeeds on every rank, each collective of a call is preceded by the
    ranks agreeing that none has raised: the failing rank raises its own error, the others
    a RankError naming it; the next call runs on every rank."""
    results = ranks.run(bad_token_on_last_rank)
    world = len(results)
    assert all(fallbacks == [] for _, fallbacks in results)
    [(name, message)], _ = results[-1]
    assert name == "IndexError" and "index out of range" in message
    for [(name, message)], _ in results[:-1]:
        assert name == "RankError" and f"failed on rank(s) [{world - 1}]" in message
