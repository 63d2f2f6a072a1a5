"""Vector norms over a sharded dim: every rank's powers summed by one all-reduce, never a
gather of the tensor.

The kernel against ``torch.linalg.vector_norm`` of the whole tensor (every order it takes,
even, uneven and strided shards, several reduced dims, ``keepdim``, ``dtype``, complex
values, zero vectors), forward and the local gradient; then model code: ``F.normalize``
over a colwise layer's features, at parity with single device and Megatron's collectives
plus the norm's one all-reduce; and LayerNorm / RMSNorm over all heads on head shards,
taken as their means' partial sums.
"""
import math

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
from fxtp.kernels.sharded_norm import layer_norm_of_shards, norm_of_shards
from tests.helpers.compiled import check_compiled
from tests.helpers.parity import TIGHT, check_parity, example, local_part

# name: (shape, reduced dims, order, keepdim, dtype argument, placement of the input)
CASES = {
    "rows_l2": ((6, 16), [1], 2, False, None, Shard(1)),
    "rows_l1": ((6, 16), [1], 1, False, None, Shard(1)),
    "rows_l3": ((6, 16), [1], 3, True, None, Shard(1)),
    "rows_half": ((6, 16), [1], 0.5, False, None, Shard(1)),
    "two_dims": ((3, 8, 12), [1, 2], 2, True, None, Shard(2)),
    "all_dims": ((8, 4), [], 2, False, None, Shard(0)),
    "negative_dim": ((5, 16), [-1], 2, False, None, Shard(1)),
    "uneven": ((4, 10), [1], 2, False, None, UnitShard(1, 10)),
    "strided": ((4, 16), [1], 2, False, None, _StridedShard(1, split_factor=2)),
    "upcast": ((6, 16), [1], 2, False, torch.float64, Shard(1)),
    "complex": ((6, 16), [1], 2, False, None, Shard(1)),
}


def _full(name):
    shape, _, _, _, dtype, _ = CASES[name]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    if name == "complex":
        x = torch.complex(x, torch.randn(shape, generator=gen, dtype=torch.float64))
    if dtype is not None:
        x = x.float()
    x[0] = 0  # a zero vector: no gradient through its norm, as torch's own backward
    return x


def norm_vs_full(rank, world, name):
    shape, dims, order, keepdim, dtype, placement = CASES[name]
    full = _full(name).requires_grad_()
    ref = torch.linalg.vector_norm(full, order, dims or None, keepdim, dtype=dtype)
    upstream = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1),
                           dtype=ref.dtype)
    (ref * upstream).sum().backward()
    x = local_part(full.detach(), placement, rank, world).clone().requires_grad_()
    with fxtp.count_collectives() as fwd:
        norm = norm_of_shards(x, order, dims or list(range(x.dim())), keepdim, dtype,
                              dist.group.WORLD.group_name)
    with fxtp.count_collectives() as bwd:
        (norm * upstream).sum().backward()
    torch.testing.assert_close(norm, ref.detach(), **TIGHT)
    assert norm.dtype == ref.dtype and x.grad.dtype == x.dtype
    expected = local_part(full.grad, placement, rank, world)
    assert not expected.isnan().any()
    torch.testing.assert_close(x.grad, expected, **TIGHT)
    return dict(fwd.counts), dict(bwd.counts)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_the_norm_of_the_whole_tensor(ranks, name):
    """One all-reduce of the norm's size forward, none backward."""
    assert ranks.run(norm_vs_full, name)[0] == ({"all_reduce": 1}, {})


# name: (shape, normalized dims k, placement, affine, offset added to the input)
LAYER_NORMS = {
    "last_dim": ((6, 16), 1, Shard(1), True, 0.0),
    "two_dims": ((3, 4, 8), 2, Shard(1), True, 0.0),
    "two_dims_inner": ((3, 4, 8), 2, Shard(2), True, 0.0),
    "no_affine": ((6, 16), 1, Shard(1), False, 0.0),
    "uneven": ((4, 10), 1, UnitShard(1, 10), True, 0.0),
    "uneven_empty": ((4, 5), 1, UnitShard(1, 5), True, 0.0),
    "large_mean": ((6, 16), 1, Shard(1), True, 1e4),
}


