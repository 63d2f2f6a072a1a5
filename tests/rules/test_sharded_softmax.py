"""Softmax, log-softmax, log-sum-exp, max and min, top-k, any and all, and cumulative sums
over a sharded dim: per-row collectives, never a gather of the tensor.

The kernels against torch's ops on the whole tensor (even, uneven, strided and empty
shards, several reduced dims, ``keepdim``, ``dtype`` arguments, ``-inf`` entries and
rows, ties, bf16), forward and the local gradient; then the losses model code puts on
loss parallel's class-sharded logits: a z-loss and a distillation loss, at parity with
single device, strict, with loss parallel's collectives plus the kernels' own.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import fxtp
from fxtp.passes.placement import UnitShard
from fxtp.passes.placement import local_range
from fxtp.kernels.sharded_softmax import (any_of_shards, arg_of_shards, cumsum_of_shards,
                                          extremum_of_shards, logsumexp_of_shards,
                                          pick_of_shards, softmax_of_shards, topk_of_shards)
from tests.helpers import models, transformer_models as tm
from tests.helpers.compiled import check_compiled
from tests.helpers.parity import TIGHT, check_parity, local_part

aten = torch.ops.aten

# name: (shape, placement, reference on the whole tensor, kernel on this rank's part);
# "ties": the tensor's values rounded, so that extremes repeat within and across ranks;
# "masked": with -inf entries in every row ("masked_rows": and whole rows of them)
CASES = {
    "logsumexp": ((6, 16), Shard(1), lambda x: torch.logsumexp(x, 1),
                  lambda x, g: logsumexp_of_shards(x, [1], False, g)),
    "logsumexp_two_dims_keepdim": ((3, 8, 12), Shard(2),
                                   lambda x: torch.logsumexp(x, [1, 2], keepdim=True),
                                   lambda x, g: logsumexp_of_shards(x, [1, -1], True, g)),
    "logsumexp_uneven_empty": ((4, 5), UnitShard(1, 5), lambda x: torch.logsumexp(x, -1),
                               lambda x, g: logsumexp_of_shards(x, [-1], False, g)),
    "logsumexp_masked": ((6, 16), Shard(1), lambda x: torch.logsumexp(x, 1),
                         lambda x, g: logsumexp_of_shards(x, [1], False, g)),
    "softmax": ((6, 16), Shard(1), lambda x: x.softmax(-1),
                lambda x, g: softmax_of_shards(x, -1, False, False, None, g)),
    "softmax_strided": ((4, 16), _StridedShard(1, split_factor=2), lambda x: x.softmax(1),
                        lambda x, g: softmax_of_shards(x, 1, False, False, None, g)),
    "softmax_uneven": ((4, 10), UnitShard(1, 10), lambda x: x.softmax(1),
                       lambda x, g: softmax_of_shards(x, 1, False, False, None, g)),
    "softmax_masked": ((6, 16), Shard(1), lambda x: x.softmax(-1),
                       lambda x, g: softmax_of_shards(x, -1, False, False, None, g)),
    "softmax_dtype": ((6, 16), Shard(1), lambda x: x.float().softmax(-1, torch.float64),
                      lambda x, g: softmax_of_shards(x.float(), -1, False, False,
                                                     torch.float64, g)),
    "softmax_dim0": ((16, 3, 2), Shard(0), lambda x: x.softmax(0),
                     lambda x, g: softmax_of_shards(x, 0, False, False, None, g)),
    "safe_softmax_masked_rows": ((6, 16), Shard(1),
                                 lambda x: aten._safe_softmax(x, -1),
                                 lambda x, g: softmax_of_shards(x, -1, False, True,
                                                                None, g)),
    "log_softmax": ((6, 16), Shard(1), lambda x: x.log_softmax(-1),
                    lambda x, g: softmax_of_shards(x, -1, True, False, None, g)),
    "log_softmax_masked": ((6, 16), Shard(1), lambda x: x.log_softmax(-1),
                           lambda x, g: softmax_of_shards(x, -1, True, False, None, g)),
    "amax_ties": ((6, 16), Shard(1), lambda x: x.amax(-1),
                  lambda x, g: extremum_of_shards(x, [-1], False, True, g)),
    "amin_ties_two_dims_keepdim": ((3, 8, 4), Shard(1), lambda x: x.amin([0, 1], True),
                                   lambda x, g: extremum_of_shards(x, [0, 1], True, False,
                                                                   g)),
    "amax_uneven_empty": ((4, 5), UnitShard(1, 5), lambda x: x.amax(1),
                          lambda x, g: extremum_of_shards(x, [1], False, True, g)),
}
KERNEL_COUNTS = {"logsumexp": ({"all_reduce": 2}, {}),
                 "softmax": ({"all_reduce": 2}, {"all_reduce": 1}),
                 "log_softmax": ({"all_reduce": 2}, {"all_reduce": 1}),
                 "safe_softmax": ({"all_reduce": 2}, {"all_reduce": 1}),
                 "amax": ({"all_reduce": 1}, {"all_reduce": 1}),
                 "amin": ({"all_reduce": 1}, {"all_reduce": 1})}


def _whole(name, shape, dtype):
    """The whole tensor of case ``name``, a leaf."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0),
                    dtype=torch.float64).mul(3)
    if "ties" in name:
        x = x.round()
    if "masked" in name:  # as attention masks leave them
        mask = torch.arange(shape[-1]) % 3 == 1
        if "masked_rows" in name:
            mask = mask | (torch.arange(shape[0]) == 2)[:, None]
        x = x.masked_fill(mask, -torch.inf)
    return x.to(dtype).requires_grad_()


