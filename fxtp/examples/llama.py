"""A small reference Llama-3 (RMSNorm computed in fp32, rotary embeddings written with real
cos/sin arithmetic, with complex numbers or with stacked pairs, grouped-query attention, SwiGLU,
untied head),
written as single-device code the way people write it, and its tensor-parallel plans.
fxtp's demo, benchmarks and tests train it; nothing in fxtp depends on it."""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from ..plans.styles import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel


@dataclass
class LlamaConfig:
    vocab_size: int = 64
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    multiple_of: int = 16
    max_seq_len: int = 32
    rope: str = "real"              # "real" (cos/sin, rotate_half), "complex" (polar) or
    #                                 "stack" (torchtune: rotated pairs stacked back)
    repeat_mode: str = "expand"     # "expand" (repeat_kv) or "repeat_interleave"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    ffn_dim_multiplier: Optional[float] = None  # Llama-3-8B: 1.3 (hidden 14336 at dim 4096)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x.float()).type_as(x) * self.weight


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0):
    """Meta's complex rotary table: (end, dim // 2) complex64."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    freqs = torch.outer(torch.arange(end, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb_complex(xq, xk, freqs_cis):
    """Meta's rotary embedding on (B, T, H, D); ``freqs_cis`` is (T, D // 2)."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def precompute_cos_sin(dim: int, end: int, theta: float = 10000.0):
    """HF's real rotary tables: cos, sin of shape (end, dim)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(end, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def precompute_pair_cos_sin(dim: int, end: int, theta: float = 10000.0):
    """torchtune's rotary tables: cos, sin of shape (end, dim // 2), one per pair."""
    freqs = precompute_freqs_cis(dim, end, theta)
    return freqs.real.contiguous(), freqs.imag.contiguous()


def apply_rotary_emb_stack(xq, xk, cos, sin):
    """torchtune's rotary embedding on (B, T, H, D): each pair ``(x0, x1)`` of the last dim
    is rotated and the pairs are stacked back; ``cos``/``sin`` are (T, D // 2). The same
    function as :func:`apply_rotary_emb_complex`, written without complex numbers."""
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x):
        x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], -1).flatten(3).type_as(x)
    return rotate(xq), rotate(xk)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_emb_real(xq, xk, cos, sin):
    """HF-style rotary embedding on (B, T, H, D); ``cos``/``sin`` are (T, D)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return xq * cos + rotate_half(xq) * sin, xk * cos + rotate_half(xk) * sin


def repeat_kv(x, n_rep: int):
    """torch.repeat_interleave(x, dim=2, repeats=n_rep), as in Meta's llama code."""
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (x[:, :, :, None, :]
            .expand(bs, slen, n_kv_heads, n_rep, head_dim)
            .reshape(bs, slen, n_kv_heads * n_rep, head_dim))


class LlamaAttention(nn.Module):
    """Grouped-query attention with rotary embeddings; global head counts in ``view``."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.n_rep = cfg.n_heads // cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.rope, self.repeat_mode = cfg.rope, cfg.repeat_mode
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x, freqs):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        if self.rope == "complex":
            xq, xk = apply_rotary_emb_complex(xq, xk, freqs)
        elif self.rope == "stack":
            xq, xk = apply_rotary_emb_stack(xq, xk, *freqs)
        else:
            xq, xk = apply_rotary_emb_real(xq, xk, *freqs)
        if self.repeat_mode == "repeat_interleave":
            xk = torch.repeat_interleave(xk, self.n_rep, dim=2)
            xv = torch.repeat_interleave(xv, self.n_rep, dim=2)
        else:
            xk, xv = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        q, k, v = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bsz, seqlen, -1))


class FeedForward(nn.Module):
    """SwiGLU; hidden size as in Meta's code (2/3 of 4*dim, times ffn_dim_multiplier,
    rounded up to multiple_of)."""

    def __init__(self, dim: int, multiple_of: int, ffn_dim_multiplier: Optional[float] = None):
        super().__init__()
        hidden = int(2 * (4 * dim) / 3)
        if ffn_dim_multiplier is not None:
            hidden = int(ffn_dim_multiplier * hidden)
        hidden = multiple_of * ((hidden + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = LlamaAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.multiple_of, cfg.ffn_dim_multiplier)

    def forward(self, x, freqs):
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Llama-3: RMSNorm, GQA, rotary (``cfg.rope``), SwiGLU, untied output head."""

    def __init__(self, cfg: LlamaConfig = None):
        super().__init__()
        cfg = cfg or LlamaConfig()
        assert cfg.rope in ("real", "complex", "stack")
        assert cfg.repeat_mode in ("expand", "repeat_interleave")
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        head_dim = cfg.dim // cfg.n_heads
        if cfg.rope == "complex":
            self.register_buffer("freqs_cis", precompute_freqs_cis(
                head_dim, cfg.max_seq_len, cfg.rope_theta), persistent=False)
        else:
            cos, sin = self._cos_sin(head_dim)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)

    def _cos_sin(self, head_dim):
        cfg = self.config
        tables = precompute_pair_cos_sin if cfg.rope == "stack" else precompute_cos_sin
        return tables(head_dim, cfg.max_seq_len, cfg.rope_theta)

    @torch.no_grad()
    def reset_parameters(self):
        """Recompute the rotary tables (a model built on the meta device has none)."""
        cfg = self.config
        head_dim = cfg.dim // cfg.n_heads
        if cfg.rope == "complex":
            self.freqs_cis.copy_(precompute_freqs_cis(head_dim, cfg.max_seq_len, cfg.rope_theta))
        else:
            for buffer, table in zip((self.cos, self.sin), self._cos_sin(head_dim)):
                buffer.copy_(table)

    def forward(self, tokens):
        _, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        if self.config.rope == "complex":
            freqs = self.freqs_cis[:seqlen]
        else:
            freqs = (self.cos[:seqlen], self.sin[:seqlen])
        for layer in self.layers:
            h = layer(h, freqs)
        return self.output(self.norm(h))


def llama_layer_plan():
    """Megatron's TP for the transformer layers: q, k, v and w1, w3 colwise; wo, w2 rowwise."""
    return {
        "layers.*.attention.w[qkv]": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(),
        "layers.*.feed_forward.w[13]": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(),
    }


def llama_tp_plan(loss_parallel=False):
    """The layers, a vocab-parallel embedding, and the head's output replicated or, for loss
    parallel, left sharded by class."""
    return {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()), **llama_layer_plan(),
            "output": ColwiseParallel(output_layouts=Shard(-1) if loss_parallel else Replicate())}


def llama_sp_plan(loss_parallel=False):
    """torchtitan's plan: sequence-parallel norms, layer inputs gathered on entry, rowwise
    outputs reduce-scattered back to sequence shards; the head's output replicated or, for
    loss parallel, left sharded by class."""
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1),
                                  output_layouts=Shard(-1) if loss_parallel else Replicate()),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                 desired_input_layouts=(Replicate(), None)),
        "layers.*.attention.w[qkv]": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                    desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.w[13]": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