def layer_norm_vs_full(rank, world, name, dtype):
    shape, k, placement, affine, offset = LAYER_NORMS[name]
    gen = torch.Generator().manual_seed(0)
    full = (torch.randn(shape, generator=gen, dtype=torch.float64) + offset).to(dtype)
    full.requires_grad_()
    normalized = shape[-k:]
    weight = (torch.rand(normalized, generator=gen, dtype=torch.float64) + 0.5).to(dtype) \
        .requires_grad_() if affine else None
    bias = torch.randn(normalized, generator=gen, dtype=torch.float64).to(dtype) \
        .requires_grad_() if affine else None
    upstream = torch.randn(shape, generator=torch.Generator().manual_seed(1),
                           dtype=torch.float64).to(dtype)
    close = TIGHT if dtype == torch.float64 else \
        dict(rtol=1.6e-2, atol=2e-2) if dtype == torch.bfloat16 else {}
    if offset:  # rounding |x| costs eps * offset in any kernel: against the exact result
        full, weight, bias, upstream = (t.detach().double().requires_grad_(t.requires_grad)
                                        for t in (full, weight, bias, upstream))
        close = dict(rtol=0, atol=8 * torch.finfo(dtype).eps * offset)
    ref = F.layer_norm(full, normalized, weight, bias, 1e-5)
    (ref * upstream).sum().backward()
    d = placement.dim
    param_placement = Shard(d - (len(shape) - k)) if type(placement) is Shard else \
        UnitShard(d - (len(shape) - k), placement.units)
    x = local_part(full.detach(), placement, rank, world).to(dtype).requires_grad_()
    w, b = (local_part(t.detach(), param_placement, rank, world).to(dtype).requires_grad_()
            if t is not None else None for t in (weight, bias))
    rows = math.prod(normalized) // shape[d]
    counts = tuple(rows * local_range(placement, shape[d], r, world)[1] for r in range(world))
    with fxtp.count_collectives() as fwd:
        out = layer_norm_of_shards(x, k, w, b, 1e-5, counts, dist.group.WORLD.group_name)
    with fxtp.count_collectives() as bwd:
        (out * local_part(upstream, placement, rank, world).to(dtype)).sum().backward()
    assert out.dtype == dtype and x.grad.dtype == dtype

    def check(got, whole, p):
        torch.testing.assert_close(got, local_part(whole, p, rank, world).to(dtype), **close)
    check(out, ref.detach(), placement)
    check(x.grad, full.grad, placement)
    for mine, whole in ((w, weight), (b, bias)):
        if whole is not None:
            check(mine.grad, whole.grad, param_placement)
    return dict(fwd.counts), dict(bwd.counts)


@pytest.mark.parametrize("name,dtype", [
    (name, dtype) for name in LAYER_NORMS
    for dtype in (torch.float64, torch.float32, torch.bfloat16)
    if not (name == "large_mean" and dtype == torch.bfloat16)],  # bf16 cannot hold x there
    ids=lambda v: v if isinstance(v, str) else str(v).removeprefix("torch."))
def test_layer_norm_kernel_matches_the_whole_tensors(ranks, name, dtype):
    """Output and the gradients of the input, weight and bias, against ``F.layer_norm`` on
    the whole tensor: one all-gather of each rank's mean and sum of squared deviations
    forward (exact for a large mean: no cancellation), one all-reduce backward."""
    assert ranks.run(layer_norm_vs_full, name, dtype)[0] == \
        ({"all_gather": 1}, {"all_reduce": 1})


class CosineFeatures(nn.Module):
    """A colwise projection normalized over its (sharded) features, scaled, then a
    rowwise projection: nGPT-style unit-norm hidden states."""

    def __init__(self, dim=16, hidden=32):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.scale = nn.Parameter(torch.linspace(0.5, 2.0, hidden))
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down(F.normalize(self.up(x), dim=-1) * self.scale)


PLAN = {"up": fxtp.ColwiseParallel(), "down": fxtp.RowwiseParallel()}


