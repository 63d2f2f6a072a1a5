"""CUDA section: per-rank training step time of a Llama-3-8B-shaped layer stack (bf16) at
world size 8 on a fake process group (each rank's compute and fxtp's / DTensor's overhead;
the collectives move nothing), for fxtp compiled and eager, and DTensor TP eager and
compiled. Run by ``benchmarks.run`` where CUDA is present, or alone:

    python -m benchmarks.cuda
"""
from __future__ import annotations

import copy
import json
import pathlib
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

RESULTS = pathlib.Path(__file__).parent / "results"


class LayerStack(nn.Module):
    """The transformer layers of :class:`fxtp.examples.llama.Llama` on embeddings (no vocab)."""

    def __init__(self, cfg):
        super().__init__()
        from fxtp.examples.llama import TransformerBlock, precompute_cos_sin
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        cos, sin = precompute_cos_sin(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, h):
        freqs = (self.cos[: h.shape[1]], self.sin[: h.shape[1]])
        for layer in self.layers:
            h = layer(h, freqs)
        return h


def optimizers(module, lr=1e-4) -> list:
    """AdamW over the module's parameters; DTensor and plain ones apart, since foreach
    kernels (CUDA's default) cannot mix them (a DTensor model's unplanned norms are plain)."""
    from torch.distributed.tensor import DTensor
    groups = {}
    for p in module.parameters():
        groups.setdefault(isinstance(p, DTensor), []).append(p)
    return [torch.optim.AdamW(params, lr=lr) for params in groups.values()]


def _time(module, x, steps, warmup) -> dict:
    opts = optimizers(module)

    def step():
        module(x).float().pow(2).mean().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    start = time.perf_counter()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    warm = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3,
            "warmup_s": warm}


def run(layers: int = 2, batch: int = 1, seq: int = 2048, world: int = 8, steps: int = 10,
        warmup: int = 3, variants=None) -> dict:
    import fxtp
    from benchmarks.dtensor_tp import dtensor_tp
    from fxtp.examples.llama import LlamaConfig, llama_layer_plan
    from fxtp.kernels.torch_compat import init_fake_process_group
    if not dist.is_initialized():
        init_fake_process_group(world, rank=0)
    torch.cuda.set_device(0)
    cfg = LlamaConfig(dim=4096, n_layers=layers, n_heads=32, n_kv_heads=8, vocab_size=128256,
                      multiple_of=1024, ffn_dim_multiplier=1.3, max_seq_len=seq)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LayerStack(cfg).to(torch.bfloat16)
        x = torch.randn(batch, seq, cfg.dim, dtype=torch.bfloat16)
    builders = {
        "fxtp_eager": lambda m: fxtp.parallelize(m, llama_layer_plan(), example_inputs=(x,)),
        "fxtp_compiled": lambda m: torch.compile(
            fxtp.parallelize(m, llama_layer_plan(), example_inputs=(x,)), fullgraph=True),
        "dtensor_eager": lambda m: dtensor_tp(m, world, "cuda"),
        "dtensor_compiled": lambda m: torch.compile(dtensor_tp(m, world, "cuda")),
    }
    out = {"device": torch.cuda.get_device_name(), "world": world, "layers": layers,
           "batch": batch, "seq": seq, "dtype": "bfloat16", "torch": torch.__version__}
    for name, build in builders.items():
        if variants and name not in variants:
            continue
        try:
            out[name] = _time(build(copy.deepcopy(model)), x, steps, warmup)
        except Exception as e:  # noqa: BLE001 - reported, the others still run
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        torch.cuda.empty_cache()
    base = out.get("dtensor_eager", {}).get("median_ms")
    for name in builders:
        if base and "median_ms" in out.get(name, {}):
            out[name]["vs_dtensor_eager"] = out[name]["median_ms"] / base
    return out


if __name__ == "__main__":
    import sys
    report = run(variants=sys.argv[1:] or None)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cuda.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
