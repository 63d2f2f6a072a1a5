"""Cases that once gave silently wrong numbers, each against the single-device model.

* ``tril`` / ``triu`` were taken for pointwise ops: on a sharded trailing dim each rank
  masked its shard as if it started at row or column 0. A shard's diagonal is shifted by
  its offset instead, so both trailing dims shard with no communication.
* ``torch.compile(model, backend="fxtp", options={"plan": ...})`` read a fused projection's
  ``_StridedShard`` weight as a contiguous ``Shard``: fused QKV returned wrong outputs and
  fused SwiGLU failed to run.
* An in-place op must write the caller's tensor: where its rule would need that input
  redistributed (a copy), parallelize refuses instead of writing the copy.
* A replicated value split in pieces, one feeding sharded ops (its gradient a per-rank
  partial sum) and another read replicated (Mamba's ``x_proj`` output cut into the time
  step, B and C): the piece handed its partial gradient on to the split, which is no
  tensor to sum on, so the sum was never taken. It is now taken on the piece.
"""
import copy

import pytest
import torch
import torch.nn as nn

import fxtp
from fxtp import Shard
from tests.helpers import models
from tests.helpers.parity import check_parity, example, tolerance

N = 8  # the masked square's side


class Masked(nn.Module):
    """A colwise projection whose output, viewed as (B, N, N) squares, is masked by
    ``tril`` (or ``triu``) on its sharded column dim, then projected rowwise."""

    def __init__(self, upper=False, diagonal=0):
        super().__init__()
        self.upper, self.diagonal = upper, diagonal
        self.up = nn.Linear(N, N)
        self.down = nn.Linear(N, N)

    def forward(self, x):
        h = self.up(x)                                     # (B, N, N), columns sharded
        h = h.triu(self.diagonal) if self.upper else h.tril(self.diagonal)
        return self.down(h)


class MaskedRows(nn.Module):
    """``tril`` on sequence-sharded rows (scores of sequence-parallel code): each rank
    passes its rows of the input, the output stays sharded by rows."""

    def __init__(self, upper=False, diagonal=0):
        super().__init__()
        self.upper, self.diagonal = upper, diagonal
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, N))

    def forward(self, x):
        h = x * self.scale
        return h.triu(self.diagonal) if self.upper else h.tril(self.diagonal)


MASKS = [(False, 0), (True, 0), (False, -1), (True, 2)]


def masked(rank, world, upper, diagonal):
    return check_parity(rank, world, lambda: Masked(upper, diagonal),
                        {"up": fxtp.ColwiseParallel(), "down": fxtp.RowwiseParallel()},
                        [example(2, N, N)], dtype=torch.float64, strict=True)


def masked_rows(rank, world, upper, diagonal):
    plan = {"": fxtp.PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Shard(1))}
    return check_parity(rank, world, lambda: MaskedRows(upper, diagonal), plan,
                        [example(2, N, N)], input_placements=[Shard(1)], dtype=torch.float64,
                        strict=True)


@pytest.mark.parametrize("upper,diagonal", MASKS, ids=lambda v: str(v))
def test_tril_and_triu_on_sharded_columns_match_single_device(ranks, upper, diagonal):
    """strict=True: no fallback; the mask costs no collective (one all-reduce after the
    rowwise projection forward, one for the replicated input's gradient backward)."""
    fwd, bwd = ranks.run(masked, upper, diagonal)[0]
    assert fwd == {"all_reduce": 1} and bwd == {"all_reduce": 1}


@pytest.mark.parametrize("upper,diagonal", MASKS, ids=lambda v: str(v))
def test_tril_and_triu_on_sharded_rows_match_single_device(ranks, upper, diagonal):
    fwd, bwd = ranks.run(masked_rows, upper, diagonal)[0]
    assert fwd == {} and bwd == {"all_reduce": 1}  # the scale's gradient: one all-reduce


