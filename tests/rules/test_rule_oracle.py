"""The rule oracle: every strategy of every sharding rule, checked numerically.

Every op with a rule (each key of :data:`~fxtp.passes.rules.RULES` and of
:data:`~fxtp.passes.rules.LIBRARY_RULES`, and every ATen op torch tags ``pointwise`` that
samples reach) is traced the way fxtp traces models
(``torch.export``'s pre-dispatch ATen IR) on sample inputs: torch's OpInfo samples (fp64,
the first few per op whose shapes admit a sharded or partial strategy, at world 2: OpInfo
sizes divide by 2, rarely by 4) and the hand-written :data:`PROGRAMS` below (sizes divisible
by 4, at world 2 and 4), which reach the ops no OpInfo sample does and give every rule a
sharded or partial strategy at world 4. Each node with a rule has every strategy run on
simulated ranks by :func:`tests.helpers.oracle.check_strategies`, forward and backward, and in its
strided form where the rule offers one. ``pytest -s`` prints how many ops were verified.

Strategies known to be wrong are listed in :data:`KNOWN_WRONG` and checked to still fail
(strict xfail). OpInfo samples come from each OpInfo's sample function, called directly
(``OpInfo.sample_inputs`` inspects the call stack for every sample: minutes here).
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from fxtp.passes.rules import LIBRARY_RULES, RULES, tagged_pointwise_ops
from tests.helpers.oracle import all_strategies, check_strategies, ops_with_rules, record

aten = torch.ops.aten
OPINFO_SAMPLES = 4  # samples traced per OpInfo (one export for all of them)
INPLACE_SAMPLES = 2  # of which traced in their in-place form too
PER_OP = 3  # OpInfo nodes checked per op: the first whose shapes admit a sharded strategy

g = torch.Generator().manual_seed(0)


def rand(*shape, dtype=torch.float64):
    return torch.randn(*shape, generator=g, dtype=dtype)


def ints(high, *shape):
    return torch.randint(0, high, shape, generator=g)


# --- hand-written programs: ops no OpInfo sample reaches, and world-4 shapes ----------------

def _flex(q, k, v):
    """flex_attention with a head-indexed score function and a causal block mask built in
    forward (torchtitan's way), so head shards must see global head indices."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None,
                             q.shape[2], k.shape[2], device="cpu")
    return flex_attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + h * 0.25,
                          block_mask=mask)


def _sdpa_ops(q, k, v):
    return (aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)[:2],
            aten._scaled_dot_product_attention_math(q, k, v)[:2])


def conv(x, w, b=None, padding=0, groups=1, transposed=False):
    """``aten.convolution``, which fxtp's trace makes of ``F.conv*`` (they have no rule)."""
    spatial = x.dim() - 2
    return torch.ops.aten.convolution.default(x, w, b, [1] * spatial, [padding] * spatial,
                                              [1] * spatial, transposed, [0] * spatial, groups)


