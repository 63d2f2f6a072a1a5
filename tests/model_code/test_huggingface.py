"""Hugging Face models built from small random configs (nothing is downloaded), under the
standard TP plan, against the single-device model."""
import pytest
import torch

import fxtp
from fxtp import Replicate
from tests.helpers import corpus
from tests.helpers.parity import check_parity

transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]'")

L = 2
TOKENS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
LLAMA_PLAN = {
    "model.embed_tokens": fxtp.RowwiseParallel(input_layouts=Replicate()),
    "model.layers.*.self_attn.[qkv]_proj": fxtp.ColwiseParallel(),
    "model.layers.*.self_attn.o_proj": fxtp.RowwiseParallel(),
    "model.layers.*.mlp.[gu][ap]*_proj": fxtp.ColwiseParallel(),
    "model.layers.*.mlp.down_proj": fxtp.RowwiseParallel(),
    "lm_head": fxtp.ColwiseParallel(output_layouts=Replicate()),
}


def llama():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=L, num_attention_heads=8,
                                   num_key_value_heads=4, max_position_embeddings=64,
                                   attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_llama_for_causal_lm(ranks, dtype):
    fwd, bwd = ranks.run(hf, dtype, "llama")[0]
    assert fwd == {"all_reduce": 2 * L + 1, "all_gather": 1}
    assert bwd == {"all_reduce": 2 * L + 1}


GPT2_PLAN = {
    "transformer.wte": fxtp.RowwiseParallel(input_layouts=Replicate()),
    "transformer.h.*.attn.c_attn": fxtp.ColwiseParallel(),
    "transformer.h.*.attn.c_proj": fxtp.RowwiseParallel(),
    "transformer.h.*.mlp.c_fc": fxtp.ColwiseParallel(),
    "transformer.h.*.mlp.c_proj": fxtp.RowwiseParallel(),
    "lm_head": fxtp.ColwiseParallel(output_layouts=Replicate()),
}


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=L, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    return transformers.GPT2LMHeadModel(cfg)


def hf(rank, world, dtype, name, plan=None):
    """Parity of the Hugging Face model ``name`` ("llama", "gpt2") under ``plan`` (default:
    the standard TP plan), comparing logits."""
    make, standard = {"llama": (llama, LLAMA_PLAN), "gpt2": (gpt2, GPT2_PLAN)}[name]
    return check_parity(rank, world, make, plan or standard, [TOKENS], dtype=dtype,
                        input_grads=False, kwargs={"use_cache": False},
                        output=lambda out: out.logits)


def training_call(rank, world):
    """A fine-tuning loop's call: right-padded ``attention_mask`` and ``labels`` with the
    padding ignored (-100); the model's own loss is compared (fp64, forward, gradients,
    3 AdamW steps)."""
    mask = torch.ones_like(TOKENS)
    mask[0, -3:] = 0
    labels = TOKENS.masked_fill(mask == 0, -100)
    return check_parity(rank, world, llama, "auto", [TOKENS], dtype=torch.float64,
                        strict=True, input_grads=False,
                        kwargs={"attention_mask": mask, "labels": labels, "use_cache": False},
                        output=lambda out: out.loss)


def test_a_training_call_with_padding_and_labels_gives_the_models_loss(ranks2):
    fwd, bwd = ranks2.run(training_call)[0]
    assert fwd == {"all_reduce": 2 * L + 1, "all_gather": 1}
    assert bwd == {"all_reduce": 2 * L + 1}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_gpt2_lm_head_model_with_conv1d_and_fused_qkv(ranks, dtype):
    """Conv1D layers shard like linears. The fused c_attn output is split into q, k, v
    along its sharded dim: c_attn's weight and bias are laid out strided (each rank holds
    [q_r | k_r | v_r]), so the split needs no gather: Megatron's minimum, as for Llama."""
    fwd, bwd = ranks.run(hf, dtype, "gpt2")[0]
    assert fwd == {"all_reduce": 2 * L + 1, "all_gather": 1}
    assert bwd == {"all_reduce": 2 * L + 1}


def test_a_model_returning_its_kv_cache_is_told_to_trace_without_it(fake_group):
    """GPT-2 returns a DynamicCache by default, which torch.export cannot flatten; the error
    names it and the fix, and the fix traces."""
    fake_group(2)
    model = gpt2()
    with pytest.raises(fxtp.TraceError, match=r"(?s)DynamicCache.*Hint: the model returns "
                                              r"its key/value cache.*model\.config\.use_cache "
                                              r"= False.*parallelize_causal_lm"):
        fxtp.parallelize(model, GPT2_PLAN, example_inputs=(TOKENS,))
    model.config.use_cache = False
    gm = fxtp.parallelize(model, GPT2_PLAN, example_inputs=(TOKENS,))
    assert gm(TOKENS).logits.shape == (*TOKENS.shape, 64)


