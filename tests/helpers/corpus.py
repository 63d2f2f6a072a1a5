"""A corpus of small single-device language models written the way other projects write
them, each with its standard tensor-parallel plan (Megatron: vocab-parallel embedding,
colwise q/k/v and up projections, rowwise output and down projections, colwise head with
replicated logits) and torchtitan's sequence-parallel plan (norms on sequence shards, layer
inputs gathered on entry, rowwise outputs reduce-scattered back).
``tests/model_code/test_corpus.py`` checks each against the single-device model.

Everything is tiny (2 layers, hidden 32, 8 heads and 4 KV heads unless noted, vocab 128,
no dropout) and built from seeds: nothing is downloaded.

* Llama-style models sharing one block, with rotary embeddings written four ways, as
  torchtune, Hugging Face, Meta (complex numbers) and GPT-J / Cohere write them.
* GPT-2 (``tests/helpers/transformer_models.py``) and nanoGPT (fused ``c_attn``, tied head, loss
  inside ``forward``).
* Hugging Face ``*ForCausalLM`` models from small random configs: Llama, Qwen2, Qwen3,
  Mistral, Gemma2, Phi3, OLMo2, Granite, Starcoder2, Cohere, GPT-NeoX (tied variants as
  shipped), with plans written for each family's FQNs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxtp import (ColwiseParallel, PrepareModuleInput, Replicate, RowwiseParallel,
                  SequenceParallel, Shard)
from fxtp.examples.llama import (FeedForward, RMSNorm, apply_rotary_emb_complex, llama_sp_plan,
                                 llama_tp_plan, precompute_freqs_cis, repeat_kv)
from tests.helpers import transformer_models as tm

L = 2
VOCAB = 128
TOKENS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))


# --- rotary embeddings, four ways ------------------------------------------------------
# Each is ``tables(head_dim, end) -> {buffer name: (end, ...) table}`` and
# ``apply(xq, xk, *tables[:seqlen]) -> (xq, xk)`` on (B, T, H, head_dim) queries and keys.

def _angles(head_dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    """(end, head_dim // 2): position times frequency."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    return torch.outer(torch.arange(end, dtype=torch.float32), inv_freq)


def torchtune_tables(head_dim, end):
    angles = _angles(head_dim, end)
    return {"rope_cache": torch.stack([angles.cos(), angles.sin()], dim=-1)}  # (T, D/2, 2)


def torchtune_rope(xq, xk, rope_cache):
    """torchtune's ``RotaryPositionalEmbeddings.forward``: adjacent feature pairs
    ``(x0, x1)`` rotated by real arithmetic and stacked back."""
    def rotate(x):
        xshaped = x.float().unflatten(-1, (-1, 2))                    # (B, T, H, D/2, 2)
        cache = rope_cache.view(-1, xshaped.size(1), 1, xshaped.size(3), 2)
        x0, x1 = xshaped[..., 0], xshaped[..., 1]
        cos, sin = cache[..., 0], cache[..., 1]
        x_out = torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], -1).flatten(3)
        return x_out.type_as(x)
    return rotate(xq), rotate(xk)


def hf_tables(head_dim, end):
    angles = _angles(head_dim, end)
    emb = torch.cat((angles, angles), dim=-1)                         # (T, D)
    return {"cos": emb.cos(), "sin": emb.sin()}


def rotate_half(x):
    """Hugging Face's: the two halves of the head dim, swapped and one negated."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def hf_rope(xq, xk, cos, sin):
    """Hugging Face's ``apply_rotary_pos_emb`` (here on (B, T, H, D): unsqueeze the head
    dim)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (xq * cos) + (rotate_half(xq) * sin), (xk * cos) + (rotate_half(xk) * sin)


def complex_tables(head_dim, end):
    return {"freqs_cis": precompute_freqs_cis(head_dim, end)}        # (T, D/2) complex64


def complex_rope(xq, xk, freqs_cis):
    """Meta's: ``view_as_complex`` pairs times the complex table, ``view_as_real`` back."""
    return apply_rotary_emb_complex(xq, xk, freqs_cis)


