"""How long torch.compile takes on fxtp's program of the demo's model (``fxtp.demo``: Llama
with TP + sequence parallel + loss parallel) on CPU with gloo.

For each backend: the first training step (forward, backward; compile included) with an
empty inductor cache, then again in fresh processes with that cache warm, and a step once
compiled. Runs 2 ranks on this machine; prints rank 0's seconds.

``--depth``: how compile time grows with depth, the demo's width at 2 and 8 layers, for
the whole program compiled (``torch.compile(gm)``, inductor) against each block compiled
(:func:`fxtp.compile_blocks`, inductor, the rest eager): the first step with an empty
cache, and the median of 5 compiled steps. Results: ``results/compile_time.json``.

    OMP_NUM_THREADS=1 python -m benchmarks.compile_time [backend ...]
    OMP_NUM_THREADS=1 python -m benchmarks.compile_time --depth
"""
from __future__ import annotations

import json
import os
import pathlib
import socket
import sys
import tempfile
import time

import torch.multiprocessing as mp

WORLD = 2
RESULTS = pathlib.Path(__file__).parent / "results"


def _rank(rank, port, cache_dir, backend, layers, results):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    import dataclasses
    import statistics

    import torch
    import torch.distributed as dist

    import fxtp
    from fxtp.demo import CONFIG, LanguageModel, batches, plan
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    torch.manual_seed(0)
    config = dataclasses.replace(CONFIG, n_layers=layers or CONFIG.n_layers)
    batch = next(batches(config, 1, 4, "cpu"))
    gm = fxtp.parallelize(LanguageModel(config), plan(), example_inputs=batch)
    if backend == "blocks":
        fxtp.compile_blocks(gm)
        compiled = gm
    else:
        compiled = torch.compile(gm, backend=backend, fullgraph=True)
    times = []
    for _ in range(6):
        dist.barrier()
        start = time.perf_counter()
        compiled(*batch).backward()
        times.append(time.perf_counter() - start)
    if rank == 0:
        results.put((times[0], statistics.median(times[1:])))
    dist.destroy_process_group()


def measure(backend: str, cache_dir: str, layers: int = 0) -> tuple[float, float]:
    """(first step, median compiled step) in seconds, rank 0's."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(port, cache_dir, backend, layers, results), nprocs=WORLD)
    return results.get()


def depth() -> dict:
    """First step (cold cache) and compiled step at 2 and 8 layers, whole program against
    per block; the ratios the targets are stated in."""
    runs = {}
    for how in ("inductor", "blocks"):
        for layers in (2, 8):
            with tempfile.TemporaryDirectory() as cache_dir:
                first, step = measure(how, cache_dir, layers)
            runs[f"{how}_{layers}"] = {"first_step_s": first, "step_ms": step * 1e3}
            print(f"{'whole program' if how == 'inductor' else 'per block':14} {layers} "
                  f"layers: first step {first:6.1f} s, compiled step {step * 1e3:7.1f} ms",
                  flush=True)
    def ratio(a, b, key):
        return runs[a][key] / runs[b][key]
    ratios = {"blocks_first_8_over_2": ratio("blocks_8", "blocks_2", "first_step_s"),
              "whole_first_8_over_2": ratio("inductor_8", "inductor_2", "first_step_s"),
              "step_blocks_over_whole_8": ratio("blocks_8", "inductor_8", "step_ms"),
              "step_blocks_over_whole_2": ratio("blocks_2", "inductor_2", "step_ms")}
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}")
    report = {"world": WORLD, "runs": runs, "ratios": ratios}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "compile_time.json").write_text(json.dumps(report, indent=2))
    return report


def main():
    if sys.argv[1:] == ["--depth"]:
        return depth()
    print(f"the demo's model (fxtp.demo), {WORLD} gloo ranks, "
          f"{os.cpu_count()} CPUs, torch.compile(fxtp.parallelize(...)), training step")
    print(f"{'backend':10} {'first, cold cache':>18} {'first, warm cache':>18} "
          f"{'compiled step':>14}")
    for backend in sys.argv[1:] or ["inductor", "fxtp"]:
        with tempfile.TemporaryDirectory() as cache_dir:
            cold, step = measure(backend, cache_dir)
            warm, _ = measure(backend, cache_dir)
        print(f"{backend:10} {cold:17.1f}s {warm:17.1f}s {step * 1e3:12.1f}ms")


if __name__ == "__main__":
    main()