PROGRAMS = {
    # matrix products
    "linear": (lambda x, w: F.linear(x, w), lambda: (rand(4, 8, 12), rand(16, 12))),
    "linear_bias": (lambda x, w, b: F.linear(x, w, b),
                    lambda: (rand(4, 8, 12), rand(16, 12), rand(16))),
    "matmul": (lambda a, b, c, u, v: (a @ b, a @ c, u @ c, c @ v, u @ u),
               lambda: (rand(4, 8, 12), rand(4, 12, 16), rand(12, 16), rand(12), rand(16))),
    # one key head broadcast to every query head (nanoGPT-style multi-query attention)
    "matmul_broadcast": (lambda q, k, p: (q @ k, p @ q),
                         lambda: (rand(4, 4, 8, 4), rand(4, 1, 4, 8), rand(4, 1, 8, 8))),
    "mm_bmm": (lambda a, b, c, d: (torch.mm(a, b), torch.bmm(c, d)),
               lambda: (rand(8, 12), rand(12, 16), rand(4, 8, 12), rand(4, 12, 16))),
    # convolutions (conv1d / conv2d / conv_transpose1d as fxtp's trace decomposes them):
    # biased, unbiased (input channels give a partial sum), grouped and depthwise (Mamba's
    # causal conv: groups dealt to ranks; blocked channels, as a fused projection's q, k
    # and v convolved: Qwen3.5's linear attention), grouped in pairs of channels with
    # unequal blocks (offered only where a rank's chunk of each block is whole groups),
    # transposed (batch only)
    "convolution": (lambda x, w, b, x2, w2, wd, bd, wt, x3, w3: (
        conv(x, w, b, padding=1), conv(x, w), conv(x2, w2, groups=4),
        conv(x, wd, bd, padding=3, groups=8), conv(x, wt, transposed=True),
        conv(x3, w3, groups=8)),
        lambda: (rand(4, 8, 12), rand(16, 8, 3), rand(16), rand(4, 8, 6, 6),
                 rand(16, 2, 3, 3), rand(8, 1, 4), rand(8), rand(8, 4, 3), rand(2, 16, 6),
                 rand(32, 2, 3))),
    # planes resampled, pooled and padded per channel (the kernels F.interpolate,
    # F.max_pool2d, F.pad, F.grid_sample, ... decompose to), 1-d, 2-d and 3-d
    "planes": (lambda x1, x, x3, xs, g, g3: (
        aten.upsample_nearest1d.default(x1, [12]), aten._upsample_nearest_exact1d(x1, [10]),
        aten.upsample_linear1d.default(x1, [9], False), aten.reflection_pad1d(x1, [1, 2]),
        aten.replication_pad1d(x1, [2, 1]), aten.upsample_nearest2d.default(x, [8, 10]),
        aten._upsample_nearest_exact2d.default(x, [7, 7]),
        aten.upsample_bilinear2d.default(x, [8, 9], False),
        aten.upsample_bicubic2d.default(x, [7, 8], True),
        aten._upsample_bilinear2d_aa.default(x, [3, 3], False),
        aten._upsample_bicubic2d_aa.default(x, [4, 3], False), aten.avg_pool2d(x, [2, 2]),
        aten._adaptive_avg_pool2d(x, [3, 2]), aten.reflection_pad2d(x, [1, 1, 2, 2]),
        aten.replication_pad2d(x, [1, 0, 0, 2]), aten.pixel_shuffle(xs, 2),
        aten.pixel_unshuffle(x, 2), aten.max_pool2d_with_indices(x, [2, 2]),
        aten.adaptive_max_pool2d(x, [3, 3]),
        aten.max_unpool2d(*aten.max_pool2d_with_indices(x, [2, 2]), [6, 6]),
        aten.grid_sampler_2d(x, g, 0, 0, False), aten.upsample_nearest3d.default(x3, [4, 6, 6]),
        aten._upsample_nearest_exact3d.default(x3, [5, 5, 5]),
        aten.upsample_trilinear3d.default(x3, [5, 6, 4], False), aten.avg_pool3d(x3, [2, 2, 2]),
        aten._adaptive_avg_pool3d(x3, [2, 3, 2]), aten.reflection_pad3d(x3, [1, 1, 0, 1, 1, 0]),
        aten.replication_pad3d(x3, [1, 0, 1, 0, 0, 2]), aten.max_pool3d_with_indices(x3, [2, 2, 2]),
        aten.adaptive_max_pool3d(x3, [2, 2, 3]),
        aten.max_unpool3d(*aten.max_pool3d_with_indices(x3, [2, 2, 2]), [4, 4, 4], [2, 2, 2],
                          [0, 0, 0]),
        aten.grid_sampler_3d(x3, g3, 0, 1, True)),
        lambda: (rand(4, 8, 6), rand(4, 8, 6, 6), rand(4, 8, 4, 4, 4), rand(4, 16, 3, 3),
                 torch.tanh(rand(4, 5, 3, 2)), torch.tanh(rand(4, 3, 2, 3, 3)))),
    # every step-th element from an offset below step (gpt-oss's interleaved gate / up)
    "strided_slice": (lambda x: (x[:, ::2], x[:, 1::2], x[..., 2::4]),
                      lambda: (rand(4, 12, 16),)),
    # mixture-of-experts rows by expert weights (3 experts of 4, 3, 1 rows; bf16: its only
    # traceable dtype; rows of 16-byte multiples, shards too)
    "grouped_mm": (lambda x, w, offs: torch._grouped_mm(x, w, offs),
                   lambda: (rand(8, 32, dtype=torch.bfloat16),
                            rand(3, 32, 32, dtype=torch.bfloat16),
                            torch.tensor([4, 7, 8], dtype=torch.int32))),
    "addmm_baddbmm": (lambda b, x, w, b3, x3, w3: (torch.addmm(b, x, w),
                                                   torch.baddbmm(b3, x3, w3)),
                      lambda: (rand(16), rand(8, 12), rand(12, 16), rand(4, 8, 16),
                               rand(4, 8, 12), rand(4, 12, 16))),
    "einsum": (lambda a, b, c: (torch.einsum("bik,bkj->bij", a, b),
                                torch.einsum("bij,j->bi", a, c)),
               lambda: (rand(4, 8, 12), rand(4, 12, 16), rand(12))),
    "embedding": (lambda w, i: (F.embedding(i, w), F.embedding(i, w, padding_idx=5)),
                  lambda: (rand(16, 8), torch.tensor([[1, 2, 5, 15], [3, 11, 0, 8]]))),
    # attention and losses
    "sdpa": (lambda q, k, v, m: (F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                 F.scaled_dot_product_attention(q, k, v, attn_mask=m)),
             lambda: (rand(4, 4, 8, 4), rand(4, 4, 8, 4), rand(4, 4, 8, 4), rand(8, 8))),
    "sdpa_gqa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                 lambda: (rand(4, 8, 4, 4), rand(4, 4, 4, 4), rand(4, 4, 4, 4))),
    # multi-query: one key / value head broadcast to every query head (Falcon-7B)
    "sdpa_mqa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                 lambda: (rand(4, 4, 8, 4), rand(4, 1, 8, 4), rand(4, 1, 8, 4))),
    "hf_mask_ops": (lambda x, m, n: (torch.where(m, x, 0.0), torch.where(m, 1.0, x),
                                     aten.where.Scalar(m, 1.0, 0.0), m & n, m | n, m ^ n,
                                     torch.diff(x, dim=1), torch.diff(x, 2, dim=0, prepend=x)),
                    lambda: (rand(4, 8, 12), rand(4, 8, 12) > 0, rand(4, 8, 12) > 0.5)),
    "flex_attention": (_flex, lambda: (rand(4, 4, 16, 8), rand(4, 4, 16, 8), rand(4, 4, 16, 8))),
    "sdpa_kernels": (_sdpa_ops, lambda: (rand(4, 4, 8, 4), rand(4, 4, 8, 4), rand(4, 4, 8, 4))),
    "sdpa_cpu_flash_mask": (
        lambda q, k, v, m: aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, attn_mask=m)[0],
        lambda: (rand(4, 4, 8, 4), rand(4, 4, 8, 4), rand(4, 4, 8, 4), rand(4, 1, 8, 8))),
    "dropout": (lambda x: (F.dropout(x, 0.0), F.dropout(x, 0.5)), lambda: (rand(4, 8, 12),)),
    "cross_entropy": (lambda x, t, x2, t2, w: (F.cross_entropy(x, t, reduction="none"),
                                               F.cross_entropy(x2, t2, w, reduction="sum",
                                                               label_smoothing=0.1)),
                      lambda: (rand(4, 8, 4), ints(8, 4, 4), rand(4, 8), ints(8, 4),
                               rand(8).abs())),
    "nll_loss": (lambda x, t, x2, t2, w, t3: (
                     F.nll_loss(x, t), F.nll_loss(x2, t2, w, reduction="sum"),
                     F.nll_loss(x2, t3, w, ignore_index=3), F.nll_loss(x, t, reduction="none"),
                     F.nll_loss(x2[0], t3[0], w, ignore_index=3)),
                 lambda: (rand(4, 8, 4), ints(8, 4, 4), rand(4, 8), ints(8, 4), rand(8).abs(),
                          torch.tensor([3, 1, 7, 3]))),
    # normalizations
    "norms": (lambda x, w, b, x4, gw, gb: (F.layer_norm(x, (12,), w, b),
                                           F.rms_norm(x, (12,), w),
                                           aten.native_layer_norm(x, [12], w, b, 1e-5),
                                           F.group_norm(x4, 2, gw, gb)),
              lambda: (rand(4, 8, 12), rand(12), rand(12), rand(4, 8, 4, 4), rand(8),
                       rand(8))),
    "batch_norm": (lambda x, w, b, rm, rv: (
                       F.batch_norm(x, rm.clone(), rv.clone(), w, b, training=True),
                       F.batch_norm(x, rm, rv, w, b, training=False),
                       aten.native_batch_norm(x, w, b, rm.clone(), rv.clone(), True, 0.1, 1e-5),
                       aten._native_batch_norm_legit_no_training(x, w, b, rm, rv, 0.1, 1e-5)),
                   lambda: (rand(4, 8, 12), rand(8), rand(8), rand(8), rand(8).abs() + 0.5)),
    "fused_rms_norm": (lambda x, w: aten._fused_rms_norm(x, [12], w, 1e-6),
                       lambda: (rand(4, 8, 12), rand(12))),
    # along a dim
    "softmax": (lambda x: (torch.softmax(x, -1), torch.log_softmax(x, 1),
                           aten._softmax(x, -1, False), aten._log_softmax(x, 0, False),
                           aten._safe_softmax(x, -1)),
                lambda: (rand(4, 8, 12),)),
    "cumulative": (lambda x, y: (torch.cumsum(x, 1), y.cumsum_(0), torch.cumprod(x, -1),
                                 torch.logcumsumexp(x, 0), torch.cummax(x, 1),
                                 torch.cummin(x, 2)),
                   lambda: (rand(4, 8, 12), rand(4, 8, 12))),
    "sorting": (lambda x: (torch.sort(x, 1), torch.sort(x, dim=0, stable=True),
                           torch.argsort(x), torch.argsort(x, dim=1, stable=True),
                           torch.topk(x, 3, dim=1)),
                lambda: (rand(4, 8, 12),)),
    # reductions
    "sums": (lambda x: (x.sum(), x.sum(1), x.sum((0, 2), keepdim=True), x.nansum(2),
                        x.mean(), x.mean(1), x.mean((0, 1), keepdim=True)),
             lambda: (rand(4, 8, 12),)),
    "extrema": (lambda x: (x.prod(), x.prod(1), x.amax(1), x.amin((0, 2)), x.max(), x.min(),
                           x.max(1), x.min(2, keepdim=True), x.argmax(1), x.argmin(),
                           x.argmin(2, True),
                           x.logsumexp(1), x.median(1), x.kthvalue(2, 1)),
                lambda: (rand(4, 8, 12),)),
    "logical": (lambda b: (b.any(), b.any(1), b.any((0, 2)), b.all(), b.all(1),
                           b.all((1, 2)), torch.count_nonzero(b, 1), torch.count_nonzero(b)),
                lambda: (rand(4, 8, 12) > 0,)),
    "moments": (lambda x: (x.var(1), x.std((0, 2), keepdim=True), torch.var_mean(x, 1),
                           torch.std_mean(x, 2), aten.var.dim(x, [1]), aten.std.dim(x, [2]),
                           torch.linalg.vector_norm(x, dim=1), torch.norm(x, dim=2),
                           x.norm(p=2, dim=1), aten.var.correction(x, [1]),
                           aten.std.correction(x, [0, 2], correction=0, keepdim=True),
                           aten.var_mean.correction(x, [2]),
                           aten.std_mean.correction(x, [1], keepdim=True)),
                lambda: (rand(4, 8, 12),)),
    # views and shape changes
    "views": (lambda x: (x.view(4, 2, 4, 12), x.reshape(32, 12), x.flatten(1),
                         x.view(4, 8, 3, 2, 2), x.unfold(1, 3, 2), x.unfold(-1, 5, 1),
                         torch.diagonal(x, 0, 1, 2), torch.diagonal(x, 1, 0, 2),
                         x.view(torch.int64), x.view(torch.int32), x.float().view(torch.int32),
                         torch.view_as_complex(x.view(4, 8, 6, 2))._conj(),
                         x.unflatten(1, (2, 4)), x.unflatten(2, (4, -1)),
                         x.transpose(0, 2), x.permute(2, 0, 1), x.movedim(0, 2),
                         x.movedim((0, 1), (2, 0)), x[0].t(), x[0].T, x.permute(2, 0, 1).T,
                         x.mT, x.adjoint(), x.mH, x[0].H),
              lambda: (rand(4, 8, 12),)),
    "squeeze_expand": (lambda x: (x.unsqueeze(1), x.unsqueeze(1).squeeze(), x.unsqueeze(0)
                                  .squeeze(0), x.unsqueeze(1).squeeze((1,)),
                                  x.unsqueeze(1).expand(4, 4, 8, 12), x.repeat(1, 2, 1),
                                  x.repeat_interleave(2, dim=1),
                                  x.repeat_interleave(2, dim=1, output_size=16),
                                  x.repeat_interleave(2, output_size=768)),
                       lambda: (rand(4, 8, 12),)),
    "unsafe_view_alias": (lambda x: (aten._unsafe_view(x, [4, 2, 48]), aten.alias(x),
                                     aten.detach(x), aten._to_copy(x, dtype=torch.float32),
                                     aten.lift_fresh_copy(x), aten.copy(x, x * 2)),
                          lambda: (rand(4, 8, 12),)),
    "conversions": (lambda x, y: (x.to(torch.float32), x.type_as(y), x.contiguous(),
                                  x.to(y), torch.zeros_like(x), torch.ones_like(x),
                                  torch.full_like(x, 3.0), torch.empty_like(x),
                                  x.new_zeros(4, 8), x.new_ones(4), x.new_empty(8),
                                  x.new_full((4, 4), 2.0)),
                    lambda: (rand(4, 8, 12), rand(4, 8, 12, dtype=torch.float32))),
    "factories": (lambda x: (torch.zeros(4, 8, dtype=x.dtype), torch.ones(8, 4, dtype=x.dtype),
                             torch.empty(4, 8, dtype=x.dtype),
                             torch.full((4, 8), 2.0, dtype=x.dtype)),
                  lambda: (rand(4, 8),)),
    "explicit_overloads": (
        lambda x, y, m, b: (aten.to.dtype_layout(x, dtype=torch.float32), aten.to.other(x, y),
                            x.transpose(0, 1).contiguous(), aten.mul.Scalar(x, 2.0),
                            aten.div.Scalar(x, 4.0), aten.mul_.Scalar(x.clone(), 3.0),
                            aten.div_.Scalar(x.clone(), 2.0),
                            x.masked_fill(m, torch.tensor(0.5, dtype=torch.float64)),
                            x.clone().masked_fill_(m, torch.tensor(1.5, dtype=torch.float64)),
                            aten.norm.ScalarOpt_dim(x, 2, [1]),
                            aten.norm.ScalarOpt_dim(x, 3, [0, 2], True),
                            torch.count_nonzero(b, (0, 2)),
                            aten.conj.default(torch.complex(x, y.double()))),
        lambda: (rand(4, 8, 12), rand(4, 8, 12, dtype=torch.float32), rand(4, 8, 12) > 0,
                 rand(4, 8, 12) > 0)),
    "complex": (lambda x, f: torch.view_as_real(torch.view_as_complex(x) * f),
                lambda: (rand(4, 8, 12, 2), torch.polar(torch.ones(8, 12, dtype=torch.float64),
                                                         rand(8, 12)))),
    "cat_stack_split": (lambda x, y: (torch.cat([x, y], 1), torch.stack([x, y], 1),
                                      torch.stack([x, y], -1), x.split(4, 1),
                                      x.split([4, 8], 2), x.chunk(2, 1), x.unbind(1),
                                      x[:, 2:6], x.narrow(2, 4, 4), x.select(1, 3),
                                      x.flip(1), x.roll(2, 1), F.pad(x, (1, 2)),
                                      aten.constant_pad_nd(x, [1, 2]),
                                      F.pad(x, (0, 0, 1, 1), value=2.0)),
                        lambda: (rand(4, 8, 12), rand(4, 8, 12))),
    "fused_split": (lambda x: (x.split(8, -1), torch.split(x, [8, 8, 8], 2), x.chunk(3, -1)),
                    lambda: (rand(4, 8, 24),)),
    "tril_triu": (lambda x, y: (x.tril(), x.triu(1), y.tril(-2), y.triu()),
                  lambda: (rand(8, 8), rand(4, 8, 12))),
    # indexing and scatter
    "index": (lambda x, i, j, m: (x[i], x[:, i], x[i, :, j], x[:, i, j], x[m]),
              lambda: (rand(8, 8, 12), ints(8, 4), ints(12, 4), rand(8, 8) > 0)),
    "index_put": (lambda x, i, v, y, j, w: (x.index_put((i,), v),
                                            aten.index_put_(y.clone(), [None, j], w, True)),
                  lambda: (rand(8, 8, 12), torch.tensor([1, 5, 2, 7]), rand(4, 8, 12),
                           rand(4, 8, 12), torch.tensor([0, 3, 3, 6]), rand(4, 4, 12))),
    "index_put_": (lambda x, i, v: torch.ops.aten.index_put_(x.clone(), [None, i], v),
                   lambda: (rand(4, 8, 12), torch.tensor([1, 5]), rand(4, 2, 12))),
    # masked fills by a boolean index: the mask over all dims or the leading ones, one value
    "index_put_mask": (lambda x, v: (aten.index_put(x, [x > 0.5], v),
                                     aten.index_put_(x.clone(), [x[..., 0] > 0], v, True),
                                     aten.index_put(x, [x > 0], v.reshape(1))),
                       lambda: (rand(4, 8, 12), rand(()))),
    "index_ops": (lambda x, i, s, s2: (x.index_select(1, i), x.index_copy(1, i, s),
                                       x.clone().index_copy_(1, i, s), x.index_add(1, i, s),
                                       x.clone().index_add_(1, i, s2),
                                       x.index_fill(1, i, 2.0),
                                       x.clone().index_fill_(1, i, -1.0)),
                  lambda: (rand(4, 8, 12), torch.tensor([1, 5, 2, 7]), rand(4, 4, 12),
                           rand(4, 4, 12))),
    "gather_scatter": (lambda x, i, s: (x.gather(1, i), x.scatter(1, i, s),
                                        x.clone().scatter_(1, i, s), x.scatter(1, i, 2.0),
                                        x.clone().scatter_(1, i, -1.0),
                                        x.scatter_add(1, i, s), x.clone().scatter_add_(1, i, s)),
                       lambda: (rand(4, 8, 12), torch.argsort(rand(4, 8, 12), 1)[:, :4],
                                rand(4, 4, 12))),
    # per-token log-probabilities of targets, by hand (on vocab shards: Partial)
    "gather_targets": (lambda x, t: (x.gather(-1, t), torch.take_along_dim(x, t, -1)),
                       lambda: (rand(4, 6, 16), ints(16, 4, 6, 1))),
    # pointwise
    "pointwise": (lambda x, y, b, m: (x + y, x - y, x * y, x / y, x * 2.0, x / 2.0, -x,
                                      x.clone().add_(y), x.clone().sub_(y),
                                      x.clone().mul_(y), x.clone().div_(y),
                                      x.clone().mul_(3.0), x.clone().div_(3.0),
                                      x.clone().neg_(), F.gelu(x), torch.sin(x) + b,
                                      torch.where(m, x, y), x.masked_fill(m, 0.5),
                                      x.clone().masked_fill_(m, 1.5), x.clone().fill_(2.0),
                                      x.clone().fill_(b[0, 0]), x.clone().zero_(),
                                      x.clone().copy_(y), +x, x.positive(),
                                      torch.clamp(x, -0.5, 0.5), x.pow(2)),
                  lambda: (rand(4, 8, 12), rand(4, 8, 12), rand(8, 1), rand(4, 8, 12) > 0)),
    "scalar_overloads": (
        lambda x, y: (aten.add.Scalar(x, 2.0), aten.sub.Scalar(x, 1.0), aten.rsub.Scalar(x, 1.0),
                      aten.eq.Scalar(x, 0.5), aten.lt.Scalar(x, 0.0), aten.ge.Scalar(x, 0.0),
                      aten.pow.Scalar(2.0, x), aten.pow.Tensor_Scalar(x, 3),
                      aten.remainder.Scalar(x, 0.7), aten.fmod.Scalar(x, 0.7),
                      aten.clamp_min(x, 0.0), aten.clamp_max(x, 0.5),
                      aten.lerp.Tensor(x, y, y.sigmoid()), aten.xlogy.Scalar_Other(x.abs(), 2.0),
                      aten.relu_(x.clone()), aten.hardtanh_(x.clone())),
        lambda: (rand(4, 8, 12), rand(4, 8, 12))),
    "backward_ops": (
        lambda g, x, y: (aten.gelu_backward(g, x), aten.sigmoid_backward(g, y.sigmoid()),
                         aten.tanh_backward(g, y.tanh()), aten.silu_backward(g, x),
                         aten.threshold_backward(g, x, 0.0),
                         aten.logit_backward(g, y.sigmoid())),
        lambda: (rand(4, 8, 12), rand(4, 8, 12), rand(4, 8, 12))),
    "complex_pointwise": (lambda z: (z.real, z.imag, z.conj(), z * 2.0),
                          lambda: (torch.complex(rand(4, 8, 12), rand(4, 8, 12)),)),
}