# Families without a TP plan of their own, under the plan a user writes from torch's styles.

def bert():
    """An encoder: BertAttention's child module is named ``self``."""
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=L,
                                  num_attention_heads=4, intermediate_size=64,
                                  max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(cfg)


BERT_PLAN = {
    "bert.encoder.layer.*.attention.self.query": fxtp.ColwiseParallel(),
    "bert.encoder.layer.*.attention.self.key": fxtp.ColwiseParallel(),
    "bert.encoder.layer.*.attention.self.value": fxtp.ColwiseParallel(),
    "bert.encoder.layer.*.attention.output.dense": fxtp.RowwiseParallel(),
    "bert.encoder.layer.*.intermediate.dense": fxtp.ColwiseParallel(),
    "bert.encoder.layer.*.output.dense": fxtp.RowwiseParallel(),
}


def t5():
    """An encoder-decoder: the first block of each stack computes a relative position bias
    (an embedding of buckets, one column per head) that every block adds to its scores."""
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=L,
                                num_heads=4, dropout_rate=0.0, decoder_start_token_id=0)
    return transformers.T5ForConditionalGeneration(cfg)


def t5_plan():
    layers = {"encoder": ("layer.0.SelfAttention", "layer.1.DenseReluDense"),
              "decoder": ("layer.0.SelfAttention", "layer.1.EncDecAttention",
                          "layer.2.DenseReluDense")}
    plan = {}
    for stack, modules in layers.items():
        for module in modules:
            rows, cols = ("o", "qkv") if "Attention" in module else ("wo", ("wi",))
            for name in cols:
                plan[f"{stack}.block.*.{module}.{name}"] = fxtp.ColwiseParallel()
            plan[f"{stack}.block.*.{module}.{rows}"] = fxtp.RowwiseParallel()
    return plan


def bloom():
    """Fused per-head query-key-value, heads merged into the batch for ``baddbmm`` with the
    ALiBi bias, and GeLU as a custom ``autograd.Function`` while training."""
    cfg = transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=L, n_head=4,
                                   hidden_dropout=0.0, attention_dropout=0.0)
    return transformers.BloomForCausalLM(cfg)


BLOOM_PLAN = {
    "transformer.h.*.self_attention.query_key_value": fxtp.ColwiseParallel(),
    "transformer.h.*.self_attention.dense": fxtp.RowwiseParallel(),
    "transformer.h.*.mlp.dense_h_to_4h": fxtp.ColwiseParallel(),
    "transformer.h.*.mlp.dense_4h_to_h": fxtp.RowwiseParallel(),
}


def mamba():
    """A selective state space model (the scan on CPU: a loop over the tokens, in fp32
    whatever the model's dtype): a depthwise causal convolution over the inner channels,
    ``x_proj``'s output cut into time step, B and C, ``dt_proj``'s weight read without
    calling the module, ``A_log`` and ``D`` read by channel."""
    cfg = transformers.MambaConfig(vocab_size=64, hidden_size=32, state_size=8,
                                   num_hidden_layers=L, expand=2, conv_kernel=4,
                                   use_mambapy=False)
    return transformers.MambaForCausalLM(cfg)


MAMBA_PLAN = {  # the inner channels sharded, as Megatron's Mamba mixer shards them
    "backbone.layers.*.mixer.in_proj": fxtp.ColwiseParallel(),
    "backbone.layers.*.mixer.x_proj": fxtp.RowwiseParallel(output_layouts=Replicate()),
    "backbone.layers.*.mixer.dt_proj": fxtp.ColwiseParallel(),
    "backbone.layers.*.mixer.out_proj": fxtp.RowwiseParallel(),
}


def qwen3_5():
    """Qwen3.5's gated delta-net: its fused q / k / v projection convolved by a depthwise
    causal convolution, then split unequally (key, key and value heads: 16, 16, 32), and
    read per head by the recurrence; z, b and a projected apart."""
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=L,
        num_attention_heads=8, num_key_value_heads=4, head_dim=4, linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=4, linear_value_head_dim=4,
        layer_types=["linear_attention"] * L, tie_word_embeddings=False, pad_token_id=0)
    return transformers.Qwen3_5ForCausalLM(cfg)


QWEN3_5_PLAN = {  # the linear attention by heads, as Megatron shards attention
    **{f"model.layers.*.linear_attn.in_proj_{p}": fxtp.ColwiseParallel()
       for p in ("qkv", "z", "b", "a")},
    "model.layers.*.linear_attn.out_proj": fxtp.RowwiseParallel(),
}