def kernel_vs_full(rank, world, name, dtype):
    shape, placement, reference, kernel = CASES[name]
    full = _whole(name, shape, dtype)
    ref = reference(full)
    upstream = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1),
                           dtype=torch.float64).to(ref.dtype)
    (ref.masked_fill(ref.isinf(), 0) * upstream).sum().backward()
    x = local_part(full.detach(), placement, rank, world).clone().requires_grad_()
    with fxtp.count_collectives() as fwd:
        out = kernel(x, dist.group.WORLD.group_name)
    with fxtp.count_collectives() as bwd:
        (out.masked_fill(out.isinf(), 0) * local_like(upstream, ref, out, placement, rank,
                                                      world)).sum().backward()
    close = TIGHT if dtype == torch.float64 else \
        dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else {}
    expected = local_like(ref.detach(), ref, out, placement, rank, world)
    assert out.dtype == ref.dtype and x.grad.dtype == x.dtype
    torch.testing.assert_close(out, expected, equal_nan=True, **close)
    torch.testing.assert_close(x.grad, local_part(full.grad, placement, rank, world),
                               **close)
    return dict(fwd.counts), dict(bwd.counts)


def local_like(t, ref, out, placement, rank, world):
    """``t`` (shaped as the whole result ``ref``) as this rank holds ``out``: its part
    where the result is sharded like the input, the whole where it is replicated."""
    return t if out.shape == ref.shape else local_part(t, placement, rank, world)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16],
                         ids=["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_the_op_on_the_whole_tensor(ranks, name, dtype):
    """Forward 2 all-reduces for the exponentials' shift and sum (1 for max and min);
    backward 1 for softmax's row sum and for the ties' count, none for logsumexp."""
    kind = next(k for k in sorted(KERNEL_COUNTS, key=len, reverse=True) if k in name)
    assert ranks.run(kernel_vs_full, name, dtype)[0] == KERNEL_COUNTS[kind]


# name: (shape, placement, dim, keepdim, largest); "ties", "masked" as above; "nan": some
# rows hold nan, on either rank's part or both
PICKS = {
    "max": ((6, 16), Shard(1), -1, False, True),
    "min_keepdim": ((6, 16), Shard(1), 1, True, False),
    "max_ties": ((6, 16), Shard(1), 1, False, True),
    "min_ties_dim0": ((16, 3, 2), Shard(0), 0, False, False),
    "max_nan": ((6, 16), Shard(1), 1, False, True),
    "min_nan": ((6, 16), Shard(1), 1, False, False),
    "max_masked_rows": ((6, 16), Shard(1), 1, False, True),
    "max_uneven_empty": ((4, 5), UnitShard(1, 5), 1, False, True),
    "min_ties_uneven": ((4, 10), UnitShard(1, 10), 1, True, False),
}


def pick_vs_full(rank, world, name, dtype):
    """``max`` / ``min`` along a dim (values, indices, the values' gradient) and ``argmax``
    / ``argmin`` against torch's on the whole tensor."""
    shape, placement, dim, keepdim, largest = PICKS[name]
    full = _whole(name, shape, dtype)
    if "nan" in name:
        with torch.no_grad():
            full[1, 3] = full[2, -2] = full[2, 5] = torch.nan
    ref_values, ref_index = (torch.max if largest else torch.min)(full, dim, keepdim)
    upstream = torch.randn(ref_values.shape, generator=torch.Generator().manual_seed(1),
                           dtype=torch.float64).to(dtype)
    (ref_values.nan_to_num(0, 0, 0) * upstream).sum().backward()
    x = local_part(full.detach(), placement, rank, world).clone().requires_grad_()
    offset = local_range(placement, shape[dim], rank, world)[0]
    args = (dim, keepdim, largest, offset, rank, world, dist.group.WORLD.group_name)
    with fxtp.count_collectives() as fwd:
        values, index = pick_of_shards(x, *args)
    with fxtp.count_collectives() as bwd:
        (values.nan_to_num(0, 0, 0) * upstream).sum().backward()
    assert torch.equal(index, ref_index) and index.dtype == torch.long
    torch.testing.assert_close(values, ref_values.detach(), equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, local_part(full.grad, placement, rank, world),
                               rtol=0, atol=0)
    arg = (torch.argmax if largest else torch.argmin)(full.detach(), dim, keepdim)
    assert torch.equal(arg_of_shards(x.detach(), *args), arg)
    if dtype == torch.float64:  # integers: the candidates pack exactly too
        ints = (full.detach().nan_to_num(0, 0, 0) * 4).long()
        got = pick_of_shards(local_part(ints, placement, rank, world), *args)
        want = (torch.max if largest else torch.min)(ints, dim, keepdim)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    return dict(fwd.counts), dict(bwd.counts)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16],
                         ids=["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("name", list(PICKS))
def test_max_and_argmax_along_a_sharded_dim_match_torchs(ranks, name, dtype):
    """Exactly torch's values and indices (the first extreme, nan first) and the values'
    gradient on the holding rank: one all-gather of each rank's (value, index) pair per
    row forward, none backward."""
    assert ranks.run(pick_vs_full, name, dtype)[0] == ({"all_gather": 1}, {})


# name: (shape, placement, k, dim, largest); "ties", "nan" as above; "beyond": k exceeds
# some ranks' parts, which then offer fewer candidates
TOPKS = {
    "topk": ((6, 16), Shard(1), 3, -1, True),
    "topk_smallest_dim0": ((16, 3, 2), Shard(0), 5, 0, False),
    "topk_beyond": ((4, 16), Shard(1), 10, 1, True),
    "topk_uneven_empty_beyond": ((4, 5), UnitShard(1, 5), 3, 1, False),
    "topk_nan": ((6, 16), Shard(1), 4, 1, True),
    "topk_ties": ((6, 16), Shard(1), 6, 1, True),
}


def topk_vs_full(rank, world, name, dtype):
    """``topk`` along a sharded dim against torch's on the whole tensor: values, indices
    and the values' gradient (with ties, at the indices returned: torch's order of ties
    is unspecified)."""
    shape, placement, k, dim, largest = TOPKS[name]
    full = _whole(name, shape, dtype)
    if "nan" in name:
        with torch.no_grad():
            full[1, 3] = full[2, -2] = torch.nan
    ref_values, ref_index = torch.topk(full, k, dim, largest)
    x = local_part(full.detach(), placement, rank, world).clone().requires_grad_()
    offset = local_range(placement, shape[dim], rank, world)[0]
    args = (k, dim, largest, offset, shape[dim], world, dist.group.WORLD.group_name)
    with fxtp.count_collectives() as fwd:
        values, index = topk_of_shards(x, *args)
    torch.testing.assert_close(values, ref_values.detach(), equal_nan=True, rtol=0, atol=0)
    assert index.dtype == torch.long and \
        torch.equal(index.sort(dim).values.diff(dim=dim) > 0,
                    torch.ones_like(index.narrow(dim, 1, k - 1), dtype=torch.bool)) and \
        torch.equal(full.detach().gather(dim, index).nan_to_num(7), values.nan_to_num(7))
    if "ties" not in name and dtype != torch.bfloat16:  # bf16's rounding ties values too
        assert torch.equal(index, ref_index)
    upstream = torch.randn(values.shape, generator=torch.Generator().manual_seed(1),
                           dtype=torch.float64).to(dtype)
    with fxtp.count_collectives() as bwd:
        (values.nan_to_num(0, 0, 0) * upstream).sum().backward()
    want = torch.zeros(shape, dtype=dtype).scatter(dim, index, upstream * ~values.isnan())
    torch.testing.assert_close(x.grad, local_part(want, placement, rank, world), rtol=0, atol=0)
    if dtype == torch.float64:  # integers: the candidates pack exactly too
        ints = (full.detach().nan_to_num(0, 0, 0) * 4).long()
        got = topk_of_shards(local_part(ints, placement, rank, world), *args)
        assert torch.equal(got[0], torch.topk(ints, k, dim, largest).values)
    return dict(fwd.counts), dict(bwd.counts)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16],
                         ids=["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("name", list(TOPKS))
def test_topk_along_a_sharded_dim_matches_torchs(ranks, name, dtype):
    """Exactly torch's values (and indices, but among ties) and the values' gradient on
    the rank holding each: one all-gather of each rank's k candidates per row forward, none
    backward."""
    assert ranks.run(topk_vs_full, name, dtype)[0] == ({"all_gather": 1}, {})


# name: (shape, placement, dim, dtype argument); "bool": a mask counted (int64 result)
SCANS = {
    "cumsum": ((6, 16), Shard(1), -1, None),
    "cumsum_dim0": ((16, 3, 2), Shard(0), 0, None),
    "cumsum_uneven_empty": ((4, 5), UnitShard(1, 5), 1, None),
    "cumsum_dtype": ((6, 16), Shard(1), 1, torch.float64),
    "cumsum_bool": ((6, 16), Shard(1), 1, None),
}


def scan_vs_full(rank, world, name, dtype):
    """``cumsum`` along a sharded dim against torch's on the whole tensor, forward and the
    local gradient."""
    shape, placement, dim, out_dtype = SCANS[name]
    full = _whole(name, shape, dtype)
    if "bool" in name:
        full = (full > 0).detach()
    ref = torch.cumsum(full, dim, dtype=out_dtype)
    parts = [local_range(placement, shape[dim], r, world) for r in range(world)]
    start, length = parts[rank]
    before = [n > 0 and s + n <= start for s, n in parts]
    after = [n > 0 and s >= start + length for s, n in parts]
    x = local_part(full.detach(), placement, rank, world).clone()
    x.requires_grad_(x.is_floating_point())
    with fxtp.count_collectives() as fwd:
        out = cumsum_of_shards(x, dim, out_dtype, before, after, world,
                               dist.group.WORLD.group_name)
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out, local_part(ref.detach(), placement, rank, world),
                               **(TIGHT if dtype == torch.float64 else {}))
    if not x.requires_grad:
        return dict(fwd.counts), {}
    upstream = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1),
                           dtype=torch.float64).to(ref.dtype)
    (ref * upstream).sum().backward()
    with fxtp.count_collectives() as bwd:
        (out * local_part(upstream, placement, rank, world)).sum().backward()
    assert x.grad.dtype == x.dtype
    torch.testing.assert_close(x.grad, local_part(full.grad, placement, rank, world),
                               **(TIGHT if dtype == torch.float64 else {}))
    return dict(fwd.counts), dict(bwd.counts)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("name", list(SCANS))