# --- samples ------------------------------------------------------------------------------

@dataclass
class Case:
    """One node to check: where it was traced, its graph's values, the world sizes."""

    source: str
    node: fx.Node
    values: dict
    worlds: tuple[int, ...]


def _base_name(op) -> str:
    if not isinstance(op, torch._ops.OpOverload):  # a higher-order op
        return op.name()
    name = op._schema.name.split("::")[1]
    return name if name.startswith("_") else name.rstrip("_")


# OpInfo names that reach an op of another name
_OPINFO_ALIASES = {"cross_entropy": "cross_entropy_loss", "__getitem__": "index",
                   "__rsub__": "sub", "__radd__": "add", "__rmul__": "mul", "__rdiv__": "div",
                   "__rpow__": "pow", "__rmod__": "remainder", "__rand__": "bitwise_and",
                   "__ror__": "bitwise_or", "__rxor__": "bitwise_xor", "__rlshift__": "__lshift__",
                   "__rrshift__": "__rshift__", "nn.functional.dropout": "dropout",
                   "norm": "linalg_vector_norm"}


def _opinfos(op_db, targets) -> list:
    names = {_base_name(op) for op in targets}
    chosen = []
    for info in op_db:
        if info.name.startswith("masked."):  # compositions of the ops sampled directly
            continue
        candidates = {info.name, info.aten_name, info.name.split(".")[-1],
                      info.name.replace(".", "_"), _OPINFO_ALIASES.get(info.name)}
        candidates |= {a.name for a in info.aliases}
        candidates |= {c.rstrip("_") for c in candidates if c}
        if candidates & names:
            chosen.append(info)
    return chosen


