"""How long torch.compile takes on fxtp's program of the demo's model (``fxtp.examples.demo``: Llama
with TP + sequence parallel + loss parallel) on CPU with gloo.

For each backend: the first training step (forward, backward; compile included) with an
empty inductor cache, then again in fresh processes with that cache warm, and a step once
compiled. Runs 2 ranks on this machine; prints rank 0's seconds.

``--depth``: how compile time grows with depth, the demo's width at 2 and 8 layers, for
the whole program compiled (``torch.compile(gm)``, inductor) against the program compiled
with each block a nested region (:func:`fxtp.compile`) and each block compiled on its own
(:func:`fxtp.compile_blocks`, the rest eager): the first step with an empty cache (each
alone), the median of 20 compiled steps (the three programs' steps alternating in one
run), and the largest difference of a step's loss from the whole program's (an SGD step
follows each, so the losses follow the gradients). Results: ``results/compile_time.json``.

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


def _rank(rank, port, cache_dir, backends, layers, steps, results):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    import dataclasses
    import statistics

    import torch
    import torch.distributed as dist

    import fxtp
    from fxtp.examples.demo import CONFIG, LanguageModel, batches, plan
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    config = dataclasses.replace(CONFIG, n_layers=layers or CONFIG.n_layers)
    batch = next(batches(config, 1, 4, "cpu"))
    compiled = {}
    for backend in backends:
        torch.manual_seed(0)
        gm = fxtp.parallelize(LanguageModel(config), plan(), example_inputs=batch)
        if backend == "blocks":
            fxtp.compile_blocks(gm)
            compiled[backend] = gm
        elif backend == "regions":
            compiled[backend] = fxtp.compile(gm, fullgraph=True)
        else:
            compiled[backend] = torch.compile(gm, backend=backend, fullgraph=True)
    times = {backend: [] for backend in backends}
    losses = {backend: [] for backend in backends}
    optimizers = {backend: torch.optim.SGD(module.parameters(), lr=0.5)
                  for backend, module in compiled.items()}
    for _ in range(steps):  # the backends' steps alternate
        for backend, module in compiled.items():
            dist.barrier()
            start = time.perf_counter()
            loss = module(*batch)
            loss.backward()
            times[backend].append(time.perf_counter() - start)
            losses[backend].append(loss.item())
            optimizers[backend].step()  # so a wrong gradient shows in the next loss
            optimizers[backend].zero_grad()
    if rank == 0:
        results.put({backend: (times[backend][0], statistics.median(times[backend][1:]),
                               losses[backend]) for backend in backends})
    dist.destroy_process_group()


def measure(backends: tuple, cache_dir: str, layers: int = 0, steps: int = 6) -> dict:
    """backend -> (first step, median of the later steps: forward and backward) in seconds
    and the steps' losses, rank 0's (an SGD step after each, so the losses follow the
    gradients).
    Several backends' steps alternate, so their step times are measured side by side;
    first steps are cold only for the first backend."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(port, cache_dir, backends, layers, steps, results), nprocs=WORLD)
    return results.get()


NAMES = {"inductor": "whole program", "regions": "fxtp.compile", "blocks": "compile_blocks"}


def depth() -> dict:
    """First step (each alone, cold cache) at 2 and 8 layers and compiled step (the three
    side by side, 20 steps each), whole program against regions and per block; the ratios
    the targets are stated in, and each program's largest difference of a step's loss
    from the whole program's."""
    runs = {}
    for layers in (2, 8):
        for how in NAMES:
            with tempfile.TemporaryDirectory() as cache_dir:
                first, _, _ = measure((how,), cache_dir, layers)[how]
            runs[f"{how}_{layers}"] = {"first_step_s": first}
            print(f"{NAMES[how]:14} {layers} layers: first step {first:6.1f} s", flush=True)
        with tempfile.TemporaryDirectory() as cache_dir:
            side_by_side = measure(tuple(NAMES), cache_dir, layers, steps=21)
        for how, (_, step, losses) in side_by_side.items():
            drift = max(abs(a - b) for a, b in zip(losses, side_by_side["inductor"][2]))
            runs[f"{how}_{layers}"].update(step_ms=step * 1e3, loss_drift=drift)
            print(f"{NAMES[how]:14} {layers} layers: compiled step {step * 1e3:7.1f} ms, "
                  f"loss drift from the whole program {drift:.1e}", flush=True)

    def ratio(a, b, key):
        return runs[a][key] / runs[b][key]
    ratios = {f"{how}_first_8_over_2": ratio(f"{how}_8", f"{how}_2", "first_step_s")
              for how in NAMES}
    ratios.update({f"step_{how}_over_whole_{layers}":
                   ratio(f"{how}_{layers}", f"inductor_{layers}", "step_ms")
                   for how in ("regions", "blocks") for layers in (2, 8)})
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}")
    report = {"world": WORLD, "runs": runs, "ratios": ratios}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "compile_time.json").write_text(json.dumps(report, indent=2))
    return report


def main():
    if sys.argv[1:] == ["--depth"]:
        return depth()
    print(f"the demo's model (fxtp.examples.demo), {WORLD} gloo ranks, "
          f"{os.cpu_count()} CPUs, torch.compile(fxtp.parallelize(...)), training step")
    print(f"{'backend':10} {'first, cold cache':>18} {'first, warm cache':>18} "
          f"{'compiled step':>14}")
    for backend in sys.argv[1:] or ["inductor", "fxtp"]:
        with tempfile.TemporaryDirectory() as cache_dir:
            cold, step, _ = measure((backend,), cache_dir)[backend]
            warm, _, _ = measure((backend,), cache_dir)[backend]
        print(f"{backend:10} {cold:17.1f}s {warm:17.1f}s {step * 1e3:12.1f}ms")


if __name__ == "__main__":
    main()