def test_cumsum_along_a_sharded_dim_matches_torchs(ranks, name, dtype):
    """One all-gather of each rank's total per row forward (the offsets of the ranks after
    it), one of its gradient's sums backward; a mask's count has no gradient."""
    assert ranks.run(scan_vs_full, name, dtype)[0] == \
        ({"all_gather": 1}, {} if "bool" in name else {"all_gather": 1})


# name: (shape, placement, dims, keepdim); each row true somewhere on one rank only, true
# everywhere, or nowhere, so that any and all differ from each rank's own
LOGICAL = {
    "one_dim": ((6, 16), Shard(1), [1], False),
    "two_dims_keepdim": ((3, 8, 4), Shard(1), [0, 1], True),
    "uneven_empty": ((6, 5), UnitShard(1, 5), [1], False),
}


def logical_vs_full(rank, world, name):
    shape, placement, dims, keepdim = LOGICAL[name]
    full = torch.zeros(shape, dtype=torch.bool)
    full[0] = True  # all
    full[1, ..., -1] = True  # any, on the last rank's part only
    full.view(-1)[7::11] = True
    counts = []
    for every in (False, True):
        with fxtp.count_collectives() as fwd:
            got = any_of_shards(local_part(full, placement, rank, world), dims, keepdim, every,
                                dist.group.WORLD.group_name)
        want = (torch.all if every else torch.any)(full, dims, keepdim=keepdim)
        assert got.dtype == want.dtype and torch.equal(got, want)
        counts.append(dict(fwd.counts))
    return counts