def gptj_tables(head_dim, end):
    angles = _angles(head_dim, end)
    return {"sin": angles.sin(), "cos": angles.cos()}                # (T, D/2)


def rotate_every_two(x):
    """GPT-J's (Cohere's ``rotate_half``): interleaved pairs by strided slicing."""
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def gptj_rope(xq, xk, sin, cos):
    """GPT-J's ``apply_rotary_pos_emb``: each angle repeated for its pair."""
    sin = torch.repeat_interleave(sin[None, :, None, :], 2, 3)
    cos = torch.repeat_interleave(cos[None, :, None, :], 2, 3)
    return tuple((x * cos) + (rotate_every_two(x) * sin) for x in (xq, xk))


@dataclass(frozen=True)
class Rope:
    tables: Callable[[int, int], dict]
    apply: Callable


ROPES = {
    "torchtune": Rope(torchtune_tables, torchtune_rope),
    "hf_rotate_half": Rope(hf_tables, hf_rope),
    "complex": Rope(complex_tables, complex_rope),
    "gptj_interleaved": Rope(gptj_tables, gptj_rope),
}


# --- one Llama block, parameterized by its rotary embedding ----------------------------
# Meta's module names, so fxtp.examples.llama's llama_tp_plan() and llama_sp_plan() apply as is.

class Attention(nn.Module):
    """Grouped-query attention with global head counts in ``view``."""

    def __init__(self, dim, n_heads, n_kv_heads, rope: Callable):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.rope = n_heads, n_kv_heads, rope
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, freqs):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xq, xk = self.rope(xq, xk, *freqs)
        n_rep = self.n_heads // self.n_kv_heads
        xk, xv = repeat_kv(xk, n_rep), repeat_kv(xv, n_rep)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2),
                                             xv.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bsz, seqlen, -1))


class Block(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, rope):
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, n_heads, n_kv_heads, rope)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, multiple_of=16)

    def forward(self, x, freqs):
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))


class RopeLlama(nn.Module):
    """Llama-3 with the rotary embedding ``rope`` (a key of :data:`ROPES`)."""

    def __init__(self, rope: str, dim=32, n_layers=L, n_heads=8, n_kv_heads=4,
                 vocab_size=VOCAB, max_seq_len=32):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, n_kv_heads, ROPES[rope].apply)
                                    for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        tables = ROPES[rope].tables(dim // n_heads, max_seq_len)
        for name, table in tables.items():
            self.register_buffer(name, table, persistent=False)
        self.table_names = tuple(tables)

    def forward(self, tokens):
        seqlen = tokens.shape[1]
        freqs = tuple(getattr(self, name)[:seqlen] for name in self.table_names)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, freqs)
        return self.output(self.norm(h))


# --- GPT-2 (tests/helpers/transformer_models.py; LM head tied to wte) ----------------------------

def gpt2_tp_plan():
    return {"wte": RowwiseParallel(input_layouts=Replicate()), **tm.gpt2_layer_plan(),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}


def gpt2():
    return tm.GPT2(tm.GPT2Config(vocab_size=VOCAB))


# --- nanoGPT (Karpathy's model.py: fused c_attn, wte tied to lm_head, loss inside) ---------

class NanoAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head, self.n_embd = n_head, n_embd
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class NanoMLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class NanoBlock(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = NanoAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = NanoMLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's ``GPT``: ``forward(idx, targets)`` returns ``(logits, loss)``."""

    def __init__(self, vocab_size=VOCAB, block_size=32, n_layer=L, n_head=4, n_embd=32):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList(NanoBlock(n_embd, n_head) for _ in range(n_layer)),
            ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx, targets):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def nanogpt_plan():
    """A user's plan for nanoGPT: Megatron's layer plan, the head colwise with its logits
    left sharded (loss parallel); the tied embedding is left out and follows the head."""
    return {"transformer.h.*.attn.c_attn": ColwiseParallel(),
            "transformer.h.*.attn.c_proj": RowwiseParallel(),
            "transformer.h.*.mlp.c_fc": ColwiseParallel(),
            "transformer.h.*.mlp.c_proj": RowwiseParallel(),
            "lm_head": ColwiseParallel()}


