"""Fused projections: one colwise linear for q, k and v, one for SwiGLU's gate and up, whose
output is split along its sharded dim. Their weights are laid out in blocks, each sharded
(each rank holds its piece of every part, as in Megatron's fused QKV and gpt-fast's
``wqkv``): ``_StridedShard(d, split_factor=k)`` for equal parts, ``BlockShard(d, sizes)``
for unequal ones (grouped-query attention), so the split needs no communication. Parts
that cannot be sharded together (fewer KV heads than ranks) are computed part by part on
slices of the whole fused weight. A split served neither way still gathers, and is still
correct."""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.placement_types import _StridedShard

import fxtp
from fxtp.kernels import collectives
from fxtp.passes.placement import BlockShard, describe
from tests.helpers import models
from tests.helpers.parity import check_parity, example, local_of, local_part

DTYPES = pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
L = 2
B, T, D = models.BATCH, models.SEQ, models.DIM


def fused(rank, world, dtype, split, shared=False):
    return check_parity(rank, world, lambda: models.FusedStack(L, split=split, shared=shared),
                        models.FUSED_PLAN, [example(B, T, D)], dtype=dtype)


@DTYPES
@pytest.mark.parametrize("split", ["split", "chunk", "sizes", "unbind"])
def test_fused_qkv_and_swiglu_issue_the_megatron_minimum(ranks, dtype, split):
    """2 all-reduces per layer forward (rowwise sums) and backward (colwise input grads).
    ``unbind``: q, k and v parted after a view as ``(3, heads, head_dim)`` (timm)."""
    fwd, bwd = ranks.run(fused, dtype, split)[0]
    assert fwd == {"all_reduce": 2 * L}
    assert bwd == {"all_reduce": 2 * L}


@DTYPES
def test_an_unequal_fused_split_issues_the_megatron_minimum(ranks2, dtype):
    """q, k, v of sizes D, D/2, D/2 (grouped-query attention, gpt-fast's ``wqkv``): each
    rank holds its rows of every part, in blocks of unequal sizes."""
    fwd, bwd = ranks2.run(fused, dtype, "gqa")[0]
    assert fwd == {"all_reduce": 2 * L}
    assert bwd == {"all_reduce": 2 * L}


def fused_without_fallbacks(rank, world, dtype, split):
    def held_whole(gm):
        assert gm.fxtp.param_placements["layers.0.attention.qkv.weight"] == Replicate()
    return check_parity(rank, world, lambda: models.FusedStack(L, split=split),
                        models.FUSED_PLAN, [example(B, T, D)], dtype=dtype, strict=True,
                        post=held_whole)


@DTYPES
def test_a_fused_split_with_fewer_kv_heads_than_ranks_is_computed_part_by_part(ranks4, dtype):
    """2 KV heads at 4 ranks: k and v cannot be sharded with q. The projection is computed
    as three, on row slices of the whole fused weight: q's sharded, k's and v's dealt to
    the pairs of ranks whose query heads read them (``enable_gqa``). No activation is
    gathered; backward gathers the q slices' gradients (weight and bias) and sums the k and
    v slices' over the ranks, one bucket a layer, beside the colwise input grads."""
    fwd, bwd = ranks4.run(fused_without_fallbacks, dtype, "gqa")[0]
    assert fwd == {"all_reduce": 2 * L}
    assert bwd == {"all_reduce": 3 * L, "all_gather": 2 * L}


def uneven_swiglu(rank, world, dtype):
    return check_parity(rank, world, lambda: models.FusedSwiGLU(D, hidden=19),
                        {"w13": fxtp.ColwiseParallel(), "w2": fxtp.RowwiseParallel()},
                        [example(B, T, D)], dtype=dtype, strict=True)


@DTYPES
def test_a_fused_swiglu_whose_width_does_not_divide_is_computed_part_by_part(ranks, dtype):
    """A hidden width of 19: gate and up cannot be cut in blocks of equal shards, so each
    is computed from its rows of the whole ``w13``, dealt as ``torch.chunk`` deals them,
    and ``w2`` takes its input features dealt alike. Forward, the rowwise sum; backward,
    the input's gradient summed, and ``w13``'s (each rank's rows of it) in one more."""
    fwd, bwd = ranks.run(uneven_swiglu, dtype)[0]
    assert fwd == {"all_reduce": 1}
    assert bwd == {"all_reduce": 2}


@DTYPES
def test_fused_weights_shared_across_layers_are_gathered(ranks, dtype):
    """One block applied L times: each fused weight feeds L projections, so it keeps its
    contiguous shards and both fused outputs are gathered in every layer."""
    fwd, bwd = ranks.run(fused, dtype, "split", True)[0]
    assert fwd == {"all_reduce": 2 * L, "all_gather": 2 * L}
    assert bwd == {"all_reduce": 2 * L, "all_gather": 2 * L}


