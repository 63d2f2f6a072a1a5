"""Per-rank peak memory of the cross-entropy loss, forward and backward, on (N, V) logits:
``F.cross_entropy`` on the full logits vs ``fxtp.cross_entropy`` on each rank's V / world
classes (gloo ranks on CPU).

Memory is the peak of live tensor bytes the loss allocates (its outputs, temporaries
visible at the ATen level, and the logits' gradient), measured by a dispatch mode that
tracks every new storage until it is freed; the logits themselves are not counted.
Expected: at most about 1/world of the unsharded loss. At its peak F.cross_entropy holds
three (N, V) buffers in the logits' dtype (the saved log-softmax, the NLL gradient, the
logits' gradient). Loss parallel holds one fp32 (N, V / world) buffer, reused in place
(shifted logits, then their exponentials; in backward the softmax, then the gradient), plus
the gradient in the logits' dtype when that is not fp32: 1/(3 world) for fp32 logits,
1/world for bf16 (fp32 work buffer + bf16 gradient vs three bf16 buffers).

Run: ``python -m benchmarks.loss_memory`` (writes ``benchmarks/results/loss_memory.json``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import socket
import weakref

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

RESULTS = pathlib.Path(__file__).parent / "results"


class PeakLiveBytes(TorchDispatchMode):
    """``peak``: the most bytes held at once by storages created inside the mode. Outputs
    sharing an input's storage (views, in-place results) are not new memory."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._tracked: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {t.untyped_storage()._cdata for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self._tracked:
                continue
            self._tracked.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, storage.nbytes())
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self._tracked.discard(key)
        self.live -= nbytes


def _inputs(n: int, v: int, dtype, rank: int = 0, world: int = 1):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(n, v, generator=g).to(dtype).chunk(world, 1)[rank].clone()
    target = torch.randint(0, v, (n,), generator=g)
    return logits.requires_grad_(), target


def _measure(loss_fn, logits, target) -> int:
    with PeakLiveBytes() as mem:
        loss_fn(logits, target).backward()
    return mem.peak


def _rank(rank: int, world: int, port: int, n: int, v: int, dtype, results) -> None:
    import torch.distributed as dist

    import fxtp
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    logits, target = _inputs(n, v, dtype, rank, world)
    results.put((rank, _measure(fxtp.cross_entropy, logits, target)))
    dist.destroy_process_group()


def loss_parallel_peak(world: int, n: int, v: int, dtype) -> int:
    """The largest per-rank peak over ``world`` spawned gloo ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, n, v, dtype, results))
             for r in range(world)]
    for p in procs:
        p.start()
    peaks = dict(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return max(peaks.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        logits, target = _inputs(args.tokens, args.vocab, dtype)
        full = _measure(F.cross_entropy, logits, target)
        del logits
        print(f"{str(dtype):15} logits ({args.tokens}, {args.vocab}): unsharded peak "
              f"{full / 2**20:8.1f} MiB")
        for world in args.worlds:
            peak = loss_parallel_peak(world, args.tokens, args.vocab, dtype)
            ratio = peak / full
            print(f"{'':15} world {world}: loss-parallel peak per rank {peak / 2**20:8.1f} MiB"
                  f"  ratio {ratio:.3f}  (1/world = {1 / world:.3f})")
            rows.append(dict(dtype=str(dtype), tokens=args.tokens, vocab=args.vocab,
                             world=world, unsharded_peak_bytes=full,
                             loss_parallel_peak_bytes=peak, ratio=ratio))
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "loss_memory.json"
    out.write_text(json.dumps(rows, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