# --- Hugging Face families ---------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS = 32, 8, 4


def _hf(config_name, model_name, expert_tp=False, **overrides):
    """A ``*ForCausalLM`` from a small random config: untied head, SDPA, no dropout;
    ``expert_tp``: its plan shards the experts (:func:`_with_expert_tp`)."""
    import transformers
    kwargs = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                  num_hidden_layers=L, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS,
                  max_position_embeddings=64, attention_dropout=0.0,
                  tie_word_embeddings=False, attn_implementation="sdpa",
                  bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    cfg = getattr(transformers, config_name)(**kwargs)
    return getattr(transformers, model_name)(_with_expert_tp(cfg) if expert_tp else cfg)


def shards_attention(model) -> bool:
    """Whether the Hugging Face ``model``'s own plan shards its attention (which some
    families' plans do only from some transformers release on)."""
    from fxtp.plans.huggingface import model_plan
    return any(".self_attn." in key for key in model_plan(model))


EXPERT_TP = {"layers.*.mlp.experts.gate_up_proj": "packed_colwise",
             "layers.*.mlp.experts.down_proj": "rowwise",
             "layers.*.mlp.experts": "moe_tp_experts"}
"""The experts' entries transformers' MoE plans carried up to 5.24."""


def _with_expert_tp(cfg):
    """``cfg`` with :data:`EXPERT_TP` in its plan where the plan shards no experts
    (transformers 5.25 moved them to the expert-parallel plan), so that the tests of
    ``moe_tp_experts`` test it whatever version is installed."""
    plan = getattr(type(cfg), "base_model_tp_plan", None) or {}
    if "moe_tp_experts" not in plan.values():
        cfg.base_model_tp_plan = {**plan, **EXPERT_TP}
    return cfg


def hf_llama():
    return _hf("LlamaConfig", "LlamaForCausalLM")


def hf_qwen2():
    return _hf("Qwen2Config", "Qwen2ForCausalLM")  # q, k, v with biases


def hf_mistral():
    return _hf("MistralConfig", "MistralForCausalLM", sliding_window=8)