def qwen3_next():
    """Qwen3-Next: a gated delta-net layer (its fused q / k / v / z projection viewed per
    key head, q, k and v concatenated again for the convolution) and a full-attention one;
    its experts in ``batched_mm`` (fp64)."""
    model = corpus.hf_qwen3_next()
    model.set_experts_implementation("batched_mm")
    return model


QWEN3_NEXT_PLAN = {  # its linear attention by heads (q, k, v and z fused, per key head)
    "model.layers.*.linear_attn.in_proj_qkvz": fxtp.ColwiseParallel(),
    "model.layers.*.linear_attn.in_proj_ba": fxtp.ColwiseParallel(),
    "model.layers.*.linear_attn.out_proj": fxtp.RowwiseParallel(),
}


def deberta(share_att_key=True):
    """DeBERTa-v3's disentangled attention: the relative position embeddings go through the
    layer's own (shared) key and query projections, and the head-sharded result is tiled
    over the batch (``repeat``) to meet the queries' batch-and-heads dim; without
    ``share_att_key``, through position projections of their own, which no plan names."""
    cfg = transformers.DebertaV2Config(vocab_size=64, hidden_size=32, num_hidden_layers=L,
                                       num_attention_heads=4, intermediate_size=64,
                                       max_position_embeddings=32, hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0,
                                       relative_attention=True, position_buckets=8,
                                       pos_att_type=["p2c", "c2p"],
                                       share_att_key=share_att_key,
                                       norm_rel_ebd="layer_norm")
    return transformers.DebertaV2ForMaskedLM(cfg)


DEBERTA_PLAN = {
    "deberta.encoder.layer.*.attention.self.query_proj": fxtp.ColwiseParallel(),
    "deberta.encoder.layer.*.attention.self.key_proj": fxtp.ColwiseParallel(),
    "deberta.encoder.layer.*.attention.self.value_proj": fxtp.ColwiseParallel(),
    "deberta.encoder.layer.*.attention.output.dense": fxtp.RowwiseParallel(),
    "deberta.encoder.layer.*.intermediate.dense": fxtp.ColwiseParallel(),
    "deberta.encoder.layer.*.output.dense": fxtp.RowwiseParallel(),
}


def beit():
    """BEiT's relative position bias: each layer's table of (distances, heads), resampled
    by ``interpolate`` (bilinear) to the image's window, indexed and added to the scores."""
    cfg = transformers.BeitConfig(hidden_size=32, num_hidden_layers=L, num_attention_heads=4,
                                  intermediate_size=64, image_size=8, patch_size=4,
                                  use_relative_position_bias=True, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, drop_path_rate=0.0)
    return transformers.BeitModel(cfg)


BEIT_PLAN = {
    "layers.*.attention.[qkv]_proj": fxtp.ColwiseParallel(),
    "layers.*.attention.o_proj": fxtp.RowwiseParallel(),
    "layers.*.mlp.fc1": fxtp.ColwiseParallel(),
    "layers.*.mlp.fc2": fxtp.RowwiseParallel(),
}
PIXELS = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))


def unplanned_family(rank, world, name):
    make, plan, kwargs = {
        "bert": (bert, BERT_PLAN, {}),
        "t5": (t5, t5_plan(), {"decoder_input_ids": TOKENS[:, :7], "use_cache": False}),
        "bloom": (bloom, BLOOM_PLAN, {"use_cache": False}),
        "mamba": (mamba, MAMBA_PLAN, {"use_cache": False}),
        "qwen3_5": (qwen3_5, QWEN3_5_PLAN, {"use_cache": False}),
        "qwen3_next": (qwen3_next, QWEN3_NEXT_PLAN, {"use_cache": False}),
        "deberta": (deberta, DEBERTA_PLAN, {}),
        "deberta_own_position_projections": (lambda: deberta(share_att_key=False),
                                             DEBERTA_PLAN, {}),
        "beit": (beit, BEIT_PLAN, {"pixel_values": PIXELS.double()}),
    }[name]
    return check_parity(rank, world, make, plan, [] if name == "beit" else [TOKENS],
                        dtype=torch.float64, strict=True, input_grads=False, kwargs=kwargs,
                        output=lambda out: out.last_hidden_state if name == "beit"
                        else out.logits,
                        compare_dtype=torch.float32 if name in ("mamba", "qwen3_5", "qwen3_next")
                        else None)


