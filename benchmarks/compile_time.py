"""How long torch.compile takes on fxtp's program of the demo's model (``fxtp.demo``: Llama
with TP + sequence parallel + loss parallel) on CPU with gloo.

For each backend: the first training step (forward, backward; compile included) with an
empty inductor cache, then again in fresh processes with that cache warm, and a step once
compiled. Runs 2 ranks on this machine; prints rank 0's seconds.

    OMP_NUM_THREADS=1 python -m benchmarks.compile_time
"""
from __future__ import annotations

import os
import socket
import sys
import tempfile
import time

import torch.multiprocessing as mp

WORLD = 2


def _rank(rank, port, cache_dir, backend, results):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    import torch
    import torch.distributed as dist

    import fxtp
    from fxtp.demo import CONFIG, LanguageModel, batches, plan
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    torch.manual_seed(0)
    batch = next(batches(CONFIG, 1, 4, "cpu"))
    gm = fxtp.parallelize(LanguageModel(CONFIG), plan(), example_inputs=batch)
    compiled = torch.compile(gm, backend=backend, fullgraph=True)
    times = []
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        compiled(*batch).backward()
        times.append(time.perf_counter() - start)
    if rank == 0:
        results.put((times[0], times[-1]))
    dist.destroy_process_group()


def measure(backend: str, cache_dir: str) -> tuple[float, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(port, cache_dir, backend, results), nprocs=WORLD)
    return results.get()


def main():
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
