"""A corpus of models written as other projects write them (``tests/helpers/corpus.py``), each
under Megatron's tensor-parallel plan ("tp") and torchtitan's sequence-parallel plan ("sp"),
on 2 gloo ranks (and 4 under the sequence-parallel plan for the models of ``AT_WORLD_4``).
For every model and plan:

1. no op is gathered for want of a sharding rule (``gm.fxtp.fallbacks == []``): ordinary
   model code must not need a fallback;
2. the collectives of the first training step are exactly the plan's minimum, forward and
   backward (derived per model below);
3. forward outputs, every gradient and the parameters after 3 AdamW steps match the
   single-device model (``tests/helpers/parity.py``), in fp64 (in fp32 for the models that compute
   their norms in fp32 whatever their dtype); a few more also in fp32, on 2 ranks.

A model's expected counts are the minimum its plan allows (derived in comments below),
not what fxtp does today; a failing count names a missed optimization or a plan that
cannot reach it.
"""
import re

import pytest
import torch

import fxtp
from fxtp.examples.llama import llama_tp_plan
from tests.helpers import corpus
from tests.helpers.corpus import CORPUS, L, TOKENS
from tests.helpers.corpus import tp_counts
from tests.helpers.harness import pool_of
from tests.helpers.parity import check_parity


# --- the collectives of one training step -------------------------------------------------


def sp_counts(fwd_all_gather=2 * L + 2, bwd_all_gather=2 * L + 1, bwd_reduce_scatter=2 * L + 1,
              bwd_all_reduce=L + 1):
    """torchtitan's SP of an L-layer LM. Forward: an all-gather of the sequence shards on
    entry to each attention and MLP (2L), one of the final norm's output into the head,
    one of the logits; a reduce-scatter of each rowwise output (2L) and of the embedding's
    partial sum. Backward: the conjugates (each all-gather's is a reduce-scatter, each
    reduce-scatter's an all-gather; the logits gather's is a local chunk) and one
    all-reduce per block (and one for the final norm) for the gradients of the replicated
    parameters used on sequence shards (norm weights, rowwise biases), bucketed: each
    block reads only its own parameters, as per-block FSDP needs."""
    return ({"all_gather": fwd_all_gather, "reduce_scatter": 2 * L + 1},
            {"all_gather": bwd_all_gather, "reduce_scatter": bwd_reduce_scatter,
             "all_reduce": bwd_all_reduce})


STANDARD = {"tp": tp_counts(), "sp": sp_counts()}