def cosine_parity(rank, world, dtype):
    return check_parity(rank, world, CosineFeatures, PLAN, [example(2, 8, 16)], dtype=dtype,
                        strict=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_normalizing_sharded_features_matches_single_device(ranks, dtype):
    """Forward: the norm's all-reduce and the rowwise output's. Backward: the colwise
    input's gradient, and the norm's, which each rank's features give a part of (the
    norm's own backward is local)."""
    assert ranks.run(cosine_parity, dtype)[0] == ({"all_reduce": 2}, {"all_reduce": 2})


def test_the_norm_is_computed_where_the_features_are_sharded(fake_group):
    fake_group(4)
    gm = fxtp.parallelize(CosineFeatures(), PLAN, example_inputs=(example(2, 8, 16),),
                          strict=True)
    report = fxtp.explain(gm)
    norms = [n for n in report.nodes if n.collective == "sharded_norm"]
    assert [(n.placement, [c.kind for c in n.forward]) for n in norms] == \
        [("R", ["all_reduce"])]
    assert gm.fxtp.param_placements["scale"] == Shard(0)
    assert gm.fxtp.param_placements["down.bias"] == Replicate()


def compiled_cosine(rank, world):
    return check_compiled(rank, world, CosineFeatures, PLAN, [example(2, 8, 16)],
                          dtype=torch.float32)


def test_the_norm_compiles_whole(ranks2):
    """Under ``torch.compile(fullgraph=True)`` the kernel's all-reduce is in inductor's
    code: the same collectives as eager, at parity over 2 AdamW steps."""
    counts = ranks2.run(compiled_cosine)[0]
    assert counts["eager"] == counts["compiled"] == ({"all_reduce": 2}, {"all_reduce": 2})


class NormedHeads(nn.Module):
    """Attention whose q and k are normalized over all heads before they are split into
    heads (ESM-C's ``nn.LayerNorm`` q / k norms, OLMo-core's ``nn.RMSNorm``): under
    Megatron's plan the norms read the colwise projections' head shards."""

    def __init__(self, norm, dim=16, heads=4):
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.q_norm, self.k_norm = norm(dim), norm(dim)
        with torch.no_grad():  # weights (and biases) away from their init, to be seen
            for p in [*self.q_norm.parameters(), *self.k_norm.parameters()]:
                p.copy_(torch.linspace(0.5, 1.5, dim))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k = self.q_norm(self.wq(x)), self.k_norm(self.wk(x))
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in (q, k, self.wv(x)))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, d))


HEADS_PLAN = {"w[qkv]": fxtp.ColwiseParallel(), "wo": fxtp.RowwiseParallel()}
NORMS = {"layer_norm": nn.LayerNorm, "rms_norm": nn.RMSNorm}


def normed_heads(rank, world, norm, dtype):
    kind = {**NORMS, "hand_written": HandWrittenLayerNorm}[norm]
    return check_parity(rank, world, lambda: NormedHeads(kind), HEADS_PLAN,
                        [example(2, 8, 16)], dtype=dtype, strict=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("norm", list(NORMS))
def test_a_norm_over_all_heads_on_head_shards_matches_single_device(ranks, norm, dtype):
    """One collective per norm each way, for q and for k: LayerNorm's kernel all-gathers
    each rank's mean and sum of squared deviations per token forward and all-reduces two
    row sums of the gradient backward; RMSNorm, taken as its mean square, all-reduces each
    rank's partial sum each way. Before, the heads were gathered for them (a fallback),
    then LayerNorm took 2 all-reduces each way. Plus Megatron's: the rowwise output
    forward, the colwise input's gradient backward."""
    forward = {"layer_norm": {"all_gather": 2, "all_reduce": 1},
               "rms_norm": {"all_reduce": 3}}[norm]
    assert ranks.run(normed_heads, norm, dtype)[0] == (forward, {"all_reduce": 3})


def test_the_norms_weights_are_held_as_the_heads_are(fake_group):
    """Read only on head shards, each rank holds the weights' and biases' part for its
    heads: no gradient of theirs to sum. ``explain`` reports each kernel's collectives."""
    fake_group(4)
    gm = fxtp.parallelize(NormedHeads(nn.LayerNorm), HEADS_PLAN,
                          example_inputs=(example(2, 8, 16),), strict=True)
    assert not gm.fxtp.fallbacks
    assert {name: p for name, p in gm.fxtp.param_placements.items() if "norm" in name} == \
        {f"{n}_norm.{p}": Shard(0) for n in "qk" for p in ("weight", "bias")}
    kernels = [n for n in fxtp.explain(gm).nodes if n.collective == "sharded_norm"]
    per_token = 2 * 2 * 8 * 4  # two fp32 statistics for each of 2 x 8 tokens
    assert [([(c.kind, c.bytes) for c in n.forward], [(c.kind, c.bytes) for c in n.backward])
            for n in kernels] == [([("all_gather", per_token)], [("all_reduce", per_token)])] * 2


class HeadsNormedTogether(nn.Module):
    """``nn.LayerNorm((heads, head_dim))`` over the heads of a colwise projection: the
    kernel normalizes over two dims."""

    def __init__(self):
        super().__init__()
        self.wq, self.wo = nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False)
        self.norm = nn.LayerNorm((4, 4))

    def forward(self, x):
        b, t, _ = x.shape
        return self.wo(self.norm(self.wq(x).view(b, t, 4, 4)).reshape(b, t, 16))


