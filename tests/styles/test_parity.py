"""Every style against the single-device model: outputs, gradients, AdamW steps and the
exact collectives issued, on 2 and 4 gloo ranks, in fp64 (tight) and fp32 (default)."""
import pytest
import torch

from fxtp import PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput
from fxtp import Replicate, Shard
from tests.helpers import models
from tests.helpers.parity import check_parity, example as _x

DTYPES = pytest.mark.parametrize("dtype", [torch.float64, torch.float32],
                                 ids=["fp64", "fp32"])
B, T, D = models.BATCH, models.SEQ, models.DIM


def mlp(rank, world, dtype, bias):
    return check_parity(rank, world, lambda: models.MLP(bias=bias), models.MLP_PLAN,
                        [_x(B, T, D)], dtype=dtype)


def attention(rank, world, dtype):
    return check_parity(rank, world, models.Attention, models.ATTENTION_PLAN,
                        [_x(B, T, D)], dtype=dtype)


def stack(rank, world, dtype):
    return check_parity(rank, world, lambda: models.Stack(n_layers=3), models.STACK_PLAN,
                        [_x(B, T, D)], dtype=dtype)


def root_boundaries(rank, world, dtype):
    plan = {"": PrepareModuleInputOutput(input_layouts=Shard(0),
                                         desired_input_layouts=Replicate(),
                                         output_layouts=Replicate(),
                                         desired_output_layouts=Shard(0)),
            **models.MLP_PLAN}
    return check_parity(rank, world, models.MLP, plan, [_x(2 * world, D)], dtype=dtype,
                        input_placements=[Shard(0)])


def interior_boundaries(rank, world, dtype):
    plan = {"layers.0": PrepareModuleOutput(output_layouts=Replicate(),
                                            desired_output_layouts=Shard(1)),
            "layers.1": PrepareModuleInput(input_layouts=Shard(1),
                                           desired_input_layouts=Replicate()),
            **models.STACK_PLAN}
    return check_parity(rank, world, models.Stack, plan, [_x(B, T, D)], dtype=dtype)


@DTYPES
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_mlp_colwise_then_rowwise(ranks, dtype, bias):
    fwd, bwd = ranks.run(mlp, dtype, bias)[0]
    assert fwd == {"all_reduce": 1}  # the rowwise partial sums
    assert bwd == {"all_reduce": 1}  # the input gradient of the colwise linear


@DTYPES
def test_attention_with_global_head_count_and_sdpa(ranks, dtype):
    fwd, bwd = ranks.run(attention, dtype)[0]
    assert fwd == {"all_reduce": 1}
    assert bwd == {"all_reduce": 1}  # one for wq, wk and wv together


@DTYPES
def test_stacked_blocks_with_wildcard_plan_issue_megatron_minimum(ranks, dtype):
    fwd, bwd = ranks.run(stack, dtype)[0]
    assert fwd == {"all_reduce": 2 * 3}
    assert bwd == {"all_reduce": 2 * 3}


@DTYPES
def test_root_prepare_module_input_output_shards_batch(ranks, dtype):
    fwd, bwd = ranks.run(root_boundaries, dtype)[0]
    # all-gather the batch shards in; the rowwise sums are reduce-scattered straight to this
    # rank's rows (the bias is added after the reduction)
    assert fwd == {"all_gather": 1, "reduce_scatter": 1}
    # gather the output gradient rows; reduce-scatter the colwise input gradient; the bias,
    # added to this rank's rows, has a partial gradient: one all-reduce of its D values
    assert bwd == {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1}


@DTYPES
def test_interior_prepare_module_input_and_output(ranks, dtype):
    fwd, bwd = ranks.run(interior_boundaries, dtype)[0]
    assert fwd == {"all_reduce": 4, "all_gather": 1}
    assert bwd == {"all_reduce": 4, "all_gather": 1}


class CpuFlashAttention(models.Attention):
    """Attention written against the fused CPU kernel SDPA dispatches to (DTensor has no
    sharding rule for it)."""

    def forward(self, x):
        bsz, seqlen, dim = x.shape
        q, k, v = (w(x).view(bsz, seqlen, self.n_heads, -1).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)[0]
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, dim))


def cpu_flash_attention(rank, world, dtype):
    return check_parity(rank, world, CpuFlashAttention, models.ATTENTION_PLAN,
                        [_x(B, T, D)], dtype=dtype)


@DTYPES
def test_attention_on_the_fused_cpu_flash_kernel_shards_by_head(ranks, dtype):
    fwd, bwd = ranks.run(cpu_flash_attention, dtype)[0]
    assert fwd == {"all_reduce": 1}
    assert bwd == {"all_reduce": 1}