def _dtype(info):
    supported = info.supported_dtypes("cpu")
    for dtype in (torch.float64, torch.complex128, torch.int64, torch.bool):
        if dtype in supported:
            return dtype
    return None


def _shardable(sample) -> bool:
    """Could a strategy shard this sample at world 2 (a tensor with an even dim)?"""
    return any(isinstance(x, torch.Tensor) and any(d % 2 == 0 for d in x.shape)
               for x in tree_leaves((sample.input, sample.args, sample.kwargs)))


def _calls(info, dtype) -> list:
    """``(fn, sample args)`` of the OpInfo's first samples a strategy could shard (or its
    first sample): the op, and for the first ones its in-place form."""
    generator = None
    torch.manual_seed(0)
    try:  # the sample function itself: ``sample_inputs`` inspects the stack, per sample
        generator = info.sample_inputs_func(info, "cpu", dtype, False)
        samples = list(itertools.islice(generator, 3 * OPINFO_SAMPLES))
    except Exception:  # noqa: BLE001 - a sample function that does not run here
        return []
    finally:
        getattr(generator, "close", lambda: None)()
    chosen = [s for s in samples if _shardable(s)][:OPINFO_SAMPLES] or samples[:1]
    calls = []
    for n, s in enumerate(chosen):
        args = (s.input, s.args, s.kwargs)
        calls.append((lambda x, a, k: info.op(x, *a, **k), args))
        inplace = info.inplace_variant
        if inplace is not None and n < INPLACE_SAMPLES and \
                isinstance(s.input, torch.Tensor) and not s.broadcasts_input:
            calls.append((lambda x, a, k, f=inplace: f(x.clone(), *a, **k), args))
    return calls


