"""Hugging Face plans: ``plan="auto"`` takes the model's own tensor-parallel plan, and plan
dicts may use Hugging Face's plan strings, mixed with style objects. Parity, zero fallbacks
and Megatron's counts, as under the hand-written plans of ``tests/test_corpus.py``."""
import pytest
import torch

import fxtp
from fxtp.hf_plans import NO_STYLE, STYLES, model_plan
from tests import corpus
from tests.corpus import L, TOKENS
from tests.parity import check_parity

transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]'")
MEGATRON_TP = ({"all_reduce": 2 * L + 1, "all_gather": 1}, {"all_reduce": 2 * L + 1})


def hf_parity(rank, world, make, plan):
    return check_parity(rank, world, make, plan, [TOKENS], dtype=torch.float64, strict=True,
                        input_grads=False, kwargs={"use_cache": False},
                        output=lambda out: out.logits)


@pytest.mark.parametrize("name", ["hf_llama", "hf_qwen2"])
def test_auto_uses_the_models_own_plan(ranks, name):
    """Hugging Face's plan: q, k, v, gate, up colwise; o, down rowwise; a vocab-parallel
    embedding; the head colwise with its output gathered."""
    assert ranks.run(hf_parity, getattr(corpus, name), "auto")[0] == MEGATRON_TP


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


def test_moe_strings_and_unknown_strings_are_rejected_naming_them(fake_group):
    fake_group(2)
    model = corpus.hf_llama()
    with pytest.raises(fxtp.PlanError, match=r"'moe_tp_experts'.*mixture-of-experts"):
        fxtp.parallelize(model, {"model.layers.*.mlp": "moe_tp_experts"},
                         example_inputs=(TOKENS,))
    with pytest.raises(fxtp.PlanError, match=r"'colwize' is not a Hugging Face plan string"):
        fxtp.parallelize(model, {"lm_head": "colwize"}, example_inputs=(TOKENS,))


def test_auto_needs_a_model_that_carries_a_plan(fake_group):
    fake_group(2)
    with pytest.raises(fxtp.PlanError, match=r"plan='auto'.*GPT2.*has none"):
        fxtp.parallelize(corpus.gpt2(), "auto", example_inputs=(TOKENS,))
