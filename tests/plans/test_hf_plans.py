"""Hugging Face plans: ``plan="auto"`` takes the model's own tensor-parallel plan, and plan
dicts may use Hugging Face's plan strings, mixed with style objects. Parity, zero fallbacks
and Megatron's counts, as under the hand-written plans of ``tests/model_code/test_corpus.py``."""
import pytest
import torch

import fxtp
from fxtp.plans.huggingface import NO_STYLE, STYLES, model_plan
from tests.helpers import corpus
from tests.helpers.corpus import L, TOKENS
from tests.helpers.harness import pool_of
from tests.helpers.parity import check_parity

transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]'")
MEGATRON_TP = ({"all_reduce": 2 * L + 1, "all_gather": 1}, {"all_reduce": 2 * L + 1})


def hf_parity(rank, world, make, plan, dtype=torch.float64):
    return check_parity(rank, world, make, plan, [TOKENS], dtype=dtype, strict=True,
                        input_grads=False, kwargs={"use_cache": False},
                        output=lambda out: out.logits,
                        compare_dtype=torch.float32 if make in FP32_INSIDE else None)


# models whose norms compute in fp32 whatever the model's dtype: where fxtp sums the ranks'
# parts of a norm's mean square, they round as fp32 sums in another order do
FP32_INSIDE = {corpus.hf_olmo2}


MEGATRON_PLUS = lambda fwd_gathers, bwd: ({"all_reduce": 2 * L + 1, "all_gather": fwd_gathers},  # noqa: E731
                                          bwd)
AUTO = {
    # Megatron: q, k, v, gate, up colwise; o, down rowwise; a vocab-parallel embedding;
    # the head colwise with its logits gathered
    "hf_llama": MEGATRON_TP,
    "hf_qwen2": MEGATRON_TP,
    "hf_mistral": MEGATRON_TP,
    "hf_granite": MEGATRON_TP,
    # tied: the plan names only lm_head; the embedding follows the tie (vocab-parallel)
    "hf_gemma2_tied": MEGATRON_TP,
    "hf_starcoder2": MEGATRON_TP,
    # q_norm / k_norm weights (per head, replicated) used on head shards: their gradients
    # are partial, one bucketed all-reduce per block (Hugging Face's
    # replicated_with_grad_allreduce)
    "hf_qwen3": (MEGATRON_TP[0], {"all_reduce": 2 * L + 1 + L}),
    # parallel block: one norm output feeds attention and MLP, one backward all-reduce per
    # layer for it; forward, the attention's and the MLP's partial outputs are summed with
    # the residual and reduced once per layer (its norms cast to fp32, narrower than this
    # fp64 model: the sum is reduced before; in an fp32 model the final norm would read it
    # partial, which sends more at these sizes: tests/model_code/test_corpus.py)
    "hf_cohere_tied": ({"all_reduce": L + 1, "all_gather": 1}, {"all_reduce": L + 1}),
    # parallel residual: the attention's and the MLP's partial outputs are summed with the
    # residual and reduced once per layer. transformers 5.24's plan splits embed_in by rows
    # as the others do; before, it left embed_in out (replicated): no all-reduce for it
    "hf_gpt_neox": ({"all_reduce": L + 1, "all_gather": 1}, MEGATRON_TP[1])
    if "embed_in" in transformers.GPTNeoXConfig.base_model_tp_plan
    else ({"all_reduce": L, "all_gather": 1}, {"all_reduce": 2 * L + 1}),
    # the plans Hugging Face ships for these gather colwise outputs (colwise_gather_output)
    # and split them again for the rowwise layer (rowwise_split_input): 2 gathers per layer
    # forward and 2 backward (Phi-3's fused qkv and gate_up) or 3 and 1 (OLMo-2's q, k, v),
    # which fxtp leaves out, computing on the shards: Phi-3's splits strided, Megatron's
    # collectives; OLMo-2's norms over all heads summing each rank's part of the mean
    # square, one all-reduce of a value per token for each, forward and backward
    "hf_phi3": MEGATRON_TP,
    "hf_olmo2": ({"all_reduce": 2 * L + 1 + 2 * L, "all_gather": 1},
                 {"all_reduce": 2 * L + 1 + 2 * L}),
}