def _trace_calls(calls):
    """Export one program making every call; return ``(gm, values)`` or ``None``."""
    flat, specs = [], []
    for _, args in calls:
        leaves, spec = tree_flatten(args)
        flat.append(leaves)
        specs.append((spec, [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]))
    tensors = [leaves[i].detach().clone() for leaves, (_, where) in zip(flat, specs)
               for i in where]

    def program(*xs):
        it, outs = iter(xs), []
        for (fn, _), leaves, (spec, where) in zip(calls, flat, specs):
            leaves = list(leaves)
            for i in where:
                leaves[i] = next(it)
            outs += [o for o in tree_leaves(fn(*tree_unflatten(leaves, spec)))
                     if isinstance(o, torch.Tensor)]
        return tuple(outs)
    try:
        return record(program, tensors)
    except Exception:  # noqa: BLE001 - an op export or this harness cannot trace
        return None


def _opinfo_graphs():
    """``(OpInfo name, gm, values)`` of every OpInfo whose name matches an op with a rule."""
    from torch.testing._internal.common_methods_invocations import op_db
    graphs = []
    for info in _opinfos(op_db, set(RULES) | set(tagged_pointwise_ops())):
        dtype = _dtype(info)
        calls = _calls(info, dtype) if dtype is not None else []
        name = info.name + (f".{info.variant_test_name}" if info.variant_test_name else "")
        traced = _trace_calls(calls) if calls else None
        if traced is None:  # one call that does not trace fails the batch: one at a time
            for i, call in enumerate(calls):
                one = _trace_calls([call])
                if one is not None:
                    graphs.append((f"{name}[{i}]", *one))
        else:
            graphs.append((name, *traced))
    return graphs


