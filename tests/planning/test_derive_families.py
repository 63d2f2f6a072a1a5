"""Models nobody wrote a plan for train under ``plan="derive"`` as on one device (fp64,
strict: forward, every gradient, 3 AdamW steps) with no fallback and no more collectives
than Megatron's layout issues: Hugging Face families that carry no plan of their own
(decoders, encoder-decoders, vision and contrastive models), nanoGPT, and timm's ViT and
DiT as their authors write them (:mod:`tests.helpers.ports`). Each is built small from a
random config (2 blocks per stack, width 32, 4 heads); nothing is downloaded."""
import pytest
import torch

import fxtp
from tests.helpers import corpus, ports
from tests.helpers.parity import check_parity

transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]'")

g = torch.Generator().manual_seed(0)
TOKENS = torch.randint(0, 64, (2, 16), generator=g)
TARGETS = torch.randint(0, 64, (2, 16), generator=g)
IMAGES = torch.randn(2, 3, 32, 32, generator=g)
NO_CACHE = {"use_cache": False}
SEQ2SEQ = {"decoder_input_ids": TOKENS, "use_cache": False}
T = transformers


def logits(out):
    return out.logits


LOSS = dict(output=lambda out: out[1], output_index=1)  # nanoGPT returns (logits, loss)


def opt():
    return T.OPTForCausalLM(T.OPTConfig(
        vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0))


def gptj():
    return T.GPTJForCausalLM(T.GPTJConfig(
        vocab_size=64, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def mpt():
    return T.MptForCausalLM(T.MptConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4,
                                        max_seq_len=64, expansion_ratio=2))


def falcon():
    """Falcon's new decoder (40B / 180B): grouped KV heads in one fused projection,
    attention and MLP in parallel, linears written ``x @ self.weight.T``."""
    return T.FalconForCausalLM(T.FalconConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        new_decoder_architecture=True, num_kv_heads=2, parallel_attn=True))


def bart():
    return T.BartForConditionalGeneration(T.BartConfig(
        vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0))


def t5():
    return T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        dropout_rate=0.0))


def whisper():
    return T.WhisperForConditionalGeneration(T.WhisperConfig(
        vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=4, max_target_positions=32,
        dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1))


def vit():
    return T.ViTForImageClassification(T.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        image_size=32, patch_size=8, num_labels=10))


def clip():
    return T.CLIPModel(T.CLIPConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32,
                         bos_token_id=0, eos_token_id=1, pad_token_id=1),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, image_size=32, patch_size=8),
        projection_dim=16))


def nanogpt():
    return corpus.NanoGPT(vocab_size=64)


def AR(n, gathers=0):
    return {"all_reduce": n, **({"all_gather": gathers} if gathers else {})}


def dit_inputs():
    return [torch.randn(2, 4, 16, 16, generator=g), torch.rand(2, generator=g) * 999,
            torch.tensor([1, 3])]


# name -> (model, example inputs, keyword arguments, the output compared (a picker, or
# check_parity's output and output_index), forward and backward collectives of a step at 2
# ranks). Megatron's layout all-reduces once per column-wise / row-wise pair forward (2 per
# block, 3 in a decoder block with cross-attention; 1 where attention and MLP run in parallel
# and their sums are added first) and once per vocabulary-parallel lookup; backward once per
# pair, once for the head's input, and once per layer reading the encoder's output (T5,
# BART, Whisper); a head's logits are gathered (nanoGPT keeps them sharded for its loss: 3
# all-reduces more).
FAMILIES = {
    "opt": (opt, [TOKENS], NO_CACHE, logits, AR(5, gathers=1), AR(5)),
    "gptj": (gptj, [TOKENS], NO_CACHE, logits, AR(2, gathers=2), AR(3)),  # parallel blocks;
    "mpt": (mpt, [TOKENS], NO_CACHE, logits, AR(5, gathers=1), AR(5)),  # wte by features
    "falcon": (falcon, [TOKENS], NO_CACHE, logits, AR(3, gathers=1), AR(5)),  # parallel
    "bart": (bart, [TOKENS], SEQ2SEQ, logits, AR(12, gathers=1), AR(12)),
    "t5": (t5, [TOKENS], SEQ2SEQ, logits, AR(12, gathers=1), AR(12)),
    "whisper": (whisper, [torch.randn(2, 8, 8, generator=g)], SEQ2SEQ, logits,
                AR(11, gathers=1), AR(12)),  # its encoder reads audio features, not tokens
    "vit": (vit, [IMAGES], {}, logits, AR(4), AR(4)),  # the classifier stays whole
    "clip": (clip, [TOKENS[:, :8], IMAGES], {}, lambda out: out.logits_per_image,
             AR(8, gathers=1), AR(8)),  # two towers; the token embedding by features
    "nanogpt": (nanogpt, [TOKENS, TARGETS], {}, LOSS, AR(8), AR(5)),
    "timm_vit": (ports.TimmViT, [IMAGES], {}, lambda out: out, AR(4), AR(4)),
    # DiT: its timestep MLP is a pair too (1 forward); each adaptive norm's modulation is
    # column-wise and gathered (3 forward); backward, the final linear's input and the
    # condition's gradient, once for the (stamped) blocks and the final layer together
    "dit": (ports.DiT, dit_inputs(), {}, lambda out: out, AR(5, gathers=4), AR(6)),
}


