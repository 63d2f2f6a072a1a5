"""Small single-device models written the way people write them, and their TP plans."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxtp

DIM, HEADS, SEQ, BATCH = 16, 4, 8, 2


class MLP(nn.Module):
    def __init__(self, dim=DIM, hidden=None, bias=True):
        super().__init__()
        hidden = hidden or 4 * dim
        self.net1 = nn.Linear(dim, hidden, bias=bias)
        self.net2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x):
        return self.net2(F.gelu(self.net1(x)))


class Attention(nn.Module):
    """Multi-head attention using the global head count in ``view``."""

    def __init__(self, dim=DIM, n_heads=HEADS, bias=False):
        super().__init__()
        self.n_heads = n_heads
        self.wq = nn.Linear(dim, dim, bias=bias)
        self.wk = nn.Linear(dim, dim, bias=bias)
        self.wv = nn.Linear(dim, dim, bias=bias)
        self.wo = nn.Linear(dim, dim, bias=bias)

    def forward(self, x):
        bsz, seqlen, dim = x.shape
        head_dim = dim // self.n_heads
        q = self.wq(x).view(bsz, seqlen, self.n_heads, head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seqlen, self.n_heads, -1).transpose(1, 2)
        v = self.wv(x).reshape(bsz, seqlen, self.n_heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, dim))


class Block(nn.Module):
    def __init__(self, dim=DIM):
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = Attention(dim)
        self.ffn_norm = nn.LayerNorm(dim)
        self.feed_forward = MLP(dim)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Stack(nn.Module):
    def __init__(self, n_layers=2, dim=DIM):
        super().__init__()
        self.layers = nn.ModuleList(Block(dim) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class Layers(nn.Module):
    """``n`` blocks made by ``make``, applied in turn: a ``layers`` list plans name by
    ``layers.*``."""

    def __init__(self, make, n):
        super().__init__()
        self.layers = nn.ModuleList(make() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Redundant(nn.Module):
    """Four bias-free MLPs: ``second`` reads ``first``'s output, ``left`` and ``right`` both
    read ``second``'s and their outputs are multiplied. Under :data:`REDUNDANT_PLAN`,
    ``first``'s partial output is reduce-scattered only for ``second`` to gather it straight
    back, and ``left`` and ``right`` each all-reduce on their own."""

    def __init__(self, dim=DIM):
        super().__init__()
        self.first, self.second, self.left, self.right = (MLP(dim, bias=False) for _ in range(4))

    def forward(self, x):
        h = self.second(self.first(x))
        return self.left(h) * self.right(h)


MLP_PLAN = {"net1": fxtp.ColwiseParallel(), "net2": fxtp.RowwiseParallel()}
ATTENTION_PLAN = {"w[qkv]": fxtp.ColwiseParallel(), "wo": fxtp.RowwiseParallel()}
STACK_PLAN = {
    "layers.*.attention.w[qkv]": fxtp.ColwiseParallel(),
    "layers.*.attention.wo": fxtp.RowwiseParallel(),
    "layers.*.feed_forward.net1": fxtp.ColwiseParallel(),
    "layers.*.feed_forward.net2": fxtp.RowwiseParallel(),
}


REDUNDANT_PLAN = {
    "first": fxtp.PrepareModuleOutput(output_layouts=fxtp.Replicate(),
                                      desired_output_layouts=fxtp.Shard(-1)),
    "second": fxtp.PrepareModuleInput(input_layouts=fxtp.Shard(-1),
                                      desired_input_layouts=fxtp.Replicate()),
    "*.net1": fxtp.ColwiseParallel(),
    "*.net2": fxtp.RowwiseParallel(),
}


def activations(*shape, dtype):
    return torch.randn(*shape, dtype=dtype)


class FusedAttention(nn.Module):
    """Attention with one fused q/k/v projection whose output is split ``split`` ways:
    ``"split"`` (``qkv.split(D, -1)``), ``"chunk"`` (``qkv.chunk(3, -1)``), ``"sizes"``
    (``torch.split(qkv, [D, D, D], -1)``), ``"gqa"`` (half as many key/value heads:
    unequal sizes ``[D, D / 2, D / 2]``) or ``"unbind"`` (timm's ViT: viewed as ``(3,
    heads, head_dim)``, permuted to ``(3, batch, heads, seq, head_dim)`` and unbound)."""

    def __init__(self, dim=DIM, n_heads=HEADS, split="split"):
        super().__init__()
        self.n_heads, self.split = n_heads, split
        self.kv_dim = dim // 2 if split == "gqa" else dim
        self.qkv = nn.Linear(dim, dim + 2 * self.kv_dim)
        self.wo = nn.Linear(dim, dim)

    def forward(self, x):
        bsz, seqlen, dim = x.shape
        qkv = self.qkv(x)
        head_dim = dim // self.n_heads
        if self.split == "unbind":
            q, k, v = qkv.reshape(bsz, seqlen, 3, self.n_heads, head_dim).permute(
                2, 0, 3, 1, 4).unbind(0)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, dim))
        if self.split == "split":
            q, k, v = qkv.split(dim, -1)
        elif self.split == "chunk":
            q, k, v = qkv.chunk(3, -1)
        else:
            q, k, v = torch.split(qkv, [dim, self.kv_dim, self.kv_dim], -1)
        q, k, v = (t.view(bsz, seqlen, -1, head_dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=self.split == "gqa")
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, dim))


class FusedSwiGLU(nn.Module):
    """SwiGLU with the gate and up projections fused into one ``w13``, then chunked."""

    def __init__(self, dim=DIM, hidden=2 * DIM):
        super().__init__()
        self.w13 = nn.Linear(dim, 2 * hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        gate, up = self.w13(x).chunk(2, -1)
        return self.w2(F.silu(gate) * up)


class FusedBlock(nn.Module):
    def __init__(self, dim=DIM, split="split"):
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = FusedAttention(dim, split=split)
        self.ffn_norm = nn.LayerNorm(dim)
        self.feed_forward = FusedSwiGLU(dim)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class FusedStack(nn.Module):
    """``n_layers`` fused blocks; ``shared``: one block applied ``n_layers`` times (ALBERT's
    cross-layer parameter sharing), so each fused weight feeds several projections."""

    def __init__(self, n_layers=2, dim=DIM, split="split", shared=False):
        super().__init__()
        n_blocks = 1 if shared else n_layers
        self.layers = nn.ModuleList(FusedBlock(dim, split) for _ in range(n_blocks))
        self.order = [0] * n_layers if shared else list(range(n_layers))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        for i in self.order:
            x = self.layers[i](x)
        return self.norm(x)


FUSED_PLAN = {
    "layers.*.attention.qkv": fxtp.ColwiseParallel(),
    "layers.*.attention.wo": fxtp.RowwiseParallel(),
    "layers.*.feed_forward.w13": fxtp.ColwiseParallel(),
    "layers.*.feed_forward.w2": fxtp.RowwiseParallel(),
}


TARGETS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))


class WithLoss(nn.Module):
    """A language model whose forward returns the next-token loss."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, tokens, targets):
        logits = self.lm(tokens)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                                 label_smoothing=0.1)