def _nontrivial(node, world) -> bool:
    """Does the node have a strategy other than all-Replicate at ``world``? (A rule that
    fails to state its strategies is checked, to fail there.)"""
    try:
        return len(all_strategies(node, world)) > 1
    except Exception:  # noqa: BLE001
        return True


# programs of which only some ops are checked: the rest runs inside torch's vmap (flex
# attention's BlockMask is built by vmapping the mask function), not as a standalone op
ONLY = {"flex_attention": {torch.ops.higher_order.flex_attention}}


def _library_programs() -> dict:
    """Programs of the other libraries' ops :data:`LIBRARY_RULES` covers, where the library
    is installed: transformers' grouped matmul (fp32: it has no fp64 kernel; 3 experts of 4,
    3, 1 rows)."""
    try:
        import transformers.integrations.moe  # noqa: F401 - registers the op
    except ImportError:
        return {}
    return {"grouped_mm_fallback": (
        lambda x, w, offs: torch.ops.transformers.grouped_mm_fallback(x, w, offs),
        lambda: (rand(8, 12, dtype=torch.float32), rand(3, 12, 16, dtype=torch.float32),
                 torch.tensor([4, 7, 8], dtype=torch.int32)))}


@functools.lru_cache(maxsize=None)
def cases() -> dict:
    """op -> the nodes checked for it."""
    found: dict = {}
    for name, (fn, make_args) in {**PROGRAMS, **_library_programs()}.items():
        try:
            gm, values = record(fn, make_args())
        except Exception as e:
            raise RuntimeError(f"program {name!r} does not trace: {e}") from e
        for node in ops_with_rules(gm):
            if name in ONLY and node.target not in ONLY[name]:
                continue
            found.setdefault(node.target, []).append(
                Case(f"{name}:{node.name}", node, values, (2, 4)))
    fallback: dict = {}
    for name, gm, values in _opinfo_graphs():
        for node in ops_with_rules(gm):
            op = node.target
            opinfo_cases = [c for c in found.get(op, []) if c.worlds == (2,)]
            if len(opinfo_cases) >= PER_OP:
                continue
            case = Case(f"opinfo {name}:{node.name}", node, values, (2,))
            if _nontrivial(node, 2):
                found.setdefault(op, []).append(case)
            else:
                fallback.setdefault(op, case)
    for op, case in fallback.items():
        if op not in found:
            found[op] = [case]
    return found