@pytest.mark.parametrize("name", list(LOGICAL))
def test_any_and_all_over_a_sharded_dim_match_torchs(ranks, name):
    """One all-reduce each (max for any, min for all) of a byte per row."""
    assert ranks.run(logical_vs_full, name)[0] == [{"all_reduce": 1}] * 2


class FeatureStatistics(nn.Module):
    """Model code over a colwise shard's features: a running sum, a scale by the largest
    magnitude of the whole activation (as float8 recipes take it), and rows flagged by
    ``any`` / ``all``."""

    def __init__(self, dim=16, hidden=32):
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        h = self.up(x).cumsum(-1)
        keep = (h > 0).any(-1, keepdim=True) & (h < 3).all(-1, keepdim=True)
        return self.down(h / h.abs().max() * keep + h.min())


def statistics_parity(rank, world, dtype):
    return check_parity(rank, world, FeatureStatistics,
                        {"up": fxtp.ColwiseParallel(), "down": fxtp.RowwiseParallel()},
                        [torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))],
                        dtype=dtype, strict=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_scans_and_whole_reductions_of_a_colwise_shard_match_single_device(ranks, dtype):
    """Forward the cumulative sum's all-gather, one all-reduce each for ``max``, ``min``,
    ``any`` and ``all``, and the rowwise output's; backward the cumulative sum's
    all-gather, for ``max`` and ``min`` each the sum of their replicated result's gradient
    (read by every shard) and the ties' count, and the colwise input's gradient. Before,
    the features were gathered (strict mode: an error)."""
    assert ranks.run(statistics_parity, dtype)[0] == \
        ({"all_gather": 1, "all_reduce": 5}, {"all_gather": 1, "all_reduce": 5})


