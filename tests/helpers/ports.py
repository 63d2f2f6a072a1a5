"""Language and vision models written the way other projects write them, beyond Hugging
Face (``tests/helpers/corpus.py``): litgpt (query groups interleaved in one fused projection),
mistral-inference (packed tokens with no batch dim, ``repeat_interleave`` for grouped-query
heads, ``einsum`` attention), OLMo-1 (fused q / k / v of unequal sizes, fused SwiGLU taken
apart by ``chunk``) and minGPT (a causal mask buffer, attention by hand), each with the plan
its authors would write from torch's styles. Tiny (2 layers, dim 32, 4 heads, 2 KV
groups where grouped) and seeded by the caller: nothing is downloaded."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxtp import ColwiseParallel, RowwiseParallel

D, HEADS, GROUPS, VOCAB, L = 32, 4, 2, 96, 2
HEAD = D // HEADS


class RMSNorm(nn.Module):
    """litgpt's and mistral-inference's: computed in fp32, cast back."""

    def __init__(self, size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(torch.mean(x32 * x32, dim=-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, names=("w1", "w3", "w2"), hidden=64):
        super().__init__()
        self.names = names
        gate, up, down = names
        self.add_module(gate, nn.Linear(D, hidden, bias=False))
        self.add_module(up, nn.Linear(D, hidden, bias=False))
        self.add_module(down, nn.Linear(hidden, D, bias=False))

    def forward(self, x):
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(F.silu(gate(x)) * up(x))


class Stack(nn.Module):
    """Embedding, pre-norm blocks ``attention`` / ``mlp``, final norm, head."""

    def __init__(self, attention, mlp, norm=RMSNorm):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(norm_1=norm(D), attn=attention(),
                                                       norm_2=norm(D), mlp=mlp()))
                                    for _ in range(L))
        self.norm = norm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = x + b.attn(b.norm_1(x))
            x = x + b.mlp(b.norm_2(x))
        return self.head(self.norm(x))


# --- litgpt --------------------------------------------------------------------------------

def _rope(x, cos, sin):
    half = x.size(-1) // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class LitAttention(nn.Module):
    """litgpt's ``CausalSelfAttention``: one ``attn`` projection laid out per query group
    as ``[q ... q | k | v]``, viewed as ``(groups, q_per_kv + 2, head)`` and split there."""

    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(D, (HEADS + 2 * GROUPS) * HEAD, bias=False)
        self.proj = nn.Linear(D, D, bias=False)
        angles = torch.outer(torch.arange(32).float(),
                             1.0 / 10000 ** (torch.arange(0, HEAD, 2).float() / HEAD))
        self.register_buffer("cos", angles.repeat(1, 2).cos(), persistent=False)
        self.register_buffer("sin", angles.repeat(1, 2).sin(), persistent=False)

    def forward(self, x):
        B, T, C = x.size()
        q_per_kv = HEADS // GROUPS
        qkv = self.attn(x).view(B, T, GROUPS, q_per_kv + 2, HEAD).permute(0, 2, 3, 1, 4)
        q, k, v = qkv.split((q_per_kv, 1, 1), dim=2)
        k = k.expand(B, GROUPS, q_per_kv, T, HEAD)
        v = v.expand(B, GROUPS, q_per_kv, T, HEAD)
        q, k, v = (t.reshape(B, -1, T, HEAD) for t in (q, k, v))
        cos, sin = self.cos[:T], self.sin[:T]
        y = F.scaled_dot_product_attention(_rope(q, cos, sin), _rope(k, cos, sin), v,
                                           is_causal=True, scale=1.0 / math.sqrt(HEAD))
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


def litgpt():
    return Stack(LitAttention, lambda: SwiGLU(("fc_1", "fc_2", "proj")))


LITGPT_PLAN = {"blocks.*.attn.attn": ColwiseParallel(), "blocks.*.attn.proj": RowwiseParallel(),
               "blocks.*.mlp.fc_[12]": ColwiseParallel(), "blocks.*.mlp.proj": RowwiseParallel()}


# --- mistral-inference ---------------------------------------------------------------------

class MistralAttention(nn.Module):
    """mistral-inference's ``Attention`` on packed tokens ``(tokens, dim)``: key and value
    heads repeated by ``repeat_interleave``, scores and output by ``einsum``."""

    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(D, HEADS * HEAD, bias=False)
        self.wk = nn.Linear(D, GROUPS * HEAD, bias=False)
        self.wv = nn.Linear(D, GROUPS * HEAD, bias=False)
        self.wo = nn.Linear(HEADS * HEAD, D, bias=False)

    def forward(self, x):
        n = x.shape[0]
        q = self.wq(x).view(n, HEADS, HEAD)
        k = torch.repeat_interleave(self.wk(x).view(n, GROUPS, HEAD), HEADS // GROUPS, dim=1)
        v = torch.repeat_interleave(self.wv(x).view(n, GROUPS, HEAD), HEADS // GROUPS, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * HEAD ** -0.5
        mask = torch.full((n, n), float("-inf"), dtype=x.dtype).triu(1)
        out = torch.einsum("hqk,khd->qhd", torch.softmax(scores + mask, -1), v)
        return self.wo(out.reshape(n, -1))


def mistral_inference():
    return Stack(MistralAttention, SwiGLU)


MISTRAL_PLAN = {"blocks.*.attn.w[qkv]": ColwiseParallel(), "blocks.*.attn.wo": RowwiseParallel(),
                "blocks.*.mlp.w[13]": ColwiseParallel(), "blocks.*.mlp.w2": RowwiseParallel()}


# --- OLMo-1 ----------------------------------------------------------------------------------

class OlmoAttention(nn.Module):
    """OLMo-1's fused ``att_proj`` split in q, k, v of unequal sizes (grouped-query)."""

    def __init__(self):
        super().__init__()
        self.fused_dims = (D, GROUPS * HEAD, GROUPS * HEAD)
        self.att_proj = nn.Linear(D, sum(self.fused_dims), bias=False)
        self.attn_out = nn.Linear(D, D, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.att_proj(x).split(self.fused_dims, dim=-1)
        q, k, v = (t.view(B, T, -1, HEAD).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.attn_out(y.transpose(1, 2).contiguous().view(B, T, C))


class OlmoMLP(nn.Module):
    """OLMo-1's fused ``ff_proj`` taken apart by ``chunk``."""

    def __init__(self, hidden=64):
        super().__init__()
        self.ff_proj = nn.Linear(D, 2 * hidden, bias=False)
        self.ff_out = nn.Linear(hidden, D, bias=False)

    def forward(self, x):
        h, gate = self.ff_proj(x).chunk(2, dim=-1)
        return self.ff_out(F.silu(gate) * h)


def olmo():
    return Stack(OlmoAttention, OlmoMLP,
                 norm=lambda size: nn.LayerNorm(size, elementwise_affine=False))


OLMO_PLAN = {"blocks.*.attn.att_proj": ColwiseParallel(),
             "blocks.*.attn.attn_out": RowwiseParallel(),
             "blocks.*.mlp.ff_proj": ColwiseParallel(), "blocks.*.mlp.ff_out": RowwiseParallel()}


# --- minGPT ----------------------------------------------------------------------------------

class MinAttention(nn.Module):
    """minGPT's ``CausalSelfAttention``: fused ``c_attn`` split in three, attention by hand
    under a ``tril`` mask buffer."""

    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(D, 3 * D)
        self.c_proj = nn.Linear(D, D)
        self.register_buffer("bias", torch.tril(torch.ones(32, 32)).view(1, 1, 32, 32))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = (t.view(B, T, HEADS, HEAD).transpose(1, 2)
                   for t in self.c_attn(x).split(D, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = F.softmax(att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf")), dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))


class MinMLP(nn.Module):
    """minGPT's MLP with its ``NewGELU`` written out."""

    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(D, 4 * D)
        self.c_proj = nn.Linear(4 * D, D)

    def forward(self, x):
        h = self.c_fc(x)
        h = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h ** 3)))
        return self.c_proj(h)


def mingpt():
    return Stack(MinAttention, MinMLP, norm=nn.LayerNorm)


MINGPT_PLAN = {"blocks.*.attn.c_attn": ColwiseParallel(),
               "blocks.*.attn.c_proj": RowwiseParallel(),
               "blocks.*.mlp.c_fc": ColwiseParallel(), "blocks.*.mlp.c_proj": RowwiseParallel()}


PORTS = {"litgpt": (litgpt, LITGPT_PLAN), "mistral_inference": (mistral_inference, MISTRAL_PLAN),
         "olmo": (olmo, OLMO_PLAN), "mingpt": (mingpt, MINGPT_PLAN)}