EXPECTED = {
    # Meta's layout; the four rotary embeddings act within each head (the head dim is
    # never sharded), so each must keep the head shards: no communication of its own.
    "llama_rope_torchtune": STANDARD,
    "llama_rope_hf_rotate_half": STANDARD,
    "llama_rope_complex": STANDARD,
    "llama_rope_gptj_interleaved": STANDARD,
    # learned positions: under SP the position embedding's output is chunked to be added
    # to the sequence shards, so its gradient is all-gathered in backward (one more)
    "gpt2": {"tp": tp_counts(), "sp": sp_counts(bwd_all_gather=2 * L + 2)},
    "hf_llama": STANDARD,
    "hf_qwen2": STANDARD,            # q, k, v biases shard with their colwise weights
    "hf_mistral": STANDARD,          # the sliding-window mask is replicated
    # post-attention / post-feed-forward norms act on the rowwise outputs after their
    # all-reduce (TP) or reduce-scatter (SP): no communication of their own
    "hf_gemma2": STANDARD,
    # fused qkv_proj sliced into q, k, v and gate_up_proj chunked: laid out strided, so
    # the splits need no gather
    "hf_phi3": STANDARD,
    # OLMo2 RMS-normalizes q and k over the whole projection (q_norm, k_norm), across the
    # heads both plans shard: Megatron's minimum is impossible. Each norm's sum of squares
    # over its head shards is a partial (B, T, 1) value to all-reduce (2 per layer
    # forward); that replicated variance is read on head shards, so its gradient is
    # all-reduced too (2 per layer backward); the norms' weights, which no style shards,
    # are read only as this rank's slice, so each rank holds its slice (no collective for
    # their gradients; held whole they cost 2 tiny all-gathers per layer). Measured (the sum of
    # squares gathered instead: a (B, T, H * D) all-gather per
    # norm): TP forward {all_reduce 2L+1, all_gather 2L+1}, backward {all_reduce 4L+1,
    # all_gather 2L}; SP forward {all_gather 4L+2, reduce_scatter 2L+1}, backward
    # {all_gather 4L+1, reduce_scatter 2L+1, all_reduce 3L+1}.
    "hf_olmo2": {"tp": ({"all_reduce": 4 * L + 1, "all_gather": 1},
                        {"all_reduce": 4 * L + 1}),
                 "sp": ({"all_gather": 2 * L + 2, "reduce_scatter": 2 * L + 1,
                         "all_reduce": 2 * L},
                        {"all_gather": 2 * L + 1, "reduce_scatter": 2 * L + 1,
                         "all_reduce": 2 * L + L + 1})},  # + one norm-weight bucket per block
    # parallel block: one input_layernorm feeds both attention and MLP, so backward has
    # one all-reduce per layer (TP), and SP gathers that norm's output once per layer
    # (its conjugate: one reduce-scatter per layer). Its two rowwise outputs reduced as
    # one sum (as GPT-NeoX's below) is tried and, in fp32 at these sizes, sends more: the
    # final norm would then read a partial value, and small backward all-reduces come with
    # it (in fp64 the norm's cast to fp32 narrows, the sum is reduced before it, and the
    # one sum is kept: tests/plans/test_hf_plans.py).
    "hf_cohere": {"tp": tp_counts(bwd_all_reduce=L + 1),
                  "sp": sp_counts(fwd_all_gather=L + 2, bwd_reduce_scatter=L + 1)},
    # parallel residual with two norms: attention and MLP inputs are different values,
    # so backward is Llama's; the fused query_key_value is laid out per head
    # ((B, T, H, 3 * head_dim) then chunked in the head dim), so plain Shard serves it.
    # Forward, the attention's and the MLP's partial outputs (biases added on one rank)
    # are summed with the residual and reduced once per layer: L all-reduces fewer (TP),
    # or reduce-scatters (SP), whose conjugate all-gathers backward go too.
    "hf_gpt_neox": {"tp": tp_counts(fwd_all_reduce=L + 1),
                    "sp": ({"all_gather": 2 * L + 2, "reduce_scatter": L + 1},
                           {"all_gather": L + 1, "reduce_scatter": 2 * L + 1,
                            "all_reduce": L + 1})},
}

# world 4 under the SP plan only (it redistributes the most) for the models whose layouts
# differ most, to keep the suite's time
AT_WORLD_4 = ["llama_rope_torchtune", "llama_rope_complex", "gpt2", "hf_llama", "hf_phi3",
              "hf_olmo2", "hf_cohere"]
CASES = [(2, plan, name) for name in CORPUS for plan in ("tp", "sp")] + \
    [(4, "sp", name) for name in AT_WORLD_4]
# fp32 (besides the fp32-inside models above), kept to a few for time: world 2, one plan
FP32 = [("llama_rope_torchtune", "sp"), ("hf_phi3", "tp"), ("hf_gpt_neox", "sp")]


def run(rank, world, name, plan, dtype):
    """Parity of corpus model ``name`` under ``plan`` on this rank; returns its fallbacks,
    collective counts and the parity failure, if any (so fallbacks are reported first)."""
    entry = CORPUS[name]
    seen = {}
    try:
        counts = check_parity(rank, world, entry.make, entry.plans[plan](), [TOKENS],
                              dtype=dtype, input_grads=False, kwargs=corpus.call_kwargs(entry),
                              output=corpus.logits(entry),
                              post=lambda gm: seen.setdefault("fallbacks", gm.fxtp.fallbacks))
        error = None
    except AssertionError as e:
        counts, error = None, f"{type(e).__name__}: {e}"
    return seen.get("fallbacks"), counts, error