def test_explain_reports_the_scans_and_logical_reductions(fake_group):
    """Per row of 2 x 8 fp32 tokens: the cumulative sum gathers a total each way, ``any``
    and ``all`` reduce a byte, the whole ``max`` and ``min`` one value each way."""
    fake_group(2)
    gm = fxtp.parallelize(FeatureStatistics(), {"up": fxtp.ColwiseParallel(),
                                                "down": fxtp.RowwiseParallel()},
                          example_inputs=(torch.randn(2, 8, 16),), strict=True)
    kernels = [(n.op, [(c.kind, c.bytes) for c in n.forward],
                [(c.kind, c.bytes) for c in n.backward])
               for n in fxtp.explain(gm).nodes if n.collective == "sharded_softmax"]
    rows = 2 * 8
    assert kernels == [("fxtp.cumsum_of_shards", [("all_gather", rows * 4)],
                        [("all_gather", rows * 4)]),
                       *[("fxtp.any_of_shards", [("all_reduce", rows)], [])] * 2,
                       *[("fxtp.extremum_of_shards", [("all_reduce", 4)],
                          [("all_reduce", 4)])] * 2]


# --- losses on loss parallel's class-sharded logits ---------------------------------------

L = 2  # layers
TOKENS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
TARGETS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
PLAN = {"model.tok_embeddings": fxtp.RowwiseParallel(input_layouts=Replicate()),
        **{f"model.{k}": v for k, v in tm.llama_layer_plan().items()},
        "model.output": fxtp.ColwiseParallel(output_layouts=Shard(-1))}


class ZLossLM(nn.Module):
    """Next-token cross-entropy plus PaLM's z-loss, the squared log-normalizer of the
    logits (OLMo, PaLM, Chameleon train with it)."""

    def __init__(self):
        super().__init__()
        self.model = tm.Llama(tm.LlamaConfig(n_heads=8, n_kv_heads=4))

    def forward(self, tokens, targets):
        logits = self.model(tokens)
        z = torch.logsumexp(logits, dim=-1)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()) + \
            1e-2 * z.square().mean()


class DistilledLM(nn.Module):
    """A student distilled from a teacher's temperature-scaled distribution: KL divergence
    of log-softmaxes (the teacher here a fixed function of the student's detached logits,
    to stay one model)."""

    def __init__(self):
        super().__init__()
        self.model = tm.Llama(tm.LlamaConfig(n_heads=8, n_kv_heads=4))

    def forward(self, tokens, targets):
        logits = self.model(tokens) / 2.0
        teacher = torch.sin(logits.detach() * 3)
        return F.kl_div(F.log_softmax(logits, -1), F.log_softmax(teacher, -1),
                        reduction="batchmean", log_target=True)


