"""fxtp against what users would pick instead, side by side in one run.

Training step time (forward, backward, AdamW step) of :class:`fxtp.examples.llama.Llama` at two
sizes on 2 gloo CPU ranks (one thread each) for: the single-device model (one rank),
torch's DTensor TP (``parallelize_module`` with the same plan) eager and compiled, a
hand-written Megatron-style TP (:mod:`benchmarks.handwritten`) eager and compiled, and
fxtp's GraphModule eager and compiled. Every variant starts from the same weights and
batch; the first step's loss is recorded to show they compute the same thing. Each is
timed over ``--repeats`` runs of ``--steps`` steps after warm-up (compiles happen there);
min and median per step are reported, with ratios to DTensor eager and to hand-written.

Also: collective bytes per step of fxtp under the TP and the TP + SP plans against the
Megatron formula, and per-rank parameter bytes. Where CUDA is present, a CUDA section
(``benchmarks.cuda``) runs too. Results: ``benchmarks/results/run.json`` and ``run.png``.

    python -m benchmarks.run            # full run
    python -m benchmarks.run --quick    # tiny sizes, for a smoke test
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import pathlib
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from benchmarks.dtensor_tp import WHY_DTENSOR_PATCHED, dtensor_tp

RESULTS = pathlib.Path(__file__).parent / "results"
VARIANTS = ("single", "dtensor_eager", "dtensor_compiled", "handwritten_eager",
            "handwritten_compiled", "fxtp_eager", "fxtp_compiled")


def sizes(quick: bool) -> dict:
    from fxtp.examples.llama import LlamaConfig
    if quick:
        return {"tiny": (LlamaConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=256,
                                     multiple_of=16, max_seq_len=32), 2, 16)}
    return {"small": (LlamaConfig(dim=128, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=1024,
                                  multiple_of=32, max_seq_len=64), 4, 64),
            "medium": (LlamaConfig(dim=512, n_layers=4, n_heads=8, n_kv_heads=4,
                                   vocab_size=4096, multiple_of=64, max_seq_len=128), 4, 128)}


# --- the variants ---------------------------------------------------------------------------

def build(variant: str, model, tokens, rank: int, world: int):
    """This rank's module for ``variant`` (None where this rank does not take part)."""
    import fxtp
    from fxtp.examples.llama import llama_tp_plan
    group = dist.group.WORLD.group_name
    if variant == "single":
        return model if rank == 0 else None
    if variant.startswith("dtensor"):
        module = dtensor_tp(model, world)
    elif variant.startswith("handwritten"):
        from benchmarks.handwritten import handwritten_tp
        module = handwritten_tp(model, rank, world, group)
    else:
        module = fxtp.parallelize(model, llama_tp_plan(), example_inputs=(tokens,))
    return torch.compile(module, fullgraph=not variant.startswith("dtensor")) \
        if variant.endswith("compiled") else module


