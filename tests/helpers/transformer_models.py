"""Small single-device transformers written the way people write them, used as tensor-
parallel parity subjects, and their TP plans: GPT-2 style here, Llama-3 style from
:mod:`fxtp.examples.llama` (the demo's model)."""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxtp
from fxtp import Replicate, Shard
from fxtp.examples.llama import (Llama, LlamaConfig, RMSNorm, llama_layer_plan,  # noqa: F401
                                 llama_sp_plan, llama_tp_plan, precompute_cos_sin,
                                 precompute_freqs_cis)


# --- GPT-2 -------------------------------------------------------------------------------

@dataclass
class GPT2Config:
    vocab_size: int = 64
    n_positions: int = 32
    n_embd: int = 32
    n_layer: int = 2
    n_head: int = 4


class GPT2Attention(nn.Module):
    """Causal self-attention; ``view`` uses the global head count ``self.n_head``."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.n_head = cfg.n_head
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        B, T, C = x.size()
        q = self.q_proj(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class GPT2MLP(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = GPT2Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """GPT-2: learned positions, pre-LN blocks, LM head tied to ``wte`` by default."""

    def __init__(self, cfg: GPT2Config = None, tie_weights: bool = True):
        super().__init__()
        cfg = cfg or GPT2Config()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.ModuleList(GPT2Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if tie_weights:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        B, T = idx.size()
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# --- GPT-2 TP plans ----------------------------------------------------------------------

def gpt2_layer_plan():
    return {
        "h.*.attn.[qkv]_proj": fxtp.ColwiseParallel(),
        "h.*.attn.c_proj": fxtp.RowwiseParallel(),
        "h.*.mlp.c_fc": fxtp.ColwiseParallel(),
        "h.*.mlp.c_proj": fxtp.RowwiseParallel(),
    }


def gpt2_sp_plan(loss_parallel=False):
    """Sequence parallel for :class:`GPT2`: as :func:`llama_sp_plan`, with LayerNorms."""
    return {
        "wte": fxtp.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "ln_f": fxtp.SequenceParallel(),
        "lm_head": fxtp.ColwiseParallel(input_layouts=Shard(1),
                                        output_layouts=Shard(-1) if loss_parallel else Replicate()),
        "h.*.ln_[12]": fxtp.SequenceParallel(),
        "h.*.attn": fxtp.PrepareModuleInput(input_layouts=(Shard(1),),
                                            desired_input_layouts=(Replicate(),)),
        "h.*.mlp": fxtp.PrepareModuleInput(input_layouts=(Shard(1),),
                                           desired_input_layouts=(Replicate(),)),
        "h.*.attn.[qkv]_proj": fxtp.ColwiseParallel(),
        "h.*.attn.c_proj": fxtp.RowwiseParallel(output_layouts=Shard(1)),
        "h.*.mlp.c_fc": fxtp.ColwiseParallel(),
        "h.*.mlp.c_proj": fxtp.RowwiseParallel(output_layouts=Shard(1)),
    }


# --- for `python -m fxtp explain` ----------------------------------------------------------

def llama_8_heads():
    """:class:`Llama` whose heads, KV heads and hidden sizes divide by 8 ranks."""
    return Llama(LlamaConfig(n_heads=8, n_kv_heads=8))


def llama_plan(seq_parallel=False):
    """The whole :class:`Llama` under tensor parallelism: vocab-parallel embedding, the
    layer plan, the head's logits gathered; torchtitan's plan with ``seq_parallel``."""
    return llama_sp_plan() if seq_parallel else llama_tp_plan()


def init_weights(module: nn.Module) -> None:
    """``parallelize(..., init_fn=init_weights)`` for these models: each module's own
    tensors as their constructors initialize them (rotary tables recomputed)."""
    if isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm)):
        module.reset_parameters()
    elif isinstance(module, RMSNorm):
        nn.init.ones_(module.weight)
    elif isinstance(module, Llama):
        cfg = module.config
        head_dim = cfg.dim // cfg.n_heads
        if cfg.rope == "complex":
            module.freqs_cis.copy_(precompute_freqs_cis(head_dim, cfg.max_seq_len,
                                                        cfg.rope_theta))
        else:
            cos, sin = precompute_cos_sin(head_dim, cfg.max_seq_len, cfg.rope_theta)
            module.cos.copy_(cos)
            module.sin.copy_(sin)
