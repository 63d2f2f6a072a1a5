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


class Redundant(nn.Module):
    """Four MLPs: ``second`` reads ``first``'s output, ``left`` and ``right`` both read
    ``second``'s and their outputs are multiplied. Under :data:`REDUNDANT_PLAN`, ``first``'s
    output is sharded only for ``second`` to gather it straight back, and ``left`` and
    ``right`` each all-reduce on their own."""

    def __init__(self, dim=DIM):
        super().__init__()
        self.first, self.second, self.left, self.right = (MLP(dim) for _ in range(4))

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
