"""Run a function on every rank of a persistent multi-process gloo group.

Starting processes and process groups costs seconds, so each world size gets one pool per
test process (each ``pytest -n`` worker has its own). ``pool.run(fn, *args)`` calls
``fn(rank, world_size, *args)`` on every rank and returns the per-rank results; an exception
on any rank fails the call with every rank's traceback, and the pool is restarted so later
tests start clean.
"""
from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import time
import traceback

import torch.multiprocessing as mp

TIMEOUT_S = 300
"""How long a test waits for its ranks, and a rank in a collective for the others: with two
workers' pools on two busy cores, a rank may run far behind the one waiting for it."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tasks, results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            result = fn(rank, world, *args)
            pickle.dumps(result)  # fails here, reported, rather than in the queue's thread
            results.put((rank, True, result))
        except BaseException:  # noqa: BLE001 - reported to the test process
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world: int):
        self.world = world
        self._start()

    def _start(self):
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(self.world)]
        self.procs = [ctx.Process(target=_worker, args=(r, self.world, port, self.tasks[r],
                                                        self.results), daemon=True)
                      for r in range(self.world)]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout: float = TIMEOUT_S):
        pickle.dumps((fn, args))  # a task that cannot reach the ranks fails here, not by timeout
        for q in self.tasks:
            q.put((fn, args))
        out, errors = [None] * self.world, []
        try:
            for _ in range(self.world):
                rank, ok, value = self.results.get(timeout=timeout)
                if ok:
                    out[rank] = value
                else:
                    errors.append(f"--- rank {rank} ---\n{value}")
        except queue.Empty:
            errors.append(f"timed out after {timeout}s waiting for ranks")
        if errors:
            self.restart()
            raise AssertionError("\n".join(sorted(errors)))
        return out

    def restart(self):
        self.close(graceful=False)
        self._start()

    def close(self, graceful: bool = True):
        close_pools([self], graceful)


def close_pools(pools, graceful: bool = True) -> None:
    """Stop every rank of ``pools`` together: each is told to leave (``graceful``) and given
    3 s in all to exit; one still exiting then (a compile worker pool) is killed."""
    procs = [p for pool in pools for p in pool.procs]
    if graceful:
        for pool in pools:
            for q in pool.tasks:
                q.put(None)
    deadline = time.monotonic() + (3 if graceful else 0.1)
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


def pool_of(pools: dict, world: int) -> RankPool:
    """The pool of ``world`` ranks in ``pools`` (the session's), started on first use."""
    if world not in pools:
        pools[world] = RankPool(world)
    return pools[world]
