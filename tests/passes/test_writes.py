"""In-place writes into sharded values: through views, and between reads that take the
value redistributed. A redistribution computes a copy, so a write into a view of it, or a
copy taken before a write and read after it, would silently miss the write. Each case runs
at parity with the single-device model (fp64: forward, every gradient, 3 AdamW steps),
eagerly and with fxtp's post-rewrite passes (which merge, bucket and cancel collectives),
the gathers reported as fallbacks."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxtp
from tests.helpers.compiled import optimize_whole
from tests.helpers.parity import check_parity, example

B, T, D = 2, 6, 16
PLAN = {"up": fxtp.ColwiseParallel(), "down": fxtp.RowwiseParallel()}  # hidden 4 D sharded


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)


class ScaleAcrossShards(MLP):
    """``h[..., :2 D] *= 0.5``: the slice spans both ranks' features, so it takes ``h``
    gathered, and the write must land in ``h`` itself, which ``down`` reads."""

    def forward(self, x):
        h = F.gelu(self.up(x))
        h[..., :2 * D] *= 0.5
        return self.down(h)


class AssignAcrossShards(MLP):
    """One feature assigned from another rank's: ``z[..., 5] = h[..., 40]``. The read
    feature is picked on the rank holding it and its partial sum all-reduced (no gather);
    the view written into, ``z[..., 5]``, must not be such a pick: the other ranks' zeros
    alias nothing, and the partial sum would land in ``z`` unreduced."""

    def forward(self, x):
        h = self.up(x)
        z = torch.zeros_like(h)
        z[..., 5] = h[..., 40]
        return self.down(h + z)


class ViewBeforeWrite(MLP):
    """A view across shards taken before ``h`` is scaled in place: it sees the write."""

    def forward(self, x):
        h = F.gelu(self.up(x))
        v = h[..., 40:48]
        h.mul_(2.0)
        return self.down(h) + v.sum(-1, keepdim=True)


class ReadWriteRead(MLP):
    """``h`` read gathered (``flip`` has no sharded strategy), then written through a view
    over tokens (which keeps it sharded), then read gathered again: the second read must
    gather again, not reuse the first gather."""

    def forward(self, x):
        h = F.gelu(self.up(x))
        a = torch.flip(h, [-1])
        h[:, :3] *= 2.0
        return self.down(a + torch.flip(h, [-1]))


class FillAcrossShards(MLP):
    """``index_fill_`` of two features, one on each rank: no sharded strategy, so the
    written value is made whole where it is made, and filled there."""

    def forward(self, x):
        h = F.gelu(self.up(x))
        h.index_fill_(-1, torch.tensor([2, 50]), 0.0)
        return self.down(h)


CASES = {"scale": ScaleAcrossShards, "assign": AssignAcrossShards,
         "view_before_write": ViewBeforeWrite, "read_write_read": ReadWriteRead,
         "fill": FillAcrossShards}


def written(rank, world, name, post):
    fallbacks = []

    def keep(gm):
        fallbacks.extend(gm.fxtp.fallbacks)
        if post is not None:
            post(gm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the gathers, checked below
        counts = check_parity(rank, world, CASES[name], PLAN, [example(B, T, D)],
                              dtype=torch.float64, post=keep)
    return counts, fallbacks


@pytest.mark.parametrize("post", [None, optimize_whole], ids=["eager", "optimized"])
@pytest.mark.parametrize("name", list(CASES))
def test_writes_in_place_land_as_on_one_device(ranks, name, post):
    (fwd, _), fallbacks = ranks.run(written, name, post)[0]
    if name == "assign":  # the picked feature's all-reduce, no gather
        assert fwd == {"all_reduce": 2} and not fallbacks
        return
    gathers = 2 if name == "read_write_read" else 1  # each read after a write gathers anew
    assert fwd == {"all_gather": gathers, "all_reduce": 1}
    assert fallbacks, "the gathers are reported"


def test_a_value_written_through_a_view_it_is_gathered_for_is_made_whole(fake_group):
    """The write through the gathering slice pins ``h`` whole where it is made: the report
    says why."""
    fake_group(2)
    with pytest.warns(UserWarning, match="written in place through a view"):
        gm = fxtp.parallelize(ScaleAcrossShards(), PLAN, example_inputs=(example(B, T, D),))
    assert any("aten.gelu" in m and "written in place through a view" in m
               for m in gm.fxtp.fallbacks)


class ElementwiseWrites(MLP):
    """Writes that are elementwise stay sharded: a masked assignment by a boolean mask of
    the value's own shape (``index_put_``), and in-place forms torch leaves untagged
    (``masked_fill_.Scalar``, ``threshold_``)."""

    def forward(self, x):
        h = self.up(x)
        h[h > 0.5] = 0.5
        h.masked_fill_(h < -0.5, -0.5)
        return self.down(F.threshold(h, 0.1, 0.0, inplace=True))


def elementwise(rank, world):
    return check_parity(rank, world, ElementwiseWrites, PLAN, [example(B, T, D)],
                        dtype=torch.float64, strict=True)


def test_elementwise_writes_stay_sharded(ranks):
    assert ranks.run(elementwise)[0] == ({"all_reduce": 1}, {"all_reduce": 1})


class PickBeforeWrite(MLP):
    """A feature picked (``select``: a view) before ``h`` is scaled in place sees the
    write, as on one device: the rank holding it picks from ``h`` itself, and its partial
    sum is reduced where it is read, after the write."""

    def forward(self, x):
        h = F.gelu(self.up(x))
        v = h[..., 40]
        h.mul_(2.0)
        return self.down(h) + v.unsqueeze(-1)


def pick_before_write(rank, world, post):
    return check_parity(rank, world, PickBeforeWrite, PLAN, [example(B, T, D)],
                        dtype=torch.float64, strict=True, post=post)


@pytest.mark.parametrize("post", [None, optimize_whole], ids=["eager", "optimized"])
def test_a_feature_picked_before_a_write_sees_it(ranks, post):
    """The pick's all-reduce and the rowwise output's; the post-rewrite passes add the two
    partial sums first and reduce once."""
    fwd = {"all_reduce": 2 if post is None else 1}
    assert ranks.run(pick_before_write, post)[0] == (fwd, {"all_reduce": 1})


class PaddedMask(MLP):
    """A mask made like the shard (``zeros_like`` / ``full_like``), then written whole
    through a slice across the ranks' features: only the shard's metadata is read, so the
    mask is made whole where it is created, not gathered from the shard."""

    def forward(self, x):
        h = self.up(x)
        keep, scale = torch.zeros_like(h), torch.full_like(h, 2.0)
        keep[..., :D + 4] = 1.0
        scale[..., 3:5] = 0.5
        return self.down(h * keep * scale)


def padded_mask(rank, world):
    return check_parity(rank, world, PaddedMask, PLAN, [example(B, T, D)],
                        dtype=torch.float64, strict=True)


def test_a_tensor_made_like_a_shard_and_written_whole_gathers_nothing(ranks):
    """Megatron's all-reduce each way; before, each mask gathered ``h`` (a fallback)."""
    assert ranks.run(padded_mask)[0] == ({"all_reduce": 1}, {"all_reduce": 1})