def test_fused_weight_shards_hold_a_piece_of_every_part(fake_group):
    """Rank 1 of 2, D = 16: q, k and v are rows 0-15, 16-31, 32-47 of qkv.weight; rank 1
    holds rows 8-15, 24-31 and 40-47, in that order. w13 (gate rows 0-31, up rows 32-63)
    likewise holds 16-31 and 48-63."""
    fake_group(2, rank=1)
    model = models.FusedStack(1)
    gm = fxtp.parallelize(model, models.FUSED_PLAN, example_inputs=(example(B, T, D),))
    attention, ffn = model.layers[0].attention, model.layers[0].feed_forward
    rows = [*range(8, 16), *range(24, 32), *range(40, 48)]
    placements = gm.fxtp.param_placements
    assert placements["layers.0.attention.qkv.weight"] == _StridedShard(0, split_factor=3)
    assert describe(placements["layers.0.attention.qkv.bias"]) == "S(0)/3"
    assert torch.equal(local_of(gm.get_parameter("layers.0.attention.qkv.weight")),
                       attention.qkv.weight[rows])
    bias = local_of(gm.get_parameter("layers.0.attention.qkv.bias"))
    assert torch.equal(bias, attention.qkv.bias[rows])
    assert placements["layers.0.feed_forward.w13.weight"] == _StridedShard(0, split_factor=2)
    assert torch.equal(local_of(gm.get_parameter("layers.0.feed_forward.w13.weight")),
                       ffn.w13.weight[[*range(16, 32), *range(48, 64)]])


def test_unequal_fused_weight_shards_hold_their_rows_of_every_part(fake_group):
    """Rank 1 of 2, D = 16, k and v of 8 rows: q, k and v are rows 0-15, 16-23, 24-31 of
    qkv.weight; rank 1 holds rows 8-15, 20-23 and 28-31, in that order. The weight stays a
    plain tensor (DTensor has no placement for unequal blocks)."""
    fake_group(2, rank=1)
    model = models.FusedStack(1, split="gqa")
    gm = fxtp.parallelize(model, models.FUSED_PLAN, example_inputs=(example(B, T, D),))
    assert gm.fxtp.fallbacks == []
    assert gm.fxtp.param_placements["layers.0.attention.qkv.weight"] == BlockShard(0, (16, 8, 8))
    rows = [*range(8, 16), *range(20, 24), *range(28, 32)]
    qkv = model.layers[0].attention.qkv
    assert torch.equal(gm.get_parameter("layers.0.attention.qkv.weight"), qkv.weight[rows])
    assert torch.equal(gm.get_parameter("layers.0.attention.qkv.bias"), qkv.bias[rows])


def blocked_collectives(rank, world, blocks):
    """Every blocked collective against the global tensors it stands for: ``blocks`` equal
    blocks (``_StridedShard``) or blocks of the given sizes, in units of ``2 * world``."""
    group, d = dist.group.WORLD.group_name, 1
    if isinstance(blocks, int):
        p, size, k = _StridedShard(d, split_factor=blocks), blocks * world * 2, blocks
    else:
        k = tuple(b * world * 2 for b in blocks)
        p, size = BlockShard(d, k), sum(k)
    shape = (2, size, 3)
    full, grad = example(*shape).double(), example(*shape, seed=2).double()
    mine = local_part(full, p, rank, world)

    # all-gather reassembles the tensor; its backward keeps this rank's strided piece
    x = mine.clone().requires_grad_()
    out = collectives.all_gather(x, d, rank, world, group, blocks=k)
    torch.testing.assert_close(out, full)
    out.backward(grad)
    torch.testing.assert_close(x.grad, local_part(grad, p, rank, world))

    # ... or, when each rank's gradient is a partial sum, reduce-scatters it
    x = mine.clone().requires_grad_()
    collectives.all_gather(x, d, rank, world, group, True, blocks=k).backward(
        grad * (rank + 1))
    total = world * (world + 1) // 2
    torch.testing.assert_close(x.grad, local_part(grad * total, p, rank, world))

    # shard keeps this rank's strided piece; its backward all-gathers the pieces
    y = full.clone().requires_grad_()
    piece = collectives.shard(y, d, rank, world, group, blocks=k)
    torch.testing.assert_close(piece, mine)
    piece.backward(local_part(grad, p, rank, world))
    torch.testing.assert_close(y.grad, grad)

    # reduce-scatter sums the partial tensors and keeps this rank's strided piece
    z = (full * (rank + 1)).requires_grad_()
    piece = collectives.reduce_scatter(z, d, world, group, blocks=k)
    torch.testing.assert_close(piece, local_part(full * total, p, rank, world))
    piece.backward(local_part(grad, p, rank, world))
    torch.testing.assert_close(z.grad, grad)
    return True


@pytest.mark.parametrize("blocks", [3, (2, 1, 1)], ids=["equal", "unequal"])
def test_blocked_collectives_and_their_backward(ranks, blocks):
    assert all(ranks.run(blocked_collectives, blocks))


def fused_dynamic(rank, world):
    from torch.export import Dim
    shapes = [(2, 8), (3, 5), (1, 12)]
    return check_parity(rank, world, lambda: models.FusedStack(L), models.FUSED_PLAN,
                        [example(B, T, D)], dtype=torch.float64,
                        inputs_per_step=[[example(b, t, D, seed=i)] for i, (b, t) in
                                         enumerate(shapes)],
                        dynamic_shapes={"x": {0: Dim("batch", max=64), 1: Dim("seq", max=32)}})


def test_strided_layout_serves_dynamic_batch_and_sequence_dims(ranks):
    assert ranks.run(fused_dynamic)[0] == ({"all_reduce": 2 * L}, {"all_reduce": 2 * L})
