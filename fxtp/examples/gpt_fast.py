"""A gpt-fast-style Llama for serving, written as single-device code the way gpt-fast writes
it: ``forward(tokens, input_pos)``, one KV cache buffer pair per layer written in place at
``input_pos``, a causal mask and rotary table indexed by ``input_pos``, grouped-query
attention by ``repeat_interleave``, q, k and v from one fused ``wqkv`` split into unequal
parts ``[dim, kv, kv]`` (``fused_qkv=False``: three projections, torchtitan's layout); and
:func:`generate`, a prefill + decode loop that runs the original model and its
``fxtp.parallelize`` result alike.

fxtp's serving tests and benchmarks use it; nothing in fxtp depends on it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..plans.styles import ColwiseParallel, RowwiseParallel
from .llama import RMSNorm


@dataclass
class ServeConfig:
    vocab_size: int = 64
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    hidden: int = 64
    max_seq_len: int = 32
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    cache_update: str = "index_put"  # "index_put" (gpt-fast) or "index_copy" (HF StaticCache)
    fused_qkv: bool = True  # gpt-fast's one wqkv; False: wq, wk, wv


class KVCache(nn.Module):
    """(batch, kv heads, max_seq_len, head_dim) keys and values, written at ``input_pos``."""

    def __init__(self, batch: int, n_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype, update: str = "index_put", device=None):
        super().__init__()
        shape = (batch, n_kv_heads, max_seq_len, head_dim)
        self.update_mode = update
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device))

    def update(self, input_pos, k, v):
        if self.update_mode == "index_copy":
            self.k_cache.index_copy_(2, input_pos, k)
            self.v_cache.index_copy_(2, input_pos, v)
        else:
            self.k_cache[:, :, input_pos] = k
            self.v_cache[:, :, input_pos] = v
        return self.k_cache, self.v_cache


def precompute_freqs_cis(seq_len: int, head_dim: int, theta: float) -> torch.Tensor:
    """gpt-fast's rotary table: (seq_len, head_dim // 2, 2) cos and sin."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    return torch.stack([freqs.cos(), freqs.sin()], dim=-1)


def apply_rotary_emb(x, freqs_cis):
    """x: (B, T, H, D); freqs_cis: (T, D // 2, 2)."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    f = freqs_cis.view(1, xs.size(1), 1, xs.size(3), 2)
    out = torch.stack([xs[..., 0] * f[..., 0] - xs[..., 1] * f[..., 1],
                       xs[..., 1] * f[..., 0] + xs[..., 0] * f[..., 1]], -1)
    return out.flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ServeConfig):
        super().__init__()
        self.n_head, self.n_local_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim, self.dim = cfg.dim // cfg.n_heads, cfg.dim
        kv = cfg.n_kv_heads * self.head_dim
        if cfg.fused_qkv:
            self.wqkv = nn.Linear(cfg.dim, cfg.dim + 2 * kv, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
            self.wk = nn.Linear(cfg.dim, kv, bias=False)
            self.wv = nn.Linear(cfg.dim, kv, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.kv_cache: Optional[KVCache] = None

    def forward(self, x, freqs_cis, mask, input_pos):
        bsz, seqlen, _ = x.shape
        if hasattr(self, "wqkv"):
            kv = self.n_local_heads * self.head_dim
            q, k, v = self.wqkv(x).split([self.dim, kv, kv], dim=-1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = q.view(bsz, seqlen, self.n_head, self.head_dim)
        k = k.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = self.kv_cache.update(input_pos, k, v)
        k = k.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        v = v.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        return self.wo(y.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim))


class FeedForward(nn.Module):
    def __init__(self, cfg: ServeConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ServeConfig):
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, input_pos, freqs_cis, mask):
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """``forward(tokens (B, T), input_pos (T,))`` -> logits (B, T, vocab); call
    :meth:`setup_caches` first."""

    def __init__(self, cfg: ServeConfig = None):
        super().__init__()
        self.config = cfg = cfg or ServeConfig()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def setup_caches(self, max_batch_size: int, max_seq_len: Optional[int] = None):
        cfg = self.config
        max_seq_len = max_seq_len or cfg.max_seq_len
        head_dim = cfg.dim // cfg.n_heads
        device, dtype = self.output.weight.device, self.output.weight.dtype
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(max_batch_size, cfg.n_kv_heads, max_seq_len,
                                               head_dim, dtype, cfg.cache_update, device)
        self.register_buffer("freqs_cis", precompute_freqs_cis(
            max_seq_len, head_dim, cfg.rope_theta).to(device), persistent=False)
        self.register_buffer("causal_mask", torch.tril(torch.ones(
            max_seq_len, max_seq_len, dtype=torch.bool, device=device)), persistent=False)
        return self

    def forward(self, tokens, input_pos):
        mask = self.causal_mask[None, None, input_pos]
        freqs_cis = self.freqs_cis[input_pos]
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, input_pos, freqs_cis, mask)
        return self.output(self.norm(x))


def tp_plan():
    """gpt-fast's ``tp.py`` as a plan: heads (q, k, v: fused or not) and the FFN hidden
    dim sharded, one all-reduce after attention and one after the FFN; embedding and head
    replicated."""
    return {
        "layers.*.attention.w[qkv]*": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(),
        "layers.*.feed_forward.w[13]": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(),
    }


def sample(logits, temperature: float = 0.0, top_k: Optional[int] = None,
           generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """The next token of each row of ``logits`` (B, vocab): greedy at ``temperature`` 0,
    else drawn from the tempered (top-k) distribution with ``generator``."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits.float(), -1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model, prompt: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: Optional[int] = None, generator: Optional[torch.Generator] = None,
             decode=None) -> torch.Tensor:
    """``prompt`` (B, T) followed by ``max_new_tokens`` tokens: one prefill call of
    ``model(prompt, arange(T))``, then one ``decode(token, input_pos)`` call per token
    (``decode`` defaults to ``model``; pass a compiled ``model`` to compile decoding)."""
    decode = model if decode is None else decode
    batch, length = prompt.shape
    positions = torch.arange(length + max_new_tokens, device=prompt.device)
    tokens = [prompt]
    logits = model(prompt, positions[:length])
    for i in range(max_new_tokens):
        token = sample(logits[:, -1], temperature, top_k, generator)[:, None]
        tokens.append(token)
        if i + 1 < max_new_tokens:
            logits = decode(token, positions[length + i: length + i + 1])
    return torch.cat(tokens, 1)