def derived(rank, world, name):
    make, inputs, kwargs, output, _, _ = FAMILIES[name]
    compared = output if isinstance(output, dict) else {"output": output}
    return check_parity(rank, world, make, "derive", inputs, dtype=torch.float64, strict=True,
                        input_grads=False, kwargs=kwargs, **compared)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_family_without_a_plan_trains_like_one_device_under_its_derived_plan(ranks2, name):
    fwd, bwd = ranks2.run(derived, name)[0]
    assert (fwd, bwd) == FAMILIES[name][4:]


AT_4 = {"t5": FAMILIES["t5"][4:], "dit": FAMILIES["dit"][4:],
        # 2 KV heads at 4 ranks: each is held by 2 ranks, whose gradients of the fused
        # projection's KV rows are summed (1 more backward all-reduce per layer)
        "falcon": (AR(3, gathers=1), AR(7))}


@pytest.mark.parametrize("name", AT_4)
def test_at_4_ranks_with_fewer_kv_heads_than_ranks_it_still_trains_like_one_device(ranks4,
                                                                                  name):
    fwd, bwd = ranks4.run(derived, name)[0]
    assert (fwd, bwd) == AT_4[name]


def deepseek_v2(rank, world):
    return check_parity(rank, world, corpus.hf_deepseek_v2, "derive", [TOKENS],
                        dtype=torch.float32, strict=True, input_grads=False, kwargs=NO_CACHE,
                        output=logits)


def test_deepseek_v2s_latent_attention_gets_megatrons_pairs_and_trains_like_one_device(ranks2):
    """Multi-head latent attention chains two linears into each of q and kv (``q_a_proj ->
    norm -> q_b_proj``): the outer pair is Megatron's (``q_b_proj`` and ``kv_b_proj``
    column-wise, ``o_proj`` row-wise), and the bottlenecks' first linears are column-wise
    with their outputs gathered (2 all-gathers a block). Forward: 2 all-reduces in the dense
    block, 3 in the mixture's (its routed experts' sum), the embedding by features and the
    logits gathered. fp32: its grouped experts have no fp64 kernel."""
    fwd, bwd = ranks2.run(deepseek_v2)[0]
    assert (fwd, bwd) == (AR(5, gathers=6), AR(13))


def test_t5s_encoder_alone_parallelizes_strictly_under_its_derived_plan(fake_group):
    """``T5EncoderModel`` (the text encoder of diffusion models) holds the tied embedding
    twice, as ``shared``, which forward never calls, and as ``encoder.embed_tokens``. The
    plan's embedding lays out both; ``shared``'s only parameter is read through its twin,
    so strict mode takes it, as it does the embedding of an encoder-decoder."""
    fake_group(2)
    torch.manual_seed(0)
    model = T.T5EncoderModel(T.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64,
                                        num_layers=2, num_heads=4, dropout_rate=0.0))
    plan = fxtp.derive_plan(model, example_inputs=(TOKENS,), world_size=2)
    assert "encoder.embed_tokens" in plan
    gm = fxtp.parallelize(model, plan, example_inputs=(TOKENS,), strict=True)
    assert gm.fxtp.fallbacks == [] and gm.fxtp.uncalled == {}
