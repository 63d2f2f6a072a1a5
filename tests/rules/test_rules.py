"""Every strategy the rule table offers is numerically valid.

For each op in a set of small traced programs, and for every (input placements -> output
placements) strategy its dim spec yields at world size 2 and 4, the op is run on simulated
per-rank local inputs (Shard: that rank's chunk; blocked: its chunk of every block;
Replicate: the full tensor; Partial: a random split that sums to it) with localized shape
arguments, and the per-rank results must reassemble the op's single-device output. Programs
whose inputs arrive blocked (strided or in unequal blocks) are propagated first, so each op
is also offered the blocked strategies its inputs' placements call for. No process group is needed.
"""
import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from fxtp.passes.context import PassContext
from fxtp.passes.graph import INPUTS, PLACEMENT
from fxtp.passes.placement import BlockShard
from fxtp.passes.propagate import placement_of, propagate
from fxtp.passes.rules import RULES, tensor_inputs
from tests.helpers.oracle import check_strategies, record as _record

g = torch.Generator().manual_seed(0)


def rand(*shape):
    return torch.randn(*shape, generator=g, dtype=torch.float64)


PROGRAMS = {
    "linear": (lambda x, w: F.linear(x, w), (rand(2, 4, 8), rand(12, 8))),
    "linear_bias": (lambda x, w, b: F.linear(x, w, b), (rand(2, 4, 8), rand(12, 8), rand(12))),
    "matmul": (lambda a, b: a @ b, (rand(2, 4, 8), rand(2, 8, 4))),
    "pointwise": (lambda x, y: F.gelu(x) * y + y - x / 2.0, (rand(2, 4, 8), rand(4, 8))),
    "scalar_add": (lambda x: x + 1.0, (rand(4, 8),)),
    "view_split_heads": (lambda x: x.view(2, 4, 4, 2).transpose(1, 2), (rand(2, 4, 8),)),
    "view_merge": (lambda x: x.reshape(2, 16).permute(1, 0), (rand(2, 4, 4),)),
    "softmax": (lambda x: torch.softmax(x, dim=-1), (rand(4, 4, 8),)),
    "reductions": (lambda x: x.sum(-1) + x.mean(1).sum(-1, keepdim=True).squeeze(-1),
                   (rand(4, 4, 8),)),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, (8,), w, b), (rand(4, 4, 8), rand(8), rand(8))),
    "sdpa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
             (rand(2, 4, 8, 4), rand(2, 4, 8, 4), rand(2, 4, 8, 4))),
    "sdpa_gqa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                 (rand(2, 8, 4, 4), rand(2, 4, 4, 4), rand(2, 4, 4, 4))),
    "sdpa_cpu_flash_with_mask": (
        lambda q, k, v, m: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, attn_mask=m)[0],
        (rand(2, 4, 8, 4), rand(2, 4, 8, 4), rand(2, 4, 8, 4), rand(8, 8))),
    "sdpa_cpu_flash_causal_lse": (
        lambda q, k, v: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, is_causal=True)[1],
        (rand(2, 4, 8, 4), rand(2, 4, 8, 4), rand(2, 4, 8, 4))),
    "sdpa_math_weights": (
        lambda q, k, v: torch.ops.aten._scaled_dot_product_attention_math(q, k, v)[1],
        (rand(2, 4, 8, 4), rand(2, 4, 8, 4), rand(2, 4, 8, 4))),
    "embedding": (lambda w, i: F.embedding(i, w), (rand(12, 8), torch.tensor([[1, 2], [3, 11]]))),
    "embedding_padding": (lambda w, i: F.embedding(i, w, padding_idx=5),
                          (rand(12, 8), torch.tensor([[5, 2], [7, 11]]))),
    "cat_split": (lambda x, y: torch.cat([x, y], dim=1).split([3, 5], dim=1)[1],
                  (rand(4, 4, 8), rand(4, 4, 8))),
    "expand_unsqueeze": (lambda x: x.unsqueeze(2).expand(4, 4, 4, 8), (rand(4, 4, 8),)),
    "gqa_repeat": (lambda k: torch.repeat_interleave(k, 2, dim=2).flatten(2), (rand(2, 4, 4, 4),)),
    "complex_rope": (lambda x, f: torch.view_as_real(torch.view_as_complex(
        x.reshape(2, 4, 4, 2, 2)) * f).flatten(3),
        (rand(2, 4, 4, 4), torch.polar(torch.ones(4, 1, 2, dtype=torch.float64), rand(4, 1, 2)))),
    "slice_select": (lambda x: x[:, 1:3] + x[:, 0:1] * x.select(1, 2).unsqueeze(1),
                     (rand(4, 4, 8),)),
    "fused_split": (lambda x: x.split(8, dim=-1)[1], (rand(2, 4, 24),)),
    "fused_chunk": (lambda x: x.chunk(2, dim=1)[0], (rand(4, 16, 2),)),
    "fused_split_sizes": (lambda x: torch.split(x, [8, 8, 8], 2)[2], (rand(2, 4, 24),)),
    "fused_gqa_split": (lambda x: torch.split(x, [16, 8, 8], 2)[1], (rand(2, 4, 32),)),
    "fused_gqa_slices": (lambda x: x[..., 16:24] * x[..., 24:], (rand(2, 4, 32),)),
    "cross_entropy_per_token": (lambda x, t: F.cross_entropy(x, t, reduction="none"),
                                (rand(4, 8, 4), torch.tensor([[1, 2, 7, 0]] * 4))),
    "cross_entropy_sum": (lambda x, t, w: F.cross_entropy(x, t, w, reduction="sum",
                                                          label_smoothing=0.1),
                          (rand(4, 8), torch.tensor([1, -100, 7, 0]), rand(8).abs())),
    "cross_entropy_mean": (lambda x, t: F.cross_entropy(x, t),
                           (rand(4, 8), torch.tensor([1, 2, 7, 0]))),
    "cross_entropy_probabilities_sum": (lambda x, q: F.cross_entropy(x, q, reduction="sum"),
                                        (rand(4, 8), rand(4, 8).softmax(-1))),
}


