"""Serving: decode tokens per second and per-rank KV cache bytes of :mod:`fxtp.examples.gpt_fast`'s
Llama (gpt-fast's layout: one fused ``wqkv``), single device against 2-rank tensor
parallelism done four ways.

* ``single``: the model on one process;
* ``handwritten`` / ``handwritten_compiled``: gpt-fast's ``tp.py`` by hand: each rank keeps
  its heads' rows of q, k and v (of each part of ``wqkv``) and its columns of the output
  projection (likewise the FFN), attention counts local heads, its cache holds local KV
  heads, and a functional all-reduce follows attention and the FFN; compiled with
  ``torch.compile(fullgraph=True)``;
* ``dtensor``: torch's ``parallelize_module`` with the same plan on the same weights with
  q, k and v as three projections (``ColwiseParallel`` has no layout for an unequal fused
  split; local head counts patched in, as torchtitan does; caches of local heads);
* ``fxtp`` / ``fxtp_compiled``: ``fxtp.parallelize`` of the unmodified model (one module
  with a dynamic sequence dim; the cache shards itself), compiled for decoding.

gloo, 1 thread per rank, fp32. Each (variant, batch) runs in fresh processes: one generation
to warm up (and compile), then ``--repeats`` generations of ``--new`` tokens after a
``--prompt``-token prefill; decode tokens/s = batch / the median decode step over every
step of every repeat (the slowest rank's): a median, because on a shared 2-core machine
single steps stall for tens of milliseconds at random, which a total would count.
Results: ``benchmarks/results/serving.json`` (``--out``).

    python -m benchmarks.serving [--quick]
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.ranks import spawn_ranks

RESULTS = pathlib.Path(__file__).parent / "results"
VARIANTS = ("single", "handwritten", "handwritten_compiled", "dtensor", "fxtp", "fxtp_compiled")
WORLD = 2


def config(args):
    from fxtp.examples.gpt_fast import ServeConfig
    if args.quick:
        return ServeConfig(vocab_size=512, dim=128, n_layers=2, n_heads=8, n_kv_heads=4,
                           hidden=384, max_seq_len=args.prompt + args.new)
    return ServeConfig(vocab_size=4096, dim=512, n_layers=4, n_heads=8, n_kv_heads=4,
                       hidden=1408, max_seq_len=args.prompt + args.new)


def localize_heads(model, world: int):
    """Attention counts local heads and its caches hold local KV heads (what DTensor TP and
    the hand-written TP need; fxtp runs the model as written)."""
    for layer in model.layers:
        attention = layer.attention
        attention.n_head //= world
        attention.n_local_heads //= world
        attention.dim //= world
    model.config = dataclasses.replace(model.config, n_kv_heads=model.config.n_kv_heads // world)
    return model


def handwritten_tp(model, world: int, rank: int):
    """gpt-fast's tp.py: shard rows of the colwise weights and columns of the rowwise ones,
    all-reduce each block's attention and FFN output."""
    import torch.distributed._functional_collectives as funcol

    def rows(linear, parts=None):  # each part's rows (gpt-fast's weight_splits)
        parts = linear.weight.split(parts or [linear.weight.shape[0]])
        linear.weight = torch.nn.Parameter(torch.cat([p.chunk(world, 0)[rank] for p in parts]))

    def cols(linear):
        linear.weight = torch.nn.Parameter(linear.weight.chunk(world, 1)[rank].clone())
    for layer in model.layers:
        attention, ffn = layer.attention, layer.feed_forward
        kv = attention.n_local_heads * attention.head_dim
        rows(attention.wqkv, [attention.dim, kv, kv])
        for linear in (ffn.w1, ffn.w3):
            rows(linear)
        cols(attention.wo)
        cols(ffn.w2)
        for module in (attention, ffn):
            module.register_forward_hook(
                lambda _m, _i, out: funcol.all_reduce(out, "sum", dist.group.WORLD))
    return localize_heads(model, world)


def unfused(model):
    """The same weights with q, k and v as three projections."""
    from fxtp.examples.gpt_fast import Transformer
    twin = Transformer(dataclasses.replace(model.config, fused_qkv=False))
    state = model.state_dict()
    for i, layer in enumerate(model.layers):
        kv = layer.attention.n_local_heads * layer.attention.head_dim
        prefix = f"layers.{i}.attention."
        q, k, v = state.pop(prefix + "wqkv.weight").split([layer.attention.dim, kv, kv])
        state.update({prefix + "wq.weight": q, prefix + "wk.weight": k, prefix + "wv.weight": v})
    twin.load_state_dict(state)
    return twin