def _params():
    return [pytest.param(op, id=str(op)) for op in sorted(cases(), key=str)]


CHECKED: dict = {}  # op -> strategies checked (filled as the tests run)


def _sdpa_dropout(case, strategy) -> bool:
    node = case.node
    p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    return p > 0 and "S(" in strategy


KNOWN_WRONG = {
    # op: (which of its strategies fail, why); each checked to still fail (strict xfail)
    "aten.scaled_dot_product_attention.default": (
        _sdpa_dropout, "dropout_p > 0: each rank draws a mask for its shard, not its part of "
        "the single-device mask (same distribution, other numbers; docs/how-it-works.md: "
        "Randomness)"),
}


FORWARD_ONLY = {torch.ops.higher_order.flex_attention}  # torch has no CPU flex backward
# bf16-only ops: each rank's partial sum (of random parts, for Partial inputs) is rounded
# to bf16 before they are added, so an output near zero differs by the rounding of terms up
# to ~30 (2^-8 of them); a wrong strategy misses by the outputs' own size (~5 to 15)
TOLERANCES = {"aten._grouped_mm.default": dict(rtol=1.6e-2, atol=0.5)}


def _run(op, known: bool):
    """Check every case of ``op``; return the failures (``known``: only those
    :data:`KNOWN_WRONG` lists, else only the others) and the number of strategies checked."""
    wrong, _ = KNOWN_WRONG.get(str(op), (lambda case, strategy: False, ""))
    failures, checked = [], 0
    for seed, case in enumerate(cases()[op]):
        for world in case.worlds:
            errors = []
            try:
                checked += len(check_strategies(case.node, case.values, world,
                                                backward=op not in FORWARD_ONLY,
                                                strided=True, units=True, seed=seed,
                                                tol=TOLERANCES.get(str(op)), errors=errors))
            except Exception as e:  # noqa: BLE001 - no strategies or no reference result
                errors.append(("(all)", f"{type(e).__name__}: {e}"))
            failures += [f"{case.source} world {world}: {strategy}: {why}"
                         for strategy, why in errors if wrong(case, strategy) == known]
    return failures, checked


