"""An 8B-scale Llama for checking tensor-parallel plans without GPUs: Llama-3-8B's width,
depth, heads, vocabulary and SwiGLU size, in bf16, built by ``python -m fxtp explain`` on
the meta device (no memory is allocated)::

    python -m fxtp explain --model benchmarks.explain_llama:model \\
        --plan benchmarks.explain_llama:plan --world-size 8 --input 1x8192:int64 \\
        --seq-parallel
"""
import torch

from tests.helpers import transformer_models as tm


def model():
    # multiple_of=14336 rounds the SwiGLU width up to Llama-3-8B's 14336
    cfg = tm.LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                         multiple_of=14336, max_seq_len=8192, rope_theta=500000.0)
    return tm.Llama(cfg).to(torch.bfloat16)


def plan(seq_parallel=False):
    """torchtitan's plan with ``seq_parallel``; else vocab-parallel embedding, Megatron
    layers and the logits gathered."""
    return tm.llama_plan(seq_parallel)