SPLITS = (torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default,
          torch.ops.aten.chunk.default)


def strided(dim, k):
    return _StridedShard(dim, split_factor=k)


def blocked(dim, *sizes):
    return BlockShard(dim, sizes)


R = Replicate()
# program, inputs, the inputs' placements: strided shards flow from the inputs to the split
STRIDED = {
    "linear_view_split": (lambda x, w, b: F.linear(x, w, b).view(2, 4, 24).split(8, -1),
                          (rand(8, 8), rand(24, 8), rand(24)), (R, strided(0, 3), strided(0, 3))),
    "conv1d_addmm_chunk": (lambda b, x, w: torch.addmm(b, x, w).chunk(3, -1),
                           (rand(24), rand(8, 8), rand(8, 24)), (strided(0, 3), R, strided(1, 3))),
    "swiglu_mm": (lambda x, w: (lambda a, b: F.silu(a) * b)(*(x @ w.t()).chunk(2, -1)),
                  (rand(8, 8), rand(16, 8)), (R, strided(0, 2))),
    "pointwise_transpose_sizes": (
        lambda x, y: torch.split((F.gelu(x) * y + x).transpose(1, 2), [8, 8, 8], 1),
        (rand(2, 4, 24), rand(4, 24)), (strided(2, 3), strided(1, 3))),
    "summed_label": (lambda x, w: F.linear(x, w), (rand(4, 16), rand(8, 16)),
                     (strided(1, 2), strided(1, 2))),
    "gqa_linear_view_split": (
        lambda x, w: F.linear(x, w).view(2, 4, 32).split([16, 8, 8], -1),
        (rand(8, 8), rand(32, 8)), (R, blocked(0, 16, 8, 8))),
    "gqa_rope_slices": (  # Phi-3's slices of a fused qkv, through a pointwise op
        lambda x, y: (lambda t: (t[..., :16], t[..., 16:24], t[..., 24:]))(x * y),
        (rand(2, 4, 32), rand(4, 32)), (blocked(2, 16, 8, 8), blocked(1, 16, 8, 8))),
    "convolved_qkv_split": (  # Qwen3.5's linear attention: fused q / k / v convolved
        lambda x, w: torch.split(F.silu(_conv(x, w, padding=3, groups=32))[..., :6]
                                 .transpose(1, 2), [8, 8, 16], -1),
        (rand(2, 32, 6), rand(32, 1, 4)), (blocked(1, 8, 8, 16), blocked(0, 8, 8, 16))),
    "concatenated_convolved_split": (  # Qwen3-Next: q, k and v shards joined, convolved
        lambda q, k, v, w: _conv(torch.cat((q, k, v), -1).transpose(1, 2), w, padding=3,
                                 groups=32)[..., :6].transpose(1, 2).split([8, 8, 16], -1),
        (rand(2, 6, 8), rand(2, 6, 8), rand(2, 6, 16), rand(32, 1, 4)),
        (Shard(2), Shard(2), Shard(2), blocked(0, 8, 8, 16))),
    "grouped_channel_pairs": (  # two channels a group, each giving four: blocks scaled
        lambda x, w: _conv(x, w, groups=16).split([32, 32, 64], 1),
        (rand(2, 32, 6), rand(128, 2, 3)), (blocked(1, 8, 8, 16), blocked(0, 32, 32, 64))),
}