class HandWrittenNLL(nn.Module):
    """Cross-entropy written as ``log_softmax`` then ``nll_loss``, some targets ignored."""

    def __init__(self):
        super().__init__()
        self.model = tm.Llama(tm.LlamaConfig(n_heads=8, n_kv_heads=4))

    def forward(self, tokens, targets):
        targets = targets.masked_fill(targets % 7 == 0, -100)
        return F.nll_loss(F.log_softmax(self.model(tokens), -1).flatten(0, 1),
                          targets.flatten())


class PolicyGradient(nn.Module):
    """Per-token log-probabilities of the sampled tokens, taken as RL and preference-tuning
    libraries take them (``log_softmax(logits).gather(-1, tokens)``), in a clipped
    importance-ratio objective against the detached log-probabilities."""

    def __init__(self):
        super().__init__()
        self.model = tm.Llama(tm.LlamaConfig(n_heads=8, n_kv_heads=4))

    def forward(self, tokens, targets):
        logprobs = self.model(tokens).log_softmax(-1).gather(-1, targets.unsqueeze(-1))
        ratio = (logprobs.squeeze(-1) - 0.9 * logprobs.squeeze(-1).detach()).exp()
        advantages = torch.linspace(-1, 1, targets.shape[-1])
        return -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages).mean()


class SelfTrained(nn.Module):
    """Self-training on the model's own most likely tokens (``argmax`` of the detached
    logits) with a penalty on the largest logit (``max(-1).values``)."""

    def __init__(self):
        super().__init__()
        self.model = tm.Llama(tm.LlamaConfig(n_heads=8, n_kv_heads=4))

    def forward(self, tokens, targets):
        logits = self.model(tokens)
        pseudo = logits.detach().argmax(-1)
        return F.cross_entropy(logits.flatten(0, 1), pseudo.flatten()) + \
            1e-2 * logits.max(-1).values.square().mean()


class TopKDistilled(nn.Module):
    """Distillation on the teacher's top-k classes only, as logit-caching distillation
    stores them (``topk`` of the teacher's logits, the student's log-probabilities
    gathered at those classes; the teacher here the detached logits, to stay one
    model)."""

    def __init__(self):
        super().__init__()
        self.model = tm.Llama(tm.LlamaConfig(n_heads=8, n_kv_heads=4))

    def forward(self, tokens, targets):
        logits = self.model(tokens)
        teacher, classes = (logits.detach() * 1.5).topk(4, -1)
        student = logits.log_softmax(-1).gather(-1, classes)
        return -(teacher.softmax(-1) * student).sum(-1).mean()


LOSSES = {"z_loss": ZLossLM, "distillation": DistilledLM, "nll": HandWrittenNLL,
          "policy_gradient": PolicyGradient, "self_trained": SelfTrained,
          "top_k_distilled": TopKDistilled}


