"""Run one benchmark case in fresh rank processes and collect what each rank reports."""
from __future__ import annotations

import socket

import torch.multiprocessing as mp


def spawn_ranks(target, world: int, args: tuple, processes: int = None) -> dict:
    """Start ``processes`` (default ``world``) spawned processes running
    ``target(rank, world, port, *args, out)``, each putting ``(rank, dict)`` on ``out``;
    return rank -> dict, or ``{"error": message}`` for the first rank that reported one."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=target, args=(r, world, port, *args, out))
             for r in range(world if processes is None else processes)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    errors = [r["error"] for r in results.values() if "error" in r]
    return {"error": errors[0]} if errors else results