# every family at world 2; at world 4 those whose plans differ most (to keep the time)
WORLDS = [(2, name) for name in AUTO] + \
    [(4, name) for name in ("hf_llama", "hf_qwen3", "hf_phi3", "hf_olmo2", "hf_cohere_tied")]


@pytest.mark.parametrize("world,name", WORLDS, ids=[f"world{w}-{n}" for w, n in WORLDS])
def test_auto_uses_the_models_own_plan(pools, world, name):
    """Each family under the plan it carries: parity in fp64 (forward, every gradient, 3
    AdamW steps), no fallback (strict) and the collectives that plan implies."""
    assert pool_of(pools, world).run(hf_parity, getattr(corpus, name), "auto")[0] == AUTO[name]


def test_auto_on_gemma3_shards_its_per_head_norms_inputs(ranks2):
    """Gemma-3's q_norm / k_norm act on head shards, in fp32 whatever the model's dtype (so
    the ranks' partial gradient sums round as fp32 does: compared in fp32): Megatron's
    forward, and one bucketed all-reduce per block for the norms' partial gradients."""
    assert ranks2.run(hf_parity, corpus.hf_gemma3, "auto", torch.float32)[0] == \
        (MEGATRON_TP[0], {"all_reduce": 2 * L + 1 + L})


MOE = {
    # experts sharded on their intermediate dim (ExpertTensorParallel): one more forward
    # all-reduce per layer for the experts' partial sums, and one more backward all-reduce
    # per layer for the routing weights' partial gradients (Hugging Face's
    # _AllReduceBackward on top_k_weights)
    "hf_mixtral": ({"all_reduce": 2 * L + 1, "all_gather": 1}, {"all_reduce": 3 * L + 1}),
    # and per head q_norm / k_norm, as Qwen3
    "hf_qwen3_moe": ({"all_reduce": 2 * L + 1, "all_gather": 1}, {"all_reduce": 4 * L + 1}),
    # a shared expert, rowwise too: three forward all-reduces per layer; the router scales
    # the inputs, so no routing weight multiplies a partial sum
    "hf_llama4": ({"all_reduce": 3 * L + 1, "all_gather": 1}, {"all_reduce": 3 * L + 1}),
}
MOE_WORLDS = [(2, name) for name in MOE] + [(4, "hf_mixtral")]


@pytest.mark.parametrize("world,name", MOE_WORLDS, ids=[f"world{w}-{n}" for w, n in MOE_WORLDS])
def test_auto_shards_every_expert_of_a_mixture_of_experts(pools, world, name):
    """'moe_tp_experts' is ExpertTensorParallel: each expert's input projection colwise (the
    fused gate and up in blocks), its output projection rowwise. Parity in fp32 (the grouped
    matmul has no fp64 kernel), no fallback (strict, which also shows the plan's keys for
    absent variants, Qwen3-MoE's dense MLPs, are skipped) and the counts above."""
    assert pool_of(pools, world).run(hf_parity, getattr(corpus, name), "auto",
                                     torch.float32)[0] == MOE[name]


def test_auto_on_phimoe_runs_its_routers_own_backward(ranks2):
    """PhiMoE in training: the sampled routing draws the same numbers as on one device, and
    the router's straight-through ``autograd.Function`` runs its own backward on the
    replicated router scores (traced into its forward, the gradients of the second step
    were wrong). Parity in fp64, no fallback. Forward, the vocab-parallel embedding's
    all-reduce, the experts' partial sums (one a layer) and the logits' gather; backward,
    per layer the experts' input gradient and the routing weights' partial gradient, and
    the head's input gradient. Since transformers 5.25 its plan shards attention too: one
    more all-reduce a layer each way."""
    attention = L if corpus.shards_attention(corpus.hf_phimoe()) else 0
    assert ranks2.run(hf_parity, corpus.hf_phimoe, "auto")[0] == \
        ({"all_reduce": L + 1 + attention, "all_gather": 1},
         {"all_reduce": 2 * L + 1 + attention})