def plan_in_compile(rank, world, split):
    """A fused block under backend="fxtp" with a plan: outputs equal single device."""
    torch.manual_seed(0)
    model = models.FusedStack(1, split=split)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="fxtp", fullgraph=True,
                             options={"plan": models.FUSED_PLAN})
    x = example(2, 4, models.DIM)
    with torch.no_grad():
        out, expected = compiled(x), ref(x)
    torch.testing.assert_close(out, expected, **tolerance(torch.float32, expected))
    return True


def test_fused_qkv_and_swiglu_under_the_plan_option_of_the_backend(ranks2):
    """Fused QKV (``split``) and fused SwiGLU (``chunk``) weights are laid out
    ``_StridedShard``: the backend must read them as such."""
    assert ranks2.run(plan_in_compile, "split") == [True, True]


class InPlaceScale(nn.Module):
    """``h.mul_(w)`` on a colwise output with a weight vector: the in-place op keeps h's
    placement and shards the weight."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(models.DIM, 16)
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 16))
        self.down = nn.Linear(16, models.DIM)

    def forward(self, x):
        h = self.up(x)
        h.mul_(self.w)
        return self.down(h)


def in_place(rank, world):
    return check_parity(rank, world, InPlaceScale,
                        {"up": fxtp.ColwiseParallel(), "down": fxtp.RowwiseParallel()},
                        [example(2, 4, models.DIM)], dtype=torch.float64, strict=True)


def test_an_in_place_op_writes_the_callers_shard(ranks):
    fwd, bwd = ranks.run(in_place)[0]
    # w, read only as the colwise output's shard, is held as that shard: its gradient is
    # this rank's own; the input's gradient is all-reduced
    assert fwd == {"all_reduce": 1}
    assert bwd == {"all_reduce": 1}


class InPlaceCumsum(nn.Module):
    def __init__(self, read_before: bool):
        super().__init__()
        self.up = nn.Linear(models.DIM, 16)
        self.read_before = read_before

    def forward(self, x):
        h = self.up(x)
        before = h * 2 if self.read_before else 0
        h.cumsum_(-1)  # along the sharded dim: only a gathered copy could compute it
        return h + before


def test_an_in_place_op_that_would_write_a_copy_others_see_is_refused(fake_group):
    fake_group(2)
    with pytest.raises(fxtp.ShardingError, match=r"aten\.cumsum_\.default.*writes in place"):
        fxtp.parallelize(InPlaceCumsum(read_before=True), {"up": fxtp.ColwiseParallel()},
                         example_inputs=(torch.randn(2, 4, models.DIM),))


def in_place_temporary(rank, world):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the gather is a reported fallback
        return check_parity(rank, world, lambda: InPlaceCumsum(read_before=False),
                            {"up": fxtp.ColwiseParallel()}, [example(2, 4, models.DIM)],
                            dtype=torch.float64)


def test_an_in_place_op_on_a_temporary_only_it_reads_writes_a_gathered_copy(ranks2):
    """No other value can see the write, so writing a gathered copy computes what the
    single device does (the gather is the cumsum's fallback)."""
    fwd, bwd = ranks2.run(in_place_temporary)[0]
    assert fwd == {"all_gather": 1}


class SplitFeeds(nn.Module):
    """A replicated projection split in two: one piece into a colwise layer, the other
    gating the result replicated."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(models.DIM, 2 * models.DIM)
        self.up = nn.Linear(models.DIM, 16)
        self.down = nn.Linear(16, models.DIM)

    def forward(self, x):
        a, b = self.proj(x).split(models.DIM, -1)
        return self.down(self.up(a)) * torch.tanh(b)


def split_feeds(rank, world, dtype):
    return check_parity(rank, world, SplitFeeds,
                        {"up": fxtp.ColwiseParallel(), "down": fxtp.RowwiseParallel()},
                        [example(2, 4, models.DIM)], dtype=dtype, strict=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_a_split_piece_feeding_sharded_ops_sums_its_partial_gradient(ranks, dtype):
    fwd, bwd = ranks.run(split_feeds, dtype)[0]
    assert fwd == {"all_reduce": 1}
    assert bwd == {"all_reduce": 1}  # the piece's gradient, before the split puts it back