def test_explain_counts_a_norm_over_two_dims_per_token(fake_group):
    """Two fp32 statistics per token, whatever the number of normalized dims."""
    fake_group(4)
    gm = fxtp.parallelize(HeadsNormedTogether(), {"wq": fxtp.ColwiseParallel(),
                                                  "wo": fxtp.RowwiseParallel()},
                          example_inputs=(example(2, 8, 16),), strict=True)
    (kernel,) = [n for n in fxtp.explain(gm).nodes if n.collective == "sharded_norm"]
    per_token = 2 * 2 * 8 * 4
    assert ([(c.kind, c.bytes) for c in kernel.forward],
            [(c.kind, c.bytes) for c in kernel.backward]) == \
        ([("all_gather", per_token)], [("all_reduce", per_token)])


class HandWrittenLayerNorm(nn.Module):
    """A LayerNorm as older model code writes it: ``var`` (and ``std``) by hand."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True, unbiased=False)
        spread = x.std(-1, keepdim=True)  # unbiased, as torch's default
        return (x - mean) / torch.sqrt(var + 1e-5) * self.weight + self.bias + 0.1 * spread


def test_a_variance_written_by_hand_over_head_shards_matches_single_device(ranks2):
    """``var`` and ``std`` over the sharded dim are their means' partial sums as well.
    Forward, for q and for k: the three means (the hand-written one, ``var``'s and
    ``std``'s) computed whole from the input gathered once (1 all-gather of a few bytes
    where 3 all-reduces would start), the two sums of squared deviations all-reduced (2);
    and the rowwise output (1). Backward, each of the 5 statistics' gradients per norm and
    the colwise input's."""
    counts = ranks2.run(normed_heads, "hand_written", torch.float64)[0]
    assert counts == ({"all_gather": 2, "all_reduce": 1 + 2 * 2}, {"all_reduce": 1 + 2 * 5})


@pytest.mark.parametrize("op", ["var", "std", "var_mean", "std_mean", "layer_norm",
                                "rms_norm"])
def test_each_decomposition_is_its_op(op):
    """What replaces a norm over a sharded dim computes what the op does, over the dim
    arguments and corrections model code passes (fp64, rounding only)."""
    from fxtp.passes import decompose
    x = example(3, 4, 6).double()
    w, b = example(6, seed=2).double(), example(6, seed=3).double()
    calls = {
        "var": [((x, -1), {}), ((x, [1, 2]), dict(correction=0, keepdim=True)), ((x,), {}),
                ((x, 1, False, True), {})],
        "std": [((x, -1), {}), ((x, [0, 2]), dict(correction=2)), ((x, 2, True), {})],
        "var_mean": [((x, -1), dict(keepdim=True)), ((x, [1]), dict(correction=0))],
        "std_mean": [((x, None), {}), ((x, [2]), dict(correction=0, keepdim=True))],
        "layer_norm": [((x, [6], w, b, 1e-5), {}), ((x, [4, 6]), {}), ((x, [6], w), {})],
        "rms_norm": [((x, [6], w, 1e-6), {}), ((x, [4, 6]), {})],
    }[op]
    overloads = {"var": [torch.ops.aten.var.correction, torch.ops.aten.var.dim],
                 "std": [torch.ops.aten.std.correction, torch.ops.aten.std.dim],
                 "var_mean": [torch.ops.aten.var_mean.correction],
                 "std_mean": [torch.ops.aten.std_mean.correction],
                 "layer_norm": [torch.ops.aten.layer_norm.default],
                 "rms_norm": [torch.ops.aten.rms_norm.default]}[op]
    for args, kwargs in calls:
        # positional unbiased / keepdim are the .dim overload's; keywords the other's
        target = overloads[-1] if len(args) > 2 and isinstance(args[2], bool) else overloads[0]
        function, _ = decompose._NORMS[target]
        torch.testing.assert_close(function(*args, **kwargs), target(*args, **kwargs),
                                   **TIGHT, msg=lambda m: f"{target}{args[1:]} {kwargs}: {m}")