def loss_parity(rank, world, loss, dtype):
    return check_parity(rank, world, LOSSES[loss], PLAN, [TOKENS, TARGETS], dtype=dtype,
                        input_grads=False, strict=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_a_z_loss_on_class_sharded_logits_matches_single_device(ranks, dtype):
    """Megatron's 2 all-reduces per layer and the embedding's, loss parallel's 3, and the
    log-sum-exp's 2 forward; backward Megatron's alone (the log-sum-exp's is local). Before,
    the logits were gathered for the z-loss (a fallback)."""
    assert ranks.run(loss_parity, "z_loss", dtype)[0] == \
        ({"all_reduce": 2 * L + 1 + 3 + 2}, {"all_reduce": 2 * L + 1})


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_a_distillation_loss_on_class_sharded_logits_matches_single_device(ranks, dtype):
    """Each log-softmax 2 all-reduces forward, the KL divergence's sum 1; backward the
    student's log-softmax 1 (the teacher's carries no gradient)."""
    assert ranks.run(loss_parity, "distillation", dtype)[0] == \
        ({"all_reduce": 2 * L + 1 + 2 + 2 + 1}, {"all_reduce": 2 * L + 1 + 1})


@pytest.mark.parametrize("loss", ["nll", "policy_gradient"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_target_log_probabilities_from_class_sharded_logits_match_single_device(ranks, loss,
                                                                                 dtype):
    """``nll_loss`` and ``gather`` of the targets' log-probabilities pick each token's on the
    rank holding its class, a partial sum: the log-softmax's 2 all-reduces and 1 for the
    picked values forward, the log-softmax's 1 backward. Before, the log-probabilities
    were gathered (a fallback)."""
    assert ranks.run(loss_parity, loss, dtype)[0] == \
        ({"all_reduce": 2 * L + 1 + 2 + 1}, {"all_reduce": 2 * L + 1 + 1})


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_argmax_and_max_of_class_sharded_logits_match_single_device(ranks, dtype):
    """The pseudo-labels' argmax and the largest logits' max each all-gather a (value,
    index) pair per token forward, besides loss parallel's 3; backward Megatron's alone
    (the max's gradient goes to the rank holding it). Before, the logits were gathered."""
    assert ranks.run(loss_parity, "self_trained", dtype)[0] == \
        ({"all_reduce": 2 * L + 1 + 3, "all_gather": 2}, {"all_reduce": 2 * L + 1})


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_top_k_distillation_on_class_sharded_logits_matches_single_device(ranks, dtype):
    """The teacher's top-k all-gathers k (value, index) pairs per token; the student's
    log-softmax 2 all-reduces and the gathered classes' partial sum 1 forward, the
    log-softmax's 1 backward. Before, the logits were gathered for the top-k."""
    assert ranks.run(loss_parity, "top_k_distilled", dtype)[0] == \
        ({"all_reduce": 2 * L + 1 + 2 + 1, "all_gather": 1}, {"all_reduce": 2 * L + 1 + 1})


def test_explain_reports_the_kernels_collectives(fake_group):
    """Per-token values in the sums' dtype (fp32): 2 forward each, 1 backward for the
    student's log-softmax, none for the detached teacher's."""
    fake_group(4)
    gm = fxtp.parallelize(DistilledLM(), PLAN, example_inputs=(TOKENS, TARGETS), strict=True)
    kernels = [n for n in fxtp.explain(gm).nodes if n.collective == "sharded_softmax"]
    per_token = TOKENS.numel() * 4
    assert [([c.bytes for c in n.forward], [c.bytes for c in n.backward]) for n in kernels] \
        == [([per_token] * 2, [per_token]), ([per_token] * 2, [])]
    assert [n.placement for n in kernels] == ["S(2)", "S(2)"]


def test_explain_reports_the_picks_all_gathers(fake_group):
    """A (value, index) pair per token, each 8 bytes, from every rank (k pairs for a
    top-k); nothing backward."""
    fake_group(4)
    gm = fxtp.parallelize(SelfTrained(), PLAN, example_inputs=(TOKENS, TARGETS), strict=True)
    kernels = [n for n in fxtp.explain(gm).nodes if n.collective == "sharded_softmax"]
    pair = ("all_gather", 2 * TOKENS.numel() * 8)
    assert [([(c.kind, c.bytes) for c in n.forward], n.backward) for n in kernels] == \
        [([pair], []), ([pair], [])]
    gm = fxtp.parallelize(TopKDistilled(), PLAN, example_inputs=(TOKENS, TARGETS),
                          strict=True)
    (topk,) = [n for n in fxtp.explain(gm).nodes if n.op == "fxtp.topk_of_shards"]
    assert [(c.kind, c.bytes) for c in topk.forward] == [("all_gather", 4 * 2 * TOKENS.numel()
                                                          * 8)] and topk.backward == []


class Probabilities(nn.Module):
    """A colwise projection's outputs as probabilities, scaled by a max, mixed back by a
    rowwise projection, plus a log-normalizer and a max with its index (each kernel on
    other values: inductor would merge all-reduces of the same row maxima)."""

    def __init__(self, dim=16, hidden=32):
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        h = self.up(x)
        p = h.softmax(-1) * (2 * h).amax(-1, keepdim=True)
        return self.down(p) + torch.logsumexp(h - 1, -1, keepdim=True) + \
            (h + 1).max(-1, keepdim=True).values


def checkpointed_stack(rank, world, checkpoint):
    return check_parity(rank, world, lambda: models.Layers(Probabilities, 2),
                        {"layers.*.up": fxtp.ColwiseParallel(),
                         "layers.*.down": fxtp.RowwiseParallel()},
                        [torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))],
                        dtype=torch.float64, strict=True,
                        checkpoint=["layers.*"] if checkpoint else [])


def test_checkpointed_blocks_issue_the_kernels_collectives_once(ranks2):
    """Recomputation in backward reuses the kernels' saved collective results (fxtp's
    selective policy): per block 6 all-reduces and 1 all-gather forward, 4 all-reduces
    backward, checkpointed or not."""
    counts = ({"all_reduce": 12, "all_gather": 2}, {"all_reduce": 8})
    assert ranks2.run(checkpointed_stack, False)[0] == counts
    assert ranks2.run(checkpointed_stack, True)[0] == counts


def compiled_probabilities(rank, world):
    return check_compiled(rank, world, Probabilities,
                          {"up": fxtp.ColwiseParallel(), "down": fxtp.RowwiseParallel()},
                          [torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))],
                          dtype=torch.float32, strict=True)