def prefixed(plan, prefix="lm."):
    return {prefix + k: v for k, v in plan.items()}


UNRULED_PLAN = {"up": fxtp.ColwiseParallel(), "down": fxtp.RowwiseParallel()}


class FourierMix(nn.Module):
    """FNet's token mixing, a Fourier transform, here over the sharded features: no rule
    in fxtp, and torch has no decomposition of it into ops with one."""

    def forward(self, h):
        return torch.fft.fft(h, dim=-1).real


class Unruled(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, 32)
        self.mix = FourierMix()
        self.down = nn.Linear(32, DIM)

    def forward(self, x):
        return self.down(self.mix(self.up(x)))


def alibi(score, b, h, q_idx, kv_idx):
    """A head-indexed score bias: each head penalizes distance with its own slope."""
    return score - 0.5 * h * (q_idx - kv_idx)


class FlexAttention(nn.Module):
    """torchtitan-style attention through ``flex_attention``: a causal ``BlockMask`` built in
    forward and a score function that reads the head index (an ALiBi-like bias)."""

    def __init__(self, dim=32, n_heads=4):
        super().__init__()
        self.n_heads = n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def heads(self, x):
        """The attention output per head, (B, H, T, D / H)."""
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        bsz, seqlen, _ = x.shape
        q, k, v = (w(x).view(bsz, seqlen, self.n_heads, -1).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None,
                                 seqlen, seqlen, device=x.device)
        return flex_attention(q, k, v, block_mask=mask, score_mod=alibi)

    def forward(self, x):
        out = self.heads(x)
        return self.wo(out.transpose(1, 2).flatten(2))