class TwoParts(nn.Module):
    """MLA's query: a buffer made by ``new_empty`` and written in two parts, each a
    column-wise output sharded along the dim they are laid side by side on, so the buffer
    is made in that strided layout (it was a ShardingError: no factory strategy offered
    one); the row-wise ``down`` takes it gathered."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, 2 * D), nn.Linear(D, 2 * D)
        self.down = nn.Linear(4 * D, D)

    def forward(self, x):
        a, b = self.a(x), self.b(x)
        h = a.new_empty(*a.shape[:-1], 4 * D)
        h[..., :2 * D] = a
        h[..., 2 * D:] = b
        return self.down(h)


def two_parts(rank, world):
    plan = {"a": fxtp.ColwiseParallel(), "b": fxtp.ColwiseParallel(),
            "down": fxtp.RowwiseParallel()}
    return check_parity(rank, world, TwoParts, plan, [example(B, T, D)], dtype=torch.float64,
                        strict=True)


def test_a_buffer_written_in_two_sharded_parts_is_made_in_their_strided_layout(ranks):
    assert ranks.run(two_parts)[0] == ({"all_gather": 1, "all_reduce": 1},
                                       {"all_gather": 1, "all_reduce": 1})


class ScaleModuleOutput(MLP):
    def forward(self, x):
        h = self.up(x)
        h[..., :2 * D] *= 0.5
        return self.down(h)


def test_a_write_a_copy_would_take_into_a_planned_layout_is_refused(fake_group):
    """``up``'s output is laid out by the plan, so it cannot be made whole where it is
    made: the error names the write, the layout and how to fix it."""
    fake_group(2)
    with pytest.raises(fxtp.ShardingError, match=r"'mul_' \(aten\.mul_\.Tensor\) in module "
                       r"'<root>' writes in place into the up output 0 layout \(placed S\(2\).*"
                       r"Lay that value out replicated"):
        fxtp.parallelize(ScaleModuleOutput(), PLAN, example_inputs=(example(B, T, D),))


def test_a_round_trip_around_a_write_is_kept():
    """``all_gather(shard(x))`` reads ``x`` as it was before ``x.mul_(2)`` in between: the
    round trip is not cancelled into a read of ``x`` after the write."""
    from fxtp.kernels import collectives as C
    from fxtp.passes.optimize import cancel_round_trips
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    part = graph.call_function(C.shard, (x, 0, 0, 2, "0"))
    graph.call_function(torch.ops.aten.mul_.Tensor, (x, 2.0))
    graph.output(graph.call_function(C.all_gather, (part, 0, 0, 2, "0")))
    cancel_round_trips(graph)
    assert [n.target for n in graph.nodes if n.op == "call_function"] == [
        C.shard, torch.ops.aten.mul_.Tensor, C.all_gather]


class ScaledViewedWritten(nn.Module):
    """A small sharded gate scales a large replicated value (the result is sharded), a view
    of the result is taken, the result is written in place, and the view is read after the
    write by an unplanned layer that needs it whole. Gathering the gate instead of the
    result (``passes/gather_early.py``) would compute the result and its view whole, as a
    copy of what the write then lands in: the view must keep seeing the write."""

    def __init__(self):
        super().__init__()
        self.gate, self.out = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        h = x * self.gate(x.mean(1)).unsqueeze(1)
        v = h.view(B * T, D)
        h.mul_(2.0)
        return self.out(v * 3.0)


def scaled_viewed_written(rank, world):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unplanned layer's gather
        return check_parity(rank, world, ScaledViewedWritten, {"gate": fxtp.ColwiseParallel()},
                            [example(B, T, D)], dtype=torch.float64)


def test_a_view_read_after_a_write_is_not_computed_whole_from_a_gathered_gate(ranks):
    fwd, _ = ranks.run(scaled_viewed_written)[0]
    assert fwd == {"all_gather": 1}



class ResidualAddedInPlace(nn.Module):
    """``a = o(x); a.add_(x)``: the residual added in place into a row-parallel output,
    reduce-scattered to sequence shards (or sharded from a replicated one): the
    collective's result is the user's to write."""

    def __init__(self):
        super().__init__()
        self.o, self.mlp = nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False)
        self.norm = nn.RMSNorm(16)

    def forward(self, x):
        a = self.o(x)
        a.add_(x)
        return a + self.mlp(self.norm(a))


def residual_added_in_place(rank, world, plan):
    # one sequence: a shard of dim 1 is then a contiguous view of the whole
    return check_parity(rank, world, ResidualAddedInPlace, plan, [example(1, 8, 16)],
                        dtype=torch.float64, strict=True)


@pytest.mark.parametrize("plan, counts", [
    ({"o": fxtp.RowwiseParallel(output_layouts=fxtp.Shard(1))},
     ({"reduce_scatter": 1}, {"all_gather": 3, "all_reduce": 1})),
    ({"o": fxtp.PrepareModuleOutput(output_layouts=fxtp.Replicate(),
                                     desired_output_layouts=fxtp.Shard(1))},
     ({}, {"all_gather": 2, "all_reduce": 1}))], ids=["reduce_scatter", "shard"])
def test_a_collectives_result_may_be_written_in_place(ranks, plan, counts):
    assert ranks.run(residual_added_in_place, plan)[0] == counts