def dtensor_tp(model, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    plan = {**{f"layers.*.attention.w{w}": ColwiseParallel() for w in "qkv"},
            "layers.*.attention.wo": RowwiseParallel(),
            **{f"layers.*.feed_forward.w{w}": ColwiseParallel() for w in "13"},
            "layers.*.feed_forward.w2": RowwiseParallel()}
    return localize_heads(parallelize_module(unfused(model), init_device_mesh("cpu", (world,)),
                                             plan), world)


def build(variant, model, prompt, rank):
    """``(prefill module, decode callable)`` with caches set up."""
    import fxtp
    from fxtp.examples.gpt_fast import tp_plan
    batch = prompt.shape[0]
    if variant.startswith("handwritten"):
        model = handwritten_tp(model, WORLD, rank)
    elif variant == "dtensor":
        model = dtensor_tp(model, WORLD)
    model.setup_caches(batch)
    if not variant.startswith("fxtp"):
        decode = torch.compile(model, fullgraph=True) if variant.endswith("compiled") else model
        return model, decode
    seq = torch.export.Dim("seq", min=1, max=model.config.max_seq_len)
    gm = fxtp.parallelize(model, tp_plan(), example_inputs=(prompt, torch.arange(prompt.shape[1])),
                          dynamic_shapes=({1: seq}, {0: seq}))
    assert not gm.fxtp.fallbacks, gm.fxtp.fallbacks
    return gm, (torch.compile(gm, fullgraph=True) if variant.endswith("compiled") else gm)


@torch.no_grad()
def timed_generation(model, decode, prompt, new: int):
    """(prefill s, [each decode step's s], tokens) of one generation, without autograd (as
    servers run)."""
    from fxtp.examples.gpt_fast import sample
    length = prompt.shape[1]
    positions = torch.arange(length + new)
    start = time.perf_counter()
    logits = model(prompt, positions[:length])
    token = sample(logits[:, -1])[:, None]
    prefill = time.perf_counter() - start
    tokens, steps = [prompt, token], []
    for i in range(new - 1):
        start = time.perf_counter()
        logits = decode(token, positions[length + i: length + i + 1])
        token = sample(logits[:, -1])[:, None]
        steps.append(time.perf_counter() - start)
        tokens.append(token)
    return prefill, steps, torch.cat(tokens, 1)


def _rank(rank, world, port, variant, batch, args, out):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/fxtp_inductor_bench")
    if variant != "single":
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=600))
    try:
        from fxtp.examples.gpt_fast import Transformer
        cfg = config(args)
        torch.manual_seed(0)
        model = Transformer(cfg)
        prompt = torch.randint(0, cfg.vocab_size, (batch, args.prompt),
                               generator=torch.Generator().manual_seed(1))
        module, decode = build(variant, model, prompt, rank)
        start = time.perf_counter()
        timed_generation(module, decode, prompt, args.new)
        warmup = time.perf_counter() - start
        runs = [timed_generation(module, decode, prompt, args.new) for _ in range(args.repeats)]
        cache = sum(b.numel() * b.element_size() for n, b in module.named_buffers()
                    if n.endswith("_cache"))
        out.put((rank, {"prefill_s": statistics.median(r[0] for r in runs),
                        "decode_step_s": statistics.median(t for r in runs for t in r[1]),
                        "warmup_s": warmup, "cache_bytes": cache,
                        "tokens": runs[-1][2][0, -8:].tolist()}))
    except Exception as e:  # noqa: BLE001 - reported in the results
        out.put((rank, {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_one(variant, batch, args) -> dict:
    results = spawn_ranks(_rank, 1 if variant == "single" else WORLD, (variant, batch, args))
    if "error" in results:
        return results
    step = max(r["decode_step_s"] for r in results.values())
    return {"decode_tokens_per_s": batch / step,
            "prefill_ms": 1e3 * max(r["prefill_s"] for r in results.values()),
            "warmup_s": max(r["warmup_s"] for r in results.values()),
            "cache_bytes_per_rank": results[0]["cache_bytes"],
            "last_tokens": results[0]["tokens"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--variants", nargs="*", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "serving.json")
    args = parser.parse_args()
    report = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "setup": f"gloo, {WORLD} ranks of 1 thread, {os.cpu_count()} cores, fp32",
              "model": repr(config(args)), "batches": {}}
    for batch in args.batches:
        rows = report["batches"][batch] = {v: run_one(v, batch, args) for v in args.variants}
        speed = {v: r.get("decode_tokens_per_s") for v, r in rows.items()}
        for name, (a, b) in {"fxtp_compiled / handwritten_compiled":
                             ("fxtp_compiled", "handwritten_compiled"),
                             "fxtp_compiled / dtensor": ("fxtp_compiled", "dtensor"),
                             "fxtp / dtensor": ("fxtp", "dtensor"),
                             "fxtp / handwritten": ("fxtp", "handwritten")}.items():
            if speed.get(a) and speed.get(b):
                rows.setdefault("ratios", {})[name] = speed[a] / speed[b]
        print(batch, json.dumps(rows, indent=1), flush=True)
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