def test_auto_on_deepseek_v2s_latent_attention_and_experts(ranks2):
    """DeepSeek-V2: MLA (the plan keeps ``kv_a_proj_with_mqa`` whole, "mla_kv_a_proj",
    whose rotary key every head shares; the per-head key is a fresh tensor filled by slice
    assignment, made head-sharded) and a mixture of experts after a dense first layer.
    Forward: the embedding, each layer's o_proj, the dense MLP, the experts' and the shared
    experts' partial sums, the gathered logits. Backward: per layer the q and kv latents'
    partial gradients (two norms apart) and the rotary key's (expanded straight to this
    rank's heads, so each rank sums its heads' gradients: an all-reduce at the key's size,
    not a gather at the heads'); the dense MLP's input, the MoE layer's experts, shared
    experts and routing weights; the head's input."""
    assert ranks2.run(hf_parity, corpus.hf_deepseek_v2, "auto", torch.float32)[0] == \
        ({"all_reduce": 2 * L + 2, "all_gather": 1}, {"all_reduce": 3 * L + 1 + 3 + 1})


GPT_OSS_PLAN = {"model.embed_tokens": "embedding_rowwise",
                "model.layers.*.self_attn.[qkv]_proj": "colwise",
                "model.layers.*.self_attn.o_proj": "rowwise",
                "model.layers.*.mlp.experts": "moe_tp_experts",
                "lm_head": "colwise_gather_output"}


def test_interleaved_experts_with_biases_under_a_plan_dict(ranks2):
    """gpt-oss (no plan of its own): the interleaved gate and up slices keep the experts'
    shards (each rank's shard starts at an even column), the down bias added in place to
    the experts' partial sums is added once they are reduced. The attention sinks (one per
    head, left out of the plan, read only on head shards) are held as this rank's heads:
    their gradient needs no collective."""
    assert ranks2.run(hf_parity, corpus.hf_gpt_oss, GPT_OSS_PLAN, torch.float32)[0] == \
        ({"all_reduce": 2 * L + 1, "all_gather": 1}, {"all_reduce": 2 * L + 1})


def test_experts_hold_their_share_of_every_expert(fake_group):
    fake_group(2)
    gm = fxtp.parallelize(corpus.hf_mixtral(), "auto", example_inputs=(TOKENS,),
                          example_kwargs={"use_cache": False}, strict=True)
    experts = gm.model.layers[0].mlp.experts
    assert experts.gate_up_proj.to_local().shape == (4, 64, 32)  # (experts, 2 x 64 / 2, hidden)
    assert experts.down_proj.to_local().shape == (4, 32, 32)  # (experts, hidden, 64 / 2)
    assert gm.model.layers[0].mlp.gate.weight.to_local().shape == (4, 32)  # the router: whole


def test_the_auto_plan_is_the_base_model_plan_under_its_prefix_plus_the_heads():
    plan = model_plan(corpus.hf_llama())
    assert plan["lm_head"] == "colwise_gather_output"
    assert plan["model.embed_tokens"] == "embedding_rowwise"
    assert plan["model.layers.*.self_attn.o_proj"] == "rowwise"


def test_plan_strings_mix_with_style_objects(ranks2):
    plan = {"model.embed_tokens": "embedding_rowwise",
            "model.layers.*.self_attn.[qkv]_proj": "colwise",
            "model.layers.*.self_attn.o_proj": fxtp.RowwiseParallel(),
            "model.layers.*.mlp.[gu][ap]*_proj": fxtp.ColwiseParallel(),
            "model.layers.*.mlp.down_proj": "rowwise",
            "model.norm": "replicate",  # fxtp needs no style for it
            "lm_head": "colwise_gather_output"}
    assert ranks2.run(hf_parity, corpus.hf_llama, plan)[0] == MEGATRON_TP


def test_every_dense_plan_string_has_a_meaning():
    assert set(STYLES) | NO_STYLE >= {
        "colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "packed_colwise",
        "packed_rowwise", "embedding_rowwise", "sequence_parallel", "all_reduce",
        "replicated_with_grad_allreduce"}


def test_every_plan_strings_style_hands_on_local_tensors_as_transformers_layers_do():
    """transformers registers ``sequence_parallel`` with ``use_local_output=True`` (its
    models compute on plain tensors), so a base model whose last norm is planned with it
    returns a plain tensor, not a DTensor."""
    from fxtp.plans.styles import returns_dtensors
    assert [name for name, make in STYLES.items() if returns_dtensors(make())] == []