def test_the_kernels_compile_whole(ranks2):
    """Under ``torch.compile(fullgraph=True)`` the kernels' all-reduces are in inductor's
    code, at parity over 2 AdamW steps. Eager: softmax 2 + 1, amax 1 + 1, logsumexp 2 + 0,
    the rowwise output's 1 forward, the max's gradient sum and the colwise input's gradient
    backward; the max along a dim 1 all-gather + 0. Compiled, the same: AOT's partitioner
    moves the ties' count, which reads no gradient, into the forward."""
    counts = ranks2.run(compiled_probabilities)[0]
    assert counts["eager"] == ({"all_reduce": 6, "all_gather": 1}, {"all_reduce": 4})
    assert counts["compiled"] == ({"all_reduce": 7, "all_gather": 1}, {"all_reduce": 3})


class FiveClasses(nn.Module):
    """Five classes on four ranks (2, 2, 1 and none, as ``torch.chunk`` deals them): the
    targets' log-probabilities gathered, ``select`` and ``index_select`` of classes, and
    their mean."""

    def __init__(self, only_mean=False):
        super().__init__()
        self.body, self.classes = nn.Linear(16, 16), nn.Linear(16, 5)
        self.only_mean = only_mean

    def forward(self, x, targets):
        logp = self.classes(torch.relu(self.body(x))).log_softmax(-1)
        picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        if self.only_mean:  # no other pick keeps the empty rank's graph connected
            return logp.mean(-1)
        return picked + logp.select(-1, 4) + \
            logp.index_select(-1, torch.tensor([4, 0])).sum(-1) + logp.mean(-1)


def five_classes(rank, world, only_mean):
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([4, 0, 2, 4])
    return check_parity(rank, world, lambda: FiveClasses(only_mean),
                        {"classes": fxtp.ColwiseParallel()}, [x, targets],
                        dtype=torch.float64, input_grads=False, strict=True)


def test_a_rank_holding_no_class_still_runs_the_backward(ranks4):
    """The last rank holds none of the classes: it picks zeros that autograd still reaches
    from its (empty) logits, so it joins the backward's collectives (before, the other
    ranks waited for it until gloo timed out)."""
    fwd, bwd = ranks4.run(five_classes, False)[0]  # the partial sums added, reduced once
    assert fwd == {"all_reduce": 2 + 1} and bwd == {"all_reduce": 2}
    assert ranks4.run(five_classes, True)[0] == ({"all_reduce": 2 + 1}, {"all_reduce": 2})


def infinite_upstream(rank, world):
    """``max`` along a sharded dim and ``topk`` with an infinite upstream gradient: the
    rank holding each pick takes it, the others add nothing (not ``inf * 0 = nan``)."""
    full = _whole("picks", (6, 16), torch.float64)
    upstream = torch.full((6,), torch.inf, dtype=torch.float64)
    grads = []
    for pick in ("max", "topk"):
        x = local_part(full.detach(), Shard(1), rank, world).clone().requires_grad_()
        offset = local_range(Shard(1), 16, rank, world)[0]
        group = dist.group.WORLD.group_name
        if pick == "max":
            values = pick_of_shards(x, 1, False, True, offset, rank, world, group)[0]
            ref = full.max(1).values
        else:
            values = topk_of_shards(x, 2, 1, True, offset, 16, world, group)[0][:, 0]
            ref = full.topk(2, 1).values[:, 0]
        (values * upstream).sum().backward()
        whole = full.detach().clone().requires_grad_()
        ((whole.max(1).values if pick == "max" else whole.topk(2, 1).values[:, 0])
         * upstream).sum().backward()
        torch.testing.assert_close(values, ref.detach(), rtol=0, atol=0)
        torch.testing.assert_close(x.grad, local_part(whole.grad, Shard(1), rank, world),
                                   rtol=0, atol=0, equal_nan=True)
        grads.append(bool(x.grad.isnan().any()))
    return grads


def test_a_pick_held_elsewhere_adds_nothing_to_the_gradient(ranks):
    """Before, a rank not holding the pick scattered ``inf * 0``: nan where single device
    has 0."""
    assert ranks.run(infinite_upstream)[0] == [False, False]