def test_bert_whose_attention_holds_a_module_named_self(ranks2):
    """The generated code of ``attention`` calls its child ``self`` without shadowing its
    own ``self``: Megatron's minimum."""
    assert ranks2.run(unplanned_family, "bert")[0] == ({"all_reduce": 2 * L},
                                                      {"all_reduce": 2 * L})


def test_t5s_relative_position_bias_is_made_on_head_shards(ranks2):
    """The bias every block of a stack reads is made from the bucket embedding held by head
    columns, so no block narrows a replicated bias (whose gradient would be all-gathered,
    a (batch, heads, queries, keys) tensor per block): forward 2 all-reduces per
    self-attention, cross-attention and MLP; backward those and the encoder output's
    gradient from the decoder's colwise keys and values."""
    assert ranks2.run(unplanned_family, "t5")[0] == ({"all_reduce": 5 * L},
                                                    {"all_reduce": 5 * L + 1})


def test_bloom_merging_heads_into_the_batch_and_its_custom_gelu(ranks):
    """``(batch, heads, ...) -> (batch * heads, ...)`` on head shards is a strided shard of
    the merged dim and splits back to head shards; BLOOM's ``GeLUFunction`` is elementwise,
    so it runs on the colwise shards: Megatron's minimum, strict."""
    assert ranks.run(unplanned_family, "bloom")[0] == ({"all_reduce": 2 * L},
                                                      {"all_reduce": 2 * L})


def test_mamba_on_inner_channel_shards(ranks2):
    """The depthwise convolution convolves each rank's channels (its groups); the conv, dt
    projection, ``A_log`` and ``D`` weights are held by channel; nothing is gathered.
    Forward: the rowwise x_proj's sum and out_proj's per layer. Backward: in_proj's input
    gradient, and the time step's, B's and C's gradients (each read by channel-sharded
    ops) per layer. Compared at fp32's tolerance: the scan computes in fp32."""
    assert ranks2.run(unplanned_family, "mamba")[0] == ({"all_reduce": 2 * L},
                                                       {"all_reduce": 4 * L})


def test_qwen3_5s_convolved_fused_qkv_is_split_by_heads_without_a_gather(ranks2):
    """The fused projection's weight and the convolution's are laid out in blocks (each
    rank its chunk of q, k and v), so the convolution runs on this rank's channels and the
    unequal split gives head shards: nothing is gathered, strict. Forward: out_proj's sum
    per layer; backward: the block input's gradient and the gated norm's weight (every
    head reads it) per layer. At fp32's tolerance: the recurrence computes in fp32."""
    assert ranks2.run(unplanned_family, "qwen3_5")[0] == ({"all_reduce": L},
                                                         {"all_reduce": 2 * L})


def test_qwen3_nexts_q_k_and_v_shards_concatenated_for_its_convolution_stay_sharded(ranks2):
    """Each rank's shards of q, k and v, taken per key head from the fused projection, are
    concatenated into its chunk of every block, which the convolution takes and the split
    gives back as head shards: nothing is gathered, strict. Forward: out_proj's sum;
    backward: the linear layer's input gradient and its gated norm's weight."""
    assert ranks2.run(unplanned_family, "qwen3_next")[0] == ({"all_reduce": 1},
                                                            {"all_reduce": 2})


def test_deberta_tiles_its_head_sharded_relative_positions_over_the_batch(ranks2):
    """The tiled position keys and queries stay head shards (cut in one block per copy),
    nothing gathered: Megatron's minimum, and backward one all-reduce more for the
    relative embeddings every layer projects."""
    assert ranks2.run(unplanned_family, "deberta")[0] == ({"all_reduce": 2 * L},
                                                         {"all_reduce": 2 * L + 1})


def test_deberta_makes_its_unplanned_position_projections_on_head_shards(ranks2):
    """``pos_key_proj`` and ``pos_query_proj``, left out of the plan, are held by head rows:
    their outputs are tiled over the batch as blocks of head shards (``_StridedShard``),
    which propagation makes back to the weights, so no gradient is gathered (it was 2
    all-gathers per layer backward)."""
    assert ranks2.run(unplanned_family, "deberta_own_position_projections")[0] == (
        {"all_reduce": 2 * L}, {"all_reduce": 2 * L + 1})


def test_beits_relative_position_bias_is_resampled_on_head_shards(ranks2):
    """The bias table is held by head columns and resampled, indexed and added on them
    (``interpolate`` resamples each channel's plane on its own), so no layer narrows a
    replicated bias whose gradient would be all-gathered: Megatron's minimum."""
    assert ranks2.run(unplanned_family, "beit")[0] == ({"all_reduce": 2 * L},
                                                      {"all_reduce": 2 * L})