def test_unknown_strings_and_styles_a_module_cannot_take_are_rejected_naming_them(
        fake_group):
    fake_group(2)
    model = corpus.hf_llama()
    with pytest.raises(fxtp.PlanError, match=r"ExpertTensorParallel cannot shard module "
                                             r"'model\.layers\.0\.mlp' of type LlamaMLP"):
        fxtp.parallelize(model, {"model.layers.*.mlp": "moe_tp_experts"},
                         example_inputs=(TOKENS,))
    with pytest.raises(fxtp.PlanError, match=r"'colwize' is not a Hugging Face plan string"):
        fxtp.parallelize(model, {"lm_head": "colwize"}, example_inputs=(TOKENS,))


def test_auto_needs_a_model_that_carries_a_plan(fake_group):
    fake_group(2)
    with pytest.raises(fxtp.PlanError, match=r"plan='auto'.*GPT2.*carries none"):
        fxtp.parallelize(corpus.gpt2(), "auto", example_inputs=(TOKENS,))


@pytest.mark.parametrize("base_plan,carried", [
    ({}, r"lm_head"),
    ({"embed_tokens": "embedding_rowwise"}, r"lm_head, model\.embed_tokens"),
], ids=["head", "embedding_and_head"])
def test_auto_needs_a_plan_for_the_layers_not_only_the_ends(fake_group, base_plan, carried):
    """HunYuan's config carries no layer plan (transformers 5.23: none, 5.24: its embedding's
    alone; its head class one for ``lm_head``): "auto" would shard the ends and run every
    layer whole, so it is refused rather than done."""
    fake_group(2)
    model = corpus.hf_hunyuan_dense(base_model_tp_plan=base_plan)
    with pytest.raises(fxtp.PlanError, match=r"HunYuanDenseV1ForCausalLM carries a plan only "
                                             rf"for its embedding and head \({carried}\): "
                                             r"pass a plan dict"):
        fxtp.parallelize(model, "auto", example_inputs=(TOKENS,))


class GatherThenSplit(torch.nn.Module):
    """A block planned as Hugging Face plans GLM's MLP: ``up`` gathered
    (``colwise_gather_output``), then ``down`` split again (``rowwise_split_input``). In
    between, ``glu`` (GLM's chunk) computes on shards; a sort over the features needs them
    whole."""

    def __init__(self, between):
        super().__init__()
        self.between = between
        self.layers = torch.nn.ModuleList([torch.nn.ModuleDict(
            {"up": torch.nn.Linear(16, 64), "down": torch.nn.Linear(32, 16)})])

    def forward(self, x):
        layer = self.layers[0]
        h = layer["up"](x)
        if self.between == "glu":
            gate, up = h.chunk(2, -1)
            h = torch.nn.functional.silu(gate) * up
        else:
            h = h[..., :32].sort(-1).values
        return layer["down"](h)


GATHER_SPLIT = {"layers.*.up": "colwise_gather_output", "layers.*.down": "rowwise_split_input"}


def gather_split_parity(rank, world, between):
    from tests.helpers.parity import example
    return check_parity(rank, world, lambda: GatherThenSplit(between), GATHER_SPLIT,
                        [example(2, 8, 16)], dtype=torch.float64, strict=True)


@pytest.mark.parametrize("between,counts", [
    ("glu", ({"all_reduce": 1}, {"all_reduce": 1})),
    ("sort", ({"all_gather": 1, "all_reduce": 1}, {"all_reduce": 1, "all_gather": 1})),
], ids=["computes_on_shards", "needs_them_whole"])
def test_a_gather_split_again_is_left_out_only_where_that_costs_less(ranks2, between, counts):
    """Where the values between can stay sharded (the chunk strided), neither the gather
    nor the split is made: Megatron's collectives. Where they cannot, the plan's gather
    and split stay (leaving them out would gather for the softmax anyway: a fallback),
    and nothing is reported (a sort; a softmax would compute on shards)."""
    assert ranks2.run(gather_split_parity, between)[0] == counts