@pytest.mark.parametrize("op", _params())
def test_every_strategy_reassembles_forward_and_backward(op):
    failures, CHECKED[op] = _run(op, known=False)
    assert not failures, f"{op}: {len(failures)} failing:\n" + "\n".join(failures)


@pytest.mark.parametrize("name", [pytest.param(name, id=name, marks=pytest.mark.xfail(
    strict=True, reason=reason)) for name, (_, reason) in KNOWN_WRONG.items()])
def test_known_wrong_strategies_still_fail(name):
    """The strategies :data:`KNOWN_WRONG` lists fail: fixing one turns this XPASS (strict:
    a failure), to remove it from the list."""
    (op,) = [op for op in cases() if str(op) == name]
    failures, _ = _run(op, known=True)
    assert not failures, "\n".join(failures)


# kernels that run only on CUDA, which this CPU oracle does not check (their rule,
# ``_sdpa_spec``, is checked on the CPU flash and math kernels)
CUDA_ONLY = {"aten._scaled_dot_product_flash_attention.default",
             "aten._scaled_dot_product_efficient_attention.default",
             "aten._scaled_dot_product_cudnn_attention.default"}
# ops no strategy but all-Replicate ever serves: reductions over every dim that do not sum
REPLICATE_ONLY = {"aten.max.default", "aten.min.default", "aten.any.default",
                  "aten.all.default", "aten.prod.default"}


def test_every_rule_is_checked():
    """Every op of the table has a checked sample, with a sharded or partial strategy at
    world 4; prints how many ops were verified (``pytest -s``)."""
    found = cases()
    explicit = [op for op in RULES if op in found]
    tagged = [op for op in found if op not in RULES]
    derived = [op for op in tagged_pointwise_ops() if op not in RULES]
    print(f"\nrule oracle: {len(explicit)} of {len(RULES)} explicit rules and {len(tagged)} "
          f"of {len(derived)} tag-derived pointwise ops verified"
          + (f"; {sum(CHECKED.values())} strategy checks" if CHECKED else ""))
    missing = [str(op) for op in RULES if op not in found and str(op) not in CUDA_ONLY]
    libraries = {op._schema.name for op in found if isinstance(op, torch._ops.OpOverload)}
    if _library_programs():
        missing += [name for name in LIBRARY_RULES if name not in libraries]
    assert not missing, f"ops with a rule but no checked sample: {missing}"
    at_world_4 = {op for op, found_cases in found.items() for c in found_cases
                  if 4 in c.worlds and _nontrivial(c.node, 4)}
    unsharded = [str(op) for op in RULES if op in found and op not in at_world_4
                 and str(op) not in REPLICATE_ONLY]
    assert not unsharded, f"no sharded or partial strategy checked at world 4: {unsharded}"
