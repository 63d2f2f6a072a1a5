"""Language and vision models written the way other projects write them, beyond Hugging
Face (``tests/helpers/corpus.py``): litgpt (query groups interleaved in one fused projection),
mistral-inference (packed tokens with no batch dim, ``repeat_interleave`` for grouped-query
heads, ``einsum`` attention), OLMo-1 (fused q / k / v of unequal sizes, fused SwiGLU taken
apart by ``chunk``) and minGPT (a causal mask buffer, attention by hand), each with the plan
its authors would write from torch's styles; and two vision models with no plan, timm's
``VisionTransformer`` and DiT (adaptive layer norm from timesteps and labels), as their
authors write them (timm needs torchvision, whose CPU build no registry here serves).
Tiny (2 layers, dim 32, 4 heads, 2 KV groups where grouped) and seeded by the caller:
nothing is downloaded."""
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


# --- timm's VisionTransformer --------------------------------------------------------------

class TimmAttention(nn.Module):
    """timm's ``Attention``: one ``qkv`` viewed ``(B, N, 3, heads, head_dim)``, permuted with
    the three in front and ``unbind``-ed."""

    def __init__(self, dim=D, num_heads=HEADS):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.q_norm, self.k_norm = nn.Identity(), nn.Identity()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class TimmMlp(nn.Module):
    """timm's ``Mlp``."""

    def __init__(self, dim=D, hidden=4 * D, act=nn.GELU):
        super().__init__()
        self.fc1, self.act, self.norm, self.fc2 = (nn.Linear(dim, hidden), act(), nn.Identity(),
                                                   nn.Linear(hidden, dim))

    def forward(self, x):
        return self.fc2(self.norm(self.act(self.fc1(x))))


class TimmBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.attn, self.ls1 = nn.LayerNorm(D, eps=1e-6), TimmAttention(), nn.Identity()
        self.norm2, self.mlp, self.ls2 = nn.LayerNorm(D, eps=1e-6), TimmMlp(), nn.Identity()

    def forward(self, x):
        x = x + self.ls1(self.attn(self.norm1(x)))
        return x + self.ls2(self.mlp(self.norm2(x)))


class PatchEmbed(nn.Module):
    """timm's ``PatchEmbed``: a strided convolution, flattened to ``(B, patches, D)``."""

    def __init__(self, patch=8, channels=3, dim=D):
        super().__init__()
        self.proj = nn.Conv2d(channels, dim, kernel_size=patch, stride=patch)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class TimmViT(nn.Module):
    """timm's ``VisionTransformer`` (class token, learned positions, ``"token"`` pooling) on
    32 x 32 images in 8 x 8 patches."""

    def __init__(self, classes=10, image=32, patch=8):
        super().__init__()
        self.patch_embed = PatchEmbed(patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, D) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, D) * 0.02)
        self.blocks = nn.Sequential(*(TimmBlock() for _ in range(L)))
        self.norm, self.head = nn.LayerNorm(D, eps=1e-6), nn.Linear(D, classes)

    def forward(self, x):
        x = self.patch_embed(x)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


# --- DiT (Peebles and Xie's models.py, on timm's Attention and Mlp) -----------------------------

def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class TimestepEmbedder(nn.Module):
    """DiT's sinusoidal timestep features through a two-layer MLP."""

    def __init__(self, frequencies=16):
        super().__init__()
        self.frequencies = frequencies
        self.mlp = nn.Sequential(nn.Linear(frequencies, D), nn.SiLU(), nn.Linear(D, D))

    def forward(self, t):
        half = self.frequencies // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
        args = t[:, None].float() * freqs[None]
        embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(embedding.to(self.mlp[0].weight.dtype))


class DiTBlock(nn.Module):
    """Attention and MLP under adaptive layer norm: six modulations from the condition."""

    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.attn = TimmAttention()
        self.norm2 = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.mlp = TimmMlp(act=lambda: nn.GELU(approximate="tanh"))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(D, 6 * D))

    def forward(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = \
            self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        return x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp,
                                                             scale_mlp))


class FinalLayer(nn.Module):
    def __init__(self, patch, channels):
        super().__init__()
        self.norm_final = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(D, patch * patch * channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(D, 2 * D))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiT(nn.Module):
    """``DiT(x, t, y)``: noisy latents (B, 4, 16, 16) in 4 x 4 patches, float timesteps and
    class labels to the predicted noise; fixed sine-cosine positions."""

    def __init__(self, size=16, patch=4, channels=4, classes=10):
        super().__init__()
        self.patch, self.channels = patch, channels
        self.x_embedder = PatchEmbed(patch, channels)
        self.t_embedder = TimestepEmbedder()
        self.y_embedder = nn.Embedding(classes + 1, D)  # the last: no class (guidance)
        grid = torch.arange(size // patch, dtype=torch.float32)
        angles = grid[:, None] / 10000 ** (torch.arange(D // 4) / (D // 4))
        rows = torch.cat([angles.sin(), angles.cos()], 1)
        pos = torch.cat([rows[:, None].expand(-1, len(grid), -1),
                         rows[None].expand(len(grid), -1, -1)], -1).reshape(1, -1, D)
        self.register_buffer("pos_embed", pos)
        self.blocks = nn.ModuleList(DiTBlock() for _ in range(L))
        self.final_layer = FinalLayer(patch, channels)

    def forward(self, x, t, y):
        x = self.x_embedder(x) + self.pos_embed.to(x.dtype)
        c = self.t_embedder(t) + self.y_embedder(y)
        for block in self.blocks:
            x = block(x, c)
        x = self.final_layer(x, c)
        h = w = int(x.shape[1] ** 0.5)
        p, ch = self.patch, self.channels
        x = torch.einsum("nhwpqc->nchpwq", x.reshape(x.shape[0], h, w, p, p, ch))
        return x.reshape(x.shape[0], ch, h * p, w * p)


PORTS = {"litgpt": (litgpt, LITGPT_PLAN), "mistral_inference": (mistral_inference, MISTRAL_PLAN),
         "olmo": (olmo, OLMO_PLAN), "mingpt": (mingpt, MINGPT_PLAN)}