def train_step(module, opt, tokens, targets) -> torch.Tensor:
    logits = module(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def time_variant(variant, cfg, batch, seq, args, rank, world) -> dict:
    from fxtp.examples.llama import Llama
    torch.manual_seed(0)
    model = Llama(cfg)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    result = {}
    try:
        module = build(variant, copy.deepcopy(model), tokens, rank, world)
        if module is not None:
            opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
            start = time.perf_counter()
            result["loss0"] = train_step(module, opt, tokens, targets).item()
            for _ in range(args.warmup - 1):
                train_step(module, opt, tokens, targets)
            result["warmup_s"] = time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 - reported in the results, the run goes on
        result["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        module = None
    failed = [None] * world
    dist.all_gather_object(failed, "error" in result)
    if any(failed):
        result.setdefault("error", "failed on another rank")
        return result
    per_step = []
    for _ in range(args.repeats):
        dist.barrier()
        if module is not None:
            start = time.perf_counter()
            for _ in range(args.steps):
                train_step(module, opt, tokens, targets)
            per_step.append((time.perf_counter() - start) / args.steps)
    if per_step:
        result.update(min_s=min(per_step), median_s=statistics.median(per_step))
    return result


# --- collectives and memory -----------------------------------------------------------------

def megatron_bytes(cfg, batch, seq, world, item, sp: bool) -> dict:
    """Per rank and step, the bytes Megatron's TP (and SP) put into each kind of collective:
    one (B, T, D) activation per all-reduce (2 per layer each way, the embedding's forward,
    the head input's backward); with SP each becomes a reduce-scatter of the activation and
    an all-gather of a 1/N shard, plus one all-reduce of the norm weights' gradients; the
    logits are gathered from (B, T, V/N) shards."""
    act, layers = batch * seq * cfg.dim * item, 2 * cfg.n_layers + 1
    logits = batch * seq * cfg.vocab_size // world * item
    if not sp:
        return {"all_reduce": 2 * layers * act, "all_gather": logits}
    return {"all_gather": 2 * layers * act // world + logits, "reduce_scatter": 2 * layers * act,
            "all_reduce": layers * cfg.dim * item}


def fxtp_bytes(cfg, batch, seq, rank, world) -> dict:
    import fxtp
    from fxtp.examples.llama import Llama, llama_sp_plan, llama_tp_plan
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
    out = {}
    for name, plan in (("tp", llama_tp_plan()), ("tp_sp", llama_sp_plan())):
        gm = fxtp.parallelize(Llama(cfg), plan, example_inputs=(tokens,))
        with fxtp.count_collectives() as fwd:
            logits = gm(tokens)
        with fxtp.count_collectives() as bwd:
            logits.sum().backward()
        measured = dict(fwd.bytes + bwd.bytes)
        formula = megatron_bytes(cfg, batch, seq, world, 4, name == "tp_sp")
        out[name] = {"measured": measured, "megatron": formula, "equal": measured == formula,
                     "counts_fwd": dict(fwd.counts), "counts_bwd": dict(bwd.counts),
                     "param_bytes_per_rank": sum(p.numel() * p.element_size()
                                                 for p in gm.parameters())}
    out["param_bytes_unsharded"] = sum(p.numel() * p.element_size()
                                       for p in Llama(cfg).parameters())
    return out


# --- driver ---------------------------------------------------------------------------------

def rank_main(rank, world, port, args, queue):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(RESULTS / "inductor-cache"))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(minutes=30))
    from tqdm import tqdm
    jobs = [(s, v) for s in sizes(args.quick) for v in args.variants]
    results = {}
    for size, variant in tqdm(jobs, disable=rank != 0, desc="benchmarks"):
        cfg, batch, seq = sizes(args.quick)[size]
        if size not in results:
            results[size] = {"config": {**vars(cfg), "batch": batch, "seq": seq},
                             "collectives": fxtp_bytes(cfg, batch, seq, rank, world)}
        results[size][variant] = time_variant(variant, cfg, batch, seq, args, rank, world)
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def ratios(results: dict) -> None:
    for size, row in results.items():
        base, hand = row.get("dtensor_eager", {}), row.get("handwritten_compiled", {})
        hand_eager = row.get("handwritten_eager", {})
        for variant in VARIANTS:
            r = row.get(variant, {})
            if "median_s" not in r:
                continue
            if "median_s" in base:
                r["vs_dtensor_eager"] = r["median_s"] / base["median_s"]
            ref = hand if variant.endswith("compiled") else hand_eager
            if "median_s" in ref:
                r["vs_handwritten"] = r["median_s"] / ref["median_s"]


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (size, row) in zip(axes[0], results.items()):
        names = [v for v in VARIANTS if "median_s" in row.get(v, {})]
        ax.bar(names, [row[v]["median_s"] * 1e3 for v in names],
               color=["#888" if not v.startswith("fxtp") else "#2a7" for v in names])
        ax.set_title(f"{size}: training step, median of repeats (2 gloo CPU ranks)")
        ax.set_ylabel("ms / step")
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few steps")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats, args.warmup = 2, 2, 2
    RESULTS.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(rank_main, args=(2, port, args, queue), nprocs=2, start_method="spawn",
                       join=False)
    results = queue.get()
    ratios(results)
    report = {"torch": torch.__version__, "world": 2, "threads_per_rank": 1,
              "dtensor_note": WHY_DTENSOR_PATCHED, "sizes": results}
    if torch.cuda.is_available():
        from benchmarks.cuda import run as run_cuda
        report["cuda"] = run_cuda()
    (RESULTS / "run.json").write_text(json.dumps(report, indent=2))
    plot(results, RESULTS / "run.png")
    print_table(results)
    print(f"results: {RESULTS / 'run.json'}, {RESULTS / 'run.png'}")
    return report


def print_table(results: dict) -> None:
    for size, row in results.items():
        print(f"\n{size}  (batch {row['config']['batch']}, seq {row['config']['seq']}, "
              f"dim {row['config']['dim']}, layers {row['config']['n_layers']})")
        print(f"  {'variant':22} {'median ms':>10} {'min ms':>8} {'vs DTensor':>11} "
              f"{'vs hand':>8} {'loss0':>9}")
        for variant in VARIANTS:
            r = row.get(variant)
            if r is None:
                continue
            if "error" in r:
                print(f"  {variant:22} {r['error']}")
                continue
            if "median_s" not in r:
                continue
            print(f"  {variant:22} {r['median_s'] * 1e3:10.2f} {r['min_s'] * 1e3:8.2f} "
                  f"{r.get('vs_dtensor_eager', float('nan')):11.2f} "
                  f"{r.get('vs_handwritten', float('nan')):8.2f} "
                  f"{r.get('loss0', float('nan')):9.5f}")
        for plan, c in row["collectives"].items():
            if isinstance(c, dict):
                print(f"  fxtp {plan:6} collective bytes/step {c['measured']} "
                      f"{'==' if c['equal'] else '!='} Megatron {c['megatron']}")


if __name__ == "__main__":
    main()