def _conv(x, w, padding=0, groups=1):
    """``aten.convolution`` of a 1-d input, which fxtp's trace makes of ``F.conv1d``."""
    return torch.ops.aten.convolution.default(x, w, None, [1], [padding], [1], False, [0],
                                              groups)


def _ops(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in RULES]


def _cases():
    for name, (fn, args) in PROGRAMS.items():
        gm, values = _record(fn, args)
        for node in _ops(gm):
            yield pytest.param(node, values, id=f"{name}:{node.name}")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("node,values", list(_cases()))
def test_every_strategy_reassembles_the_single_device_result(node, values, world):
    assert _check_strategies(node, values, world) >= 1


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(STRIDED))
def test_strided_inputs_reach_the_split_without_redistribution(name, world):
    """Ops keeping a blocked dim whole carry it; a split of it into its blocks (or slices
    that are its blocks) gives Shard parts."""
    fn, args, placements = STRIDED[name]
    gm, values = _record(fn, args)
    for node, p in zip([n for n in gm.graph.nodes if n.op == "placeholder"], placements):
        node.meta[PLACEMENT] = p
    propagate(gm, PassContext(world))
    for node in _ops(gm):
        actual = [placement_of(a) for a in tensor_inputs(node)]
        assert list(node.meta[INPUTS]) == actual, node.format_node()
        assert _check_strategies(node, values, world, actual) >= 1
    splits = [n for n in _ops(gm) if n.target in SPLITS]
    assert all(type(p) is Shard for n in splits for p in n.meta[PLACEMENT])
    slices = [n for n in _ops(gm) if n.target is torch.ops.aten.slice.Tensor and  # blocks
              n.args[1] == placement_of(n.args[0]).dim]
    assert all(type(n.meta[PLACEMENT]) is Shard for n in slices)


MERGED = {  # (program, input, its placement, the output's placement)
    # BLOOM: heads merged into the batch for bmm, split out again
    "heads_into_batch": (lambda x: (lambda h: torch.bmm(h, h.transpose(1, 2)).softmax(-1))(
        x.reshape(8, 12, 8)).reshape(2, 4, 12, 12), rand(2, 4, 12, 8), Shard(1), Shard(1)),
    "flattened_whole": (lambda x: (x.flatten() * 3).view(2, 4, 6), rand(2, 4, 6), Shard(1),
                        Shard(1)),
    "regrouped": (lambda x: x.reshape(8, 6).exp().reshape(2, 24), rand(2, 4, 6), Shard(1),
                  Shard(1)),
    "last_dim_into_all": (lambda x: x.reshape(-1).tanh(), rand(3, 2, 8), Shard(2),
                          _StridedShard(0, split_factor=6)),
    # DeBERTa: head-sharded relative position keys tiled over the batch
    "tiled_heads": (lambda x: (x.repeat(2, 1, 1) * 2).reshape(2, 4, 16, 8), rand(4, 16, 8),
                    Shard(0), Shard(1)),
}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(MERGED))
def test_a_view_merging_a_sharded_dim_with_dims_before_it_keeps_it_sharded(name, world):
    """For each index of the dims before a sharded dim, a rank holds one contiguous piece:
    merged, the dim holding them is cut in that many blocks, each sharded
    (``_StridedShard``), and split out again it is the sharded dim; tiled by ``repeat``,
    each copy is such a block. No op redistributes, and every strategy reassembles the
    single-device result."""
    fn, x, placement, expected = MERGED[name]
    gm, values = _record(fn, [x])
    next(n for n in gm.graph.nodes if n.op == "placeholder").meta[PLACEMENT] = placement
    propagate(gm, PassContext(world))
    merged = []
    for node in _ops(gm):
        actual = [placement_of(a) for a in tensor_inputs(node)]
        assert list(node.meta[INPUTS]) == actual, node.format_node()
        assert _check_strategies(node, values, world, actual) >= 1
        merged += [p for p in actual if isinstance(p, _StridedShard)]
    assert merged or name == "last_dim_into_all"
    assert placement_of(_ops(gm)[-1]) == expected


def _check_strategies(node, values, world, actual=()):
    """Run every strategy of ``node`` on simulated ranks; return how many were checked."""
    return len(check_strategies(node, values, world, actual))