def hf_gemma2():
    # Gemma2 refuses SDPA (attention logit soft-capping): eager attention, i.e. matmul,
    # soft-cap (tanh), mask, softmax, matmul on head shards. Sliding-window layers
    # alternate with full ones; embeddings scaled by sqrt(hidden); logits soft-capped.
    return _hf("Gemma2Config", "Gemma2ForCausalLM", attn_implementation="eager",
               sliding_window=8, query_pre_attn_scalar=HIDDEN // HEADS, pad_token_id=0)


def hf_phi3():
    # fused qkv_proj (sliced into q, k, v) and gate_up_proj (chunked); MHA, so the q, k,
    # v slices are equal thirds
    return _hf("Phi3Config", "Phi3ForCausalLM", num_key_value_heads=HEADS, pad_token_id=0,
               resid_pdrop=0.0, embd_pdrop=0.0)


def hf_olmo2():
    return _hf("Olmo2Config", "Olmo2ForCausalLM", pad_token_id=0)


def hf_cohere():
    return _hf("CohereConfig", "CohereForCausalLM", pad_token_id=0)


def hf_qwen3():
    return _hf("Qwen3Config", "Qwen3ForCausalLM")  # q_norm / k_norm per head


def hf_granite():
    # scales embeddings, attention, residuals and logits by config multipliers
    return _hf("GraniteConfig", "GraniteForCausalLM", embedding_multiplier=2.0,
               attention_multiplier=0.3, residual_multiplier=0.5, logits_scaling=4.0,
               pad_token_id=0)


def hf_starcoder2(tie_word_embeddings=True):
    # LayerNorms with biases, c_fc / c_proj MLP with biases, q/k/v/o biases; tied head
    return _hf("Starcoder2Config", "Starcoder2ForCausalLM", residual_dropout=0.0,
               embedding_dropout=0.0, pad_token_id=0, tie_word_embeddings=tie_word_embeddings)


def hf_gemma2_tied():
    """Gemma2 as shipped: the head tied to the embedding."""
    return _hf("Gemma2Config", "Gemma2ForCausalLM", attn_implementation="eager",
               sliding_window=8, query_pre_attn_scalar=HIDDEN // HEADS, pad_token_id=0,
               tie_word_embeddings=True)


def hf_cohere_tied():
    """Cohere as shipped: the head tied to the embedding, logits scaled."""
    return _hf("CohereConfig", "CohereForCausalLM", pad_token_id=0, tie_word_embeddings=True,
               logit_scale=0.5)


def hf_gemma3():
    """Gemma-3 (text): q_norm / k_norm per head, norms in fp32 (``1 + weight.float()``),
    sliding-window and global layers in a pattern of its own, tied head."""
    return _hf("Gemma3TextConfig", "Gemma3ForCausalLM", attn_implementation="eager",
               sliding_window=8, query_pre_attn_scalar=HIDDEN // HEADS, pad_token_id=0)


def hf_mixtral():
    """Mixtral: a mixture of 4 experts (2 per token) stored as 3-D weights, routed through
    transformers' traceable grouped-matmul implementation (no fp64 kernel: run it in
    fp32)."""
    return _hf("MixtralConfig", "MixtralForCausalLM", expert_tp=True, num_local_experts=4,
               num_experts_per_tok=2, pad_token_id=0)


def hf_qwen3_moe():
    """Qwen3-MoE: 4 experts of intermediate size 32, q_norm / k_norm per head; its plan
    also names the dense MLPs of the layers a config may leave dense (none here)."""
    return _hf("Qwen3MoeConfig", "Qwen3MoeForCausalLM", expert_tp=True, num_experts=4,
               num_experts_per_tok=2, moe_intermediate_size=32, pad_token_id=0)


def hf_phimoe():
    """PhiMoE: 4 experts, routed in training by sparsemixer, which samples experts (Gumbel)
    and scales their weights through a custom ``autograd.Function`` whose backward ignores
    the mask it applied (straight through); transformers' ``batched_mm`` experts, which have
    an fp64 kernel."""
    model = _hf("PhimoeConfig", "PhimoeForCausalLM", expert_tp=True, num_local_experts=4,
                num_experts_per_tok=2, pad_token_id=0)
    model.set_experts_implementation("batched_mm")
    return model


def hf_llama4():
    """Llama 4 (text): a shared expert beside 4 routed ones whose weights are stored
    (experts, in, out) and multiplied by ``bmm``; the router scales the experts' inputs."""
    return _hf("Llama4TextConfig", "Llama4ForCausalLM", num_local_experts=4,
               intermediate_size_mlp=64, pad_token_id=0)


def hf_deepseek_v2():
    """DeepSeek-V2: multi-head latent attention (q and kv projected down to latents, each
    normed and projected up per head; a rotary key part shared by every head) and 4
    experts of intermediate size 32 plus a shared one after a dense first layer."""
    return _hf("DeepseekV2Config", "DeepseekV2ForCausalLM", expert_tp=True,
               num_key_value_heads=HEADS, q_lora_rank=16, kv_lora_rank=16,
               qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, n_routed_experts=4,
               num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
               first_k_dense_replace=1, n_group=1, topk_group=1, pad_token_id=0)


def hf_jamba():
    """Jamba: a Mamba layer, then an attention layer; 4 experts. Without its CUDA kernels
    the Mamba scan loops over the sequence in Python."""
    return _hf("JambaConfig", "JambaForCausalLM", attn_layer_period=2, attn_layer_offset=1,
               num_experts=4, num_experts_per_tok=2, pad_token_id=0)


def hf_aria_text():
    """Aria's text model: 4 experts and a shared one; its grouped matmul's sizes make
    torch.export assume of the sequence length what its range alone does not prove."""
    return _hf("AriaTextConfig", "AriaTextForCausalLM", moe_num_experts=4, moe_topk=2,
               moe_num_shared_experts=1, pad_token_id=0)


def hf_qwen3_next():
    """Qwen3-Next: a gated delta-net (linear attention: a short convolution and a
    recurrent state per head) layer, then a full-attention one; 4 experts."""
    return _hf("Qwen3NextConfig", "Qwen3NextForCausalLM", num_experts=4,
               layer_types=["linear_attention", "full_attention"],
               num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=32, linear_num_key_heads=4,
               linear_num_value_heads=8, linear_key_head_dim=4, linear_value_head_dim=4,
               pad_token_id=0)


def hf_gpt_oss():
    """gpt-oss: experts with biases and gate and up interleaved (``gate_up[..., ::2]``,
    ``[..., 1::2]``) added to in place, attention sinks per head, sliding-window layers;
    eager attention (it refuses SDPA). Its config carries no tensor-parallel plan."""
    return _hf("GptOssConfig", "GptOssForCausalLM", attn_implementation="eager",
               num_local_experts=4, num_experts_per_tok=2, sliding_window=8, pad_token_id=0)


def hf_hunyuan_dense(**overrides):
    """HunYuan dense: its config carries no layer plan, its head class a plan for
    ``lm_head`` alone."""
    return _hf("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", pad_token_id=0,
               **overrides)


def hf_gpt_neox():
    # head dim 8: a quarter of it rotary (the default partial_rotary_factor), 2 features
    import transformers
    cfg = transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=L,
        num_attention_heads=4, max_position_embeddings=64, attention_dropout=0.0,
        hidden_dropout=0.0, tie_word_embeddings=False, attn_implementation="sdpa",
        bos_token_id=1, eos_token_id=2)
    return transformers.GPTNeoXForCausalLM(cfg)


def hf_tp_plan(qkv="[qkv]_proj", mlp_in="[gu][ap]*_proj"):
    """Megatron's plan in the FQNs of the Llama-like families (``config.base_model_tp_plan``
    plus the embedding and the head)."""
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        f"model.layers.*.self_attn.{qkv}": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(),
        f"model.layers.*.mlp.{mlp_in}": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }


def hf_sp_plan(norms, qkv="[qkv]_proj", mlp_in="[gu][ap]*_proj"):
    """torchtitan's plan in the FQNs of the Llama-like families; ``norms`` are the layer's
    norms on the residual stream (the family's own set)."""
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                              output_layouts=Shard(1)),
        "model.norm": SequenceParallel(),
        **{f"model.layers.*.{norm}": SequenceParallel() for norm in norms},
        "model.layers.*.self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "model.layers.*.mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                                 desired_input_layouts=(Replicate(),)),
        f"model.layers.*.self_attn.{qkv}": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        f"model.layers.*.mlp.{mlp_in}": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


PRE_NORMS = ("input_layernorm", "post_attention_layernorm")


def gpt_neox_tp_plan():
    return {
        "gpt_neox.embed_in": RowwiseParallel(input_layouts=Replicate()),
        "gpt_neox.layers.*.attention.query_key_value": ColwiseParallel(),
        "gpt_neox.layers.*.attention.dense": RowwiseParallel(),
        "gpt_neox.layers.*.mlp.dense_h_to_4h": ColwiseParallel(),
        "gpt_neox.layers.*.mlp.dense_4h_to_h": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }


def gpt_neox_sp_plan():
    return {
        "gpt_neox.embed_in": RowwiseParallel(input_layouts=Replicate(),
                                             output_layouts=Shard(1)),
        "gpt_neox.final_layer_norm": SequenceParallel(),
        "gpt_neox.layers.*.input_layernorm": SequenceParallel(),
        "gpt_neox.layers.*.post_attention_layernorm": SequenceParallel(),
        "gpt_neox.layers.*.attention": PrepareModuleInput(input_layouts=(Shard(1),),
                                                          desired_input_layouts=(Replicate(),)),
        "gpt_neox.layers.*.mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                                    desired_input_layouts=(Replicate(),)),
        "gpt_neox.layers.*.attention.query_key_value": ColwiseParallel(),
        "gpt_neox.layers.*.attention.dense": RowwiseParallel(output_layouts=Shard(1)),
        "gpt_neox.layers.*.mlp.dense_h_to_4h": ColwiseParallel(),
        "gpt_neox.layers.*.mlp.dense_4h_to_h": RowwiseParallel(output_layouts=Shard(1)),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


# --- the corpus ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Entry:
    """One model: ``make()`` builds it (seeded by the caller), ``plans`` maps "tp" / "sp"
    to a function returning the plan, ``hf`` says it is a Hugging Face model (called with
    ``use_cache=False``, compared on ``.logits``). ``fp32_inside`` marks models that compute
    sums in fp32 whatever their dtype (``.float()`` inside their norms) over a dim a plan
    shards: the ranks' partial sums are added in another order than the single device's,
    so results differ by fp32 rounding even in an fp64 model."""

    make: Callable[[], nn.Module]
    plans: dict
    hf: bool = False
    fp32_inside: bool = False


def _rope_llama(rope):
    return Entry(lambda: RopeLlama(rope), {"tp": llama_tp_plan, "sp": llama_sp_plan})


def _hf_entry(make, norms=PRE_NORMS, fp32_inside=False, **names):
    return Entry(make, {"tp": lambda: hf_tp_plan(**names),
                        "sp": lambda: hf_sp_plan(norms, **names)}, hf=True,
                 fp32_inside=fp32_inside)


CORPUS: dict[str, Entry] = {
    "llama_rope_torchtune": _rope_llama("torchtune"),
    "llama_rope_hf_rotate_half": _rope_llama("hf_rotate_half"),
    "llama_rope_complex": _rope_llama("complex"),
    "llama_rope_gptj_interleaved": _rope_llama("gptj_interleaved"),
    "gpt2": Entry(gpt2, {"tp": gpt2_tp_plan, "sp": tm.gpt2_sp_plan}),
    "hf_llama": _hf_entry(hf_llama),
    "hf_qwen2": _hf_entry(hf_qwen2),
    "hf_mistral": _hf_entry(hf_mistral),
    # Gemma2RMSNorm scales by ``1 + weight.float()``: fp32 inside
    "hf_gemma2": _hf_entry(hf_gemma2, norms=("input_layernorm", "post_attention_layernorm",
                                             "pre_feedforward_layernorm",
                                             "post_feedforward_layernorm"), fp32_inside=True),
    "hf_phi3": _hf_entry(hf_phi3, qkv="qkv_proj", mlp_in="gate_up_proj"),
    # post-norm: the norms act on the sublayers' outputs; q_norm / k_norm (over the full
    # projected q / k, i.e. across heads) are left to fxtp
    # (in fp32: Olmo2RMSNorm casts its input to fp32, so the sum of squares across the
    # heads' shards is an fp32 sum)
    "hf_olmo2": _hf_entry(hf_olmo2, norms=("post_attention_layernorm",
                                           "post_feedforward_layernorm"), fp32_inside=True),
    # parallel block: one input_layernorm feeds attention and MLP; CohereLayerNorm
    # computes in fp32 (``weight.to(torch.float32) * x.to(torch.float32)``)
    "hf_cohere": _hf_entry(hf_cohere, norms=("input_layernorm",), fp32_inside=True),
    "hf_gpt_neox": Entry(hf_gpt_neox, {"tp": gpt_neox_tp_plan, "sp": gpt_neox_sp_plan},
                         hf=True),
}


def call_kwargs(entry: Entry) -> dict:
    return {"use_cache": False} if entry.hf else {}


def logits(entry: Entry):
    return (lambda out: out.logits) if entry.hf else (lambda out: out)


def tp_counts(bwd_all_reduce=2 * L + 1, fwd_all_reduce=2 * L + 1):
    """Megatron TP of an L-layer LM. Forward: 2 all-reduces per layer (the attention's
    and the MLP's rowwise outputs), 1 for the vocab-parallel embedding's partial sum, and
    the all-gather of the colwise head's logits (``output_layouts=Replicate()``).
    Backward: each replicated activation read by colwise projections gets one all-reduce
    of its gradient (Megatron's ``f``): 2 per layer (the attention's and the MLP's input)
    and the final norm's output into the head; the logits gather's backward is a local
    chunk and the embedding's all-reduce has an identity backward."""
    return ({"all_reduce": fwd_all_reduce, "all_gather": 1}, {"all_reduce": bwd_all_reduce})