def check(ranks, name, plan, dtype):
    fallbacks, counts, error = ranks.run(run, name, plan, dtype)[0]
    assert fallbacks == [], "ops gathered for want of a rule:\n" + "\n".join(fallbacks)
    assert error is None, error
    fwd, bwd = EXPECTED[name][plan]
    assert counts == (fwd, bwd), f"(forward, backward) collectives {counts}, expected {(fwd, bwd)}"


@pytest.mark.parametrize("world,plan,name", CASES, ids=[
    f"world{w}-{p}-{n}" + ("-fp32" if CORPUS[n].fp32_inside else "") for w, p, n in CASES])
def test_corpus(pools, world, plan, name):
    """No fallback, the plan's exact collectives and single-device parity in fp64; in fp32
    for the models whose norms compute in fp32 whatever the model's dtype (``-fp32`` ids:
    Gemma2, OLMo2, Cohere). Their fp32 sums over a dim the plan shards (norm weights'
    gradients over sequence shards, OLMo2's q/k sums of squares over head shards) are
    added per rank, then across ranks: another order than the single device's, so they
    differ by fp32 rounding (1e-6 relative), beyond fp64's tolerance."""
    entry = CORPUS[name]
    if entry.hf:
        pytest.importorskip("transformers")
    check(pool_of(pools, world), name, plan,
          torch.float32 if entry.fp32_inside else torch.float64)


@pytest.mark.parametrize("name,plan", FP32, ids=[f"{n}-{p}" for n, p in FP32])
def test_corpus_fp32(ranks2, name, plan):
    """As in fp64, at fp32's tolerance, for a few models (world 2 only, to keep time)."""
    if CORPUS[name].hf:
        pytest.importorskip("transformers")
    check(ranks2, name, plan, torch.float32)


def six_heads(rank, world):
    return check_parity(rank, world, lambda: corpus.RopeLlama("hf_rotate_half", dim=48,
                                                              n_heads=6, n_kv_heads=6),
                        llama_tp_plan(), [TOKENS], dtype=torch.float64, strict=True,
                        input_grads=False)


def test_heads_not_dividing_the_world_size_are_dealt_whole(ranks4):
    """6 heads on 4 ranks: q, k and v (48 features) would shard evenly, 12 per rank, but not
    in whole heads of 8; they are dealt in whole heads instead (2, 2, 2, 0), and so are
    the output projection's input features: no fallback, Megatron's counts."""
    assert ranks4.run(six_heads)[0] == STANDARD["tp"]


def test_kv_heads_that_cannot_be_dealt_are_reported(fake_group):
    """3 KV heads on 4 ranks: fewer than the ranks and not dividing them, so the k and v
    head views gather. That must not pass silently: for each layer ``gm.fxtp.fallbacks``
    names the attention module and the sizes (3 heads, world size 4). Shapes only."""
    fake_group(4)
    model = corpus.RopeLlama("hf_rotate_half", dim=48, n_heads=6, n_kv_heads=3)
    with pytest.warns(UserWarning, match="fxtp"):
        gm = fxtp.parallelize(model, llama_tp_plan(), example_inputs=(TOKENS,))
    for layer in range(L):
        module = f"layers.{layer}.attention"
        reports = [m for m in gm.fxtp.fallbacks
                   if re.search(rf"'{re.escape(module)}(\.\w+)*'", m)]
        assert reports, f"no fallback names {module}: {gm.fxtp.fallbacks}"
        assert any(re.search(r"\b3\b", m) and re.search(r"\b4\b", m) for m in reports), \
            f"no report for {module} gives the head count 3 and world size 4: {reports}"
