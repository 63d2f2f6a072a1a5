"""Grouped-query attention with fewer KV heads than ranks (2 KV heads at 4 ranks; one in
multi-query attention): each rank computes exactly the KV head its query heads use, as
Megatron and vLLM do, with no gather of k or v. The KV projections stay whole on every rank
(each rank slices its head's rows); their gradients, each rank's share, are summed in one
all-reduce per block (the block's bucket of replicated parameters' gradients), so a block
reads only its own parameters."""
import pytest
import torch
import torch.nn as nn

import fxtp
from fxtp.passes.modules import inline_program
from tests.helpers import corpus
from tests.helpers.corpus import L, TOKENS
from tests.helpers.harness import pool_of
from tests.helpers.parity import check_parity

# forward: Megatron's (no k / v gathers); backward: Megatron's plus each block's bucketed
# all-reduce of its KV weights' partial gradients
COUNTS = ({"all_reduce": 2 * L + 1, "all_gather": 1}, {"all_reduce": 3 * L + 1})


def hf_llama(kv_heads):
    return corpus._hf("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=kv_heads)


def gqa_parity(rank, world, kv_heads):
    return check_parity(rank, world, lambda: hf_llama(kv_heads), "auto", [TOKENS],
                        dtype=torch.float64, strict=True, input_grads=False,
                        kwargs={"use_cache": False}, output=lambda out: out.logits)


def test_two_kv_heads_at_four_ranks(ranks4):
    assert ranks4.run(gqa_parity, 2)[0] == COUNTS


def test_multi_query_attention(ranks):
    assert ranks.run(gqa_parity, 1)[0] == COUNTS


def rope_llama_parity(rank, world):
    make = lambda: corpus.RopeLlama("hf_rotate_half", n_kv_heads=2)  # noqa: E731
    return check_parity(rank, world, make, corpus.llama_tp_plan(), [TOKENS],
                        dtype=torch.float64, strict=True, input_grads=False)


def test_meta_style_repeat_kv(ranks4):
    """Meta's layout: (B, T, heads, head_dim) views, rotary embedding, ``repeat_kv``."""
    assert ranks4.run(rope_llama_parity)[0] == COUNTS


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_kv_weights_stay_whole_and_are_sliced_per_rank(fake_group, kv_heads):
    fake_group(4, rank=3)
    gm = fxtp.parallelize(hf_llama(kv_heads), "auto", example_inputs=(TOKENS,),
                          example_kwargs={"use_cache": False}, strict=True)
    assert gm.fxtp.param_placements["model.layers.0.self_attn.k_proj.weight"].is_replicate()
    assert gm.fxtp.param_placements["model.layers.0.self_attn.q_proj.weight"].is_shard(0)
    head_dim = 32 // 8
    start = 3 * kv_heads // 4 * head_dim  # rank 3's KV head: its rows of wk and wv
    rows = [n for n in inline_program(gm).nodes if n.target is torch.ops.aten.slice.Tensor and
            n.args[1:] == (0, start, start + head_dim)]
    assert len(rows) == 2 * L  # k and v, in every layer
    assert gm.fxtp.fallbacks == []
    assert list(gm.fxtp.held_whole) == [f"model.layers.{i}.self_attn.{p}_proj.weight"
                                        for i in range(L) for p in "kv"]
    assert all(f"its {kv_heads} heads are fewer than the 4 ranks" in why
               for why in gm.fxtp.held_whole.values())
    report = fxtp.explain(gm)
    kv_bytes = 32 // 8 * kv_heads * 32 * 4  # a whole k_proj weight, fp32
    assert [h.extra_bytes for h in report.summary.held_whole] == [kv_bytes * 3 // 4] * 2 * L
    assert "Held whole on every rank though the plan shards them" in str(report)


# A fused q / k / v projection with one KV head. Falcon-7B's layout slices q, k and v out
# of a view of the fused output by heads, and runs attention and MLP in parallel (one
# all-reduce a layer): it is computed part by part, q's rows sharded and k's and v's whole
# on every rank, its one KV head broadcast to each rank's query heads. Backward: per layer
# the block input's gradient, k's (each rank's query heads give it a partial sum) and the
# bucket of the whole KV rows' gradients are summed, and the q rows' gradient is gathered
# into the whole fused weight. GPT-BigCode splits an unsqueezed fused output
# (``c_attn(x).unsqueeze(1).split((E, d, d), 3)``) and reads k and v as one head: computed
# part by part alike, its attention and MLP in sequence (Megatron's 2 all-reduces a layer
# forward; backward 3 all-reduces and the gathers of the q rows' weight and bias
# gradients). Per family: config, model, attention and block prefixes with their
# projections, config overrides, and (forward, backward) collectives and reported gathers
# at 2 and 4 ranks alike.
MQA_FUSED = {
    "falcon": ("FalconConfig", "FalconForCausalLM", "transformer.h.*.self_attention.",
               ("query_key_value", "dense"), ("mlp.dense_h_to_4h", "mlp.dense_4h_to_h"),
               dict(multi_query=True, new_decoder_architecture=False, alibi=False),
               (({"all_reduce": L}, {"all_gather": L, "all_reduce": 3 * L}), 0)),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", "transformer.h.*.attn.",
                    ("c_attn", "c_proj"), ("mlp.c_fc", "mlp.c_proj"), dict(multi_query=True),
                    (({"all_reduce": 2 * L}, {"all_gather": 2 * L, "all_reduce": 3 * L}), 0)),
}


def mqa_model(family, **sizes):
    """The family's model with one KV head: hidden 32 and 4 heads, or ``sizes``."""
    import transformers
    config, model, *_, extra, _ = MQA_FUSED[family]
    cfg = getattr(transformers, config)(**{
        "vocab_size": corpus.VOCAB, "hidden_size": 32, "num_hidden_layers": L,
        "num_attention_heads": 4, "attention_dropout": 0.0, "hidden_dropout": 0.0,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 1,
        "eos_token_id": 2, **extra, **sizes})
    return getattr(transformers, model)(cfg)


def mqa_plan(family):
    """Colwise fused q / k / v and MLP up projection, rowwise output and down projection."""
    _, _, attn, (qkv, out), (up, down), *_ = MQA_FUSED[family]
    block = attn.rsplit(".", 2)[0] + "."
    return {attn + qkv: fxtp.ColwiseParallel(), attn + out: fxtp.RowwiseParallel(),
            block + up: fxtp.ColwiseParallel(), block + down: fxtp.RowwiseParallel()}


def mqa_fused_parity(rank, world, family):
    fallbacks = []
    counts = check_parity(rank, world, lambda: mqa_model(family), mqa_plan(family), [TOKENS],
                          dtype=torch.float64, input_grads=False,
                          kwargs={"use_cache": False}, output=lambda out: out.logits,
                          post=lambda gm: fallbacks.extend(gm.fxtp.fallbacks))
    return counts, len(fallbacks)


@pytest.mark.parametrize("family", sorted(MQA_FUSED))
def test_a_fused_projection_with_one_kv_head_trains_like_one_device(ranks, family):
    counts, reported = MQA_FUSED[family][-1]
    assert ranks.run(mqa_fused_parity, family)[0] == (counts, reported)


def falcon_7b_heads_parity(rank, world):
    return check_parity(rank, world,
                        lambda: mqa_model("falcon", hidden_size=284, num_attention_heads=71),
                        mqa_plan("falcon"), [TOKENS], dtype=torch.float64, strict=True,
                        input_grads=False, kwargs={"use_cache": False},
                        output=lambda out: out.logits)


def test_falcon_7bs_71_query_heads_are_dealt_whole_and_dense_takes_them_alike(ranks):
    """Falcon-7B's own head count, which no world size divides (hidden 284 here): q's rows
    dealt in whole heads (36 and 35 at 2 ranks), and ``dense`` (``x @ w.T``) takes its
    input features in the same deal, so the attention output is not gathered. Strict;
    backward, the dealt q rows' gradient joins the KV rows' bucket (no gather)."""
    assert ranks.run(falcon_7b_heads_parity)[0] == ({"all_reduce": L}, {"all_reduce": 3 * L})


class SplitMultiQuery(nn.Module):
    """Multi-query attention as transformers 5.25 writes Falcon's: the fused projection's
    output viewed by heads and split on the heads dim, ``[heads, 1, 1]`` (Falcon-7B's 71
    heads, of width 4)."""

    def __init__(self, heads=71, head_dim=4):
        super().__init__()
        self.heads, self.head_dim, dim = heads, head_dim, heads * head_dim
        self.query_key_value = nn.Linear(dim, dim + 2 * head_dim, bias=False)
        self.dense = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.query_key_value(x).view(b, t, -1, self.head_dim).split(
            [self.heads, 1, 1], dim=-2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        k, v = (z.expand(b, self.heads, t, self.head_dim) for z in (k, v))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(out.transpose(1, 2).reshape(b, t, -1))


def split_multi_query_parity(rank, world):
    x = torch.randn(2, 8, 284, generator=torch.Generator().manual_seed(3))
    return check_parity(rank, world, SplitMultiQuery,
                        {"query_key_value": fxtp.ColwiseParallel(),
                         "dense": fxtp.RowwiseParallel()}, [x], dtype=torch.float64,
                        strict=True, input_grads=False)


def test_a_fused_output_split_by_heads_is_computed_part_by_part_strictly(ranks):
    """The split's parts are runs of heads as slices are: q's rows dealt in whole heads, k's
    and v's whole on every rank, no gather. Forward the output's all-reduce; backward the
    bucket of the fused weight's partial gradients (the input needs none)."""
    assert ranks.run(split_multi_query_parity)[0] == ({"all_reduce": 1}, {"all_reduce": 1})


class GroupedFusedAttention(nn.Module):
    """Falcon's new decoder (40B / 180B): one fused projection holding, per KV group, its
    query heads, then its key and value head. ``two_views``: viewed by heads first and by
    groups after, as transformers 5.25 writes it; else by groups at once, as 5.24 did."""

    def __init__(self, two_views, kv_heads=2, heads=4, head_dim=8):
        super().__init__()
        self.two_views, self.kv_heads, self.heads, self.head_dim = \
            two_views, kv_heads, heads, head_dim
        self.query_key_value = nn.Linear(heads * head_dim,
                                         (heads + 2 * kv_heads) * head_dim, bias=False)
        self.dense = nn.Linear(heads * head_dim, heads * head_dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        fused = self.query_key_value(x)
        if self.two_views:
            fused = fused.view(b, t, -1, self.head_dim)
        grouped = fused.view(b, t, self.kv_heads, -1, self.head_dim)
        q = grouped[..., :-2, :].flatten(-3, -2).transpose(1, 2)
        k, v = (z.transpose(1, 2).repeat_interleave(self.heads // self.kv_heads, dim=1)
                for z in (grouped[..., -2, :], grouped[..., -1, :]))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(out.transpose(1, 2).reshape(b, t, -1))


def grouped_fused_parity(rank, world, two_views):
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(5))
    return check_parity(rank, world, lambda: GroupedFusedAttention(two_views),
                        {"query_key_value": fxtp.ColwiseParallel(),
                         "dense": fxtp.RowwiseParallel()}, [x], dtype=torch.float64,
                        strict=True, input_grads=False)


@pytest.mark.parametrize("two_views", [False, True], ids=["by_groups", "by_heads_then_groups"])
def test_kv_groups_fewer_than_ranks_are_each_computed_by_their_ranks_however_viewed(
        ranks4, two_views):
    """2 KV groups at 4 ranks: each group's rows are sliced from the whole fused weight and
    computed by the 2 ranks whose query heads it holds, no gather, whether the output is
    viewed by groups at once or by heads first. Forward the output's all-reduce; backward
    the bucket of the fused weight's partial gradients."""
    assert ranks4.run(grouped_fused_parity, two_views)[0] == \
        ({"all_reduce": 1}, {"all_reduce": 1})


def test_falcons_multi_query_projection_is_derived_column_wise_and_placed_strictly(
        fake_group):
    """Its fused q / k / v rows viewed by heads: the derived plan shards them as Megatron
    does, and the placed program keeps the fused weight whole (each part sliced from it)
    with no fallback."""
    fake_group(4)
    plan = fxtp.derive_plan(mqa_model("falcon"), example_inputs=(TOKENS,),
                            example_kwargs={"use_cache": False}, world_size=4)
    assert type(plan["transformer.h.*.self_attention.query_key_value"]) is \
        fxtp.ColwiseParallel
    gm = fxtp.parallelize(mqa_model("falcon"), plan, example_inputs=(TOKENS,),
                          example_kwargs={"use_cache": False}, strict=True)
    assert gm.fxtp.fallbacks == []
    fused = [f"transformer.h.{i}.self_attention.query_key_value.weight" for i in range(L)]
    assert all(gm.fxtp.param_placements[fqn].is_replicate() for fqn in fused)
    assert list(gm.fxtp.held_whole) == fused
    assert "its fused parts (32, 8, 8 features)" in gm.fxtp.held_whole[fused[0]]
    whole = 48 * 32 * 4  # (q 32 + k 8 + v 8 rows) x hidden 32, fp32, over its quarter
    assert plan.placed.held_whole == tuple((fqn, whole * 3 // 4) for fqn in fused)
    assert "every rank holds whole (gm.fxtp.held_whole says why): " \
        "transformer.h.*.self_attention.query_key_value.weight" in str(plan)


def test_gpt_bigcodes_unsqueezed_fused_projection_is_placed_strictly_and_held_whole(
        fake_group):
    """The parts of ``c_attn(x).unsqueeze(1).split(...)``: q's rows sharded by heads, the
    one KV head's whole on every rank (reported as held whole), no fallback in strict mode."""
    fake_group(4)
    gm = fxtp.parallelize(mqa_model("gpt_bigcode"), mqa_plan("gpt_bigcode"),
                          example_inputs=(TOKENS,), example_kwargs={"use_cache": False},
                          strict=True)
    assert list(gm.fxtp.held_whole) == [f"transformer.h.{i}.attn.c_attn.{p}"
                                        for i in range(L) for p in ("weight", "bias")]
    heads = {n.local_shape[1] for n in fxtp.explain(gm).nodes
             if n.op == "aten.scaled_dot_product_attention.default"}
    assert heads == {1}  # 4 query heads at 4 ranks


def test_at_starcoders_widths_k_and_v_are_gathered_and_the_weights_stay_sharded(fake_group):
    """StarCoder's widths (hidden 6144, 48 heads, one KV head of 128; 2 layers, meta
    device, 512 tokens): gathering k and v (forward, their gradients' shards backward)
    sends far less than holding ``c_attn`` whole and gathering its q rows' gradient, so
    the fused output stays in blocks (each rank its q heads and its rows of k and v) and
    attention runs on this rank's heads only, no fallback."""
    import transformers
    fake_group(4)
    config = transformers.GPTBigCodeConfig(n_embd=6144, n_head=48, n_layer=L, n_inner=24576,
                                           vocab_size=49152, multi_query=True)
    with torch.device("meta"):
        model = transformers.GPTBigCodeForCausalLM(config)
    gm = fxtp.parallelize(model, mqa_plan("gpt_bigcode"), device="meta",
                          example_inputs=(torch.zeros(1, 512, dtype=torch.long),),
                          example_kwargs={"use_cache": False}, strict=True)
    report = fxtp.explain(gm)
    assert gm.fxtp.held_whole == {}
    assert (report.summary.forward.counts, report.summary.backward.counts) == (
        {"all_gather": 2 * L, "all_reduce": 2 * L}, {"all_gather": 2 * L, "all_reduce": 2 * L})
    assert {n.local_shape[1] for n in report.nodes
            if n.op == "aten.scaled_dot_product_attention.default"} == {48 // 4}


class NanoMQA(nn.Module):
    """Multi-query attention as nanoGPT-style ports write it (bigcode's first StarCoder
    experiments): ``q | kv`` in one ``c_attn``, ``kv`` split again, the one KV head
    broadcast by ``matmul``."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.dim, self.heads, self.head_dim = dim, heads, dim // heads
        self.c_attn = nn.Linear(dim, dim + 2 * self.head_dim)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, _ = x.shape
        q, kv = self.c_attn(x).split((self.dim, 2 * self.head_dim), dim=2)
        k, v = kv.split(self.head_dim, dim=-1)
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        att = (q @ k.unsqueeze(1).transpose(-2, -1)) / self.head_dim ** 0.5
        return self.c_proj((att.softmax(-1) @ v.unsqueeze(1)).transpose(1, 2).reshape(b, t, -1))


def nano_mqa_parity(rank, world):
    return check_parity(rank, world, NanoMQA, {"c_attn": fxtp.ColwiseParallel(),
                                               "c_proj": fxtp.RowwiseParallel()},
                        [torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0))],
                        dtype=torch.float64, strict=True)


def test_a_kv_part_split_again_and_broadcast_by_matmul_is_one_head_whole_on_every_rank(ranks):
    """q's rows sharded by heads, ``kv``'s whole (it is not viewed by heads, and q is):
    each rank's query heads read the one KV head through ``matmul``'s broadcast. Forward
    Megatron's one all-reduce; backward the input's gradient and the KV rows' (each rank's
    query heads' share) summed, and the q rows' weight and bias gradients gathered."""
    assert ranks.run(nano_mqa_parity)[0] == (
        {"all_reduce": 1}, {"all_reduce": 2, "all_gather": 2})


class GQAttention(nn.Module):
    """q, k and v projected apart, KV heads left to SDPA's ``enable_gqa`` (no repeat)."""

    def __init__(self, kv_heads, heads=8, dim=32):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, kv_heads * self.head_dim)
        self.v = nn.Linear(dim, kv_heads * self.head_dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, -1).transpose(1, 2)
        k = self.k(x).view(b, s, self.kv_heads, -1).transpose(1, 2)
        v = self.v(x).view(b, s, self.kv_heads, -1).transpose(1, 2)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                             enable_gqa=True)
        return x + self.o(a.transpose(1, 2).reshape(b, s, -1))


def enable_gqa_parity(rank, world, kv_heads):
    plan = {"q": fxtp.ColwiseParallel(), "k": fxtp.ColwiseParallel(),
            "v": fxtp.ColwiseParallel(), "o": fxtp.RowwiseParallel()}
    return check_parity(rank, world, lambda: GQAttention(kv_heads), plan,
                        [torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(0))],
                        dtype=torch.float64, strict=True)


@pytest.mark.parametrize("world, kv_heads", [(2, 1), (4, 1), (4, 2)])
def test_sdpa_reads_kv_heads_dealt_to_groups_of_ranks(pools, world, kv_heads):
    """SDPA's ``enable_gqa`` with fewer KV heads than ranks: query heads sharded, each
    rank's KV head computed by its group (no gather); forward the output projection's
    all-reduce, backward the input gradient's and the KV weights' partial gradients'."""
    counts = pool_of(pools, world).run(enable_gqa_parity, kv_heads)[0]
    assert counts == ({"all_reduce": 1}, {"all_reduce": 2})
