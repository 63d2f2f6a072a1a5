"""``python -m fxtp demo``: train a small Llama with tensor + sequence + loss parallelism and
show that it learns exactly what the single-device model learns.

With no launcher it spawns 2 gloo CPU ranks itself; under ``torchrun`` it uses the
launcher's ranks (NCCL on CUDA when there is a GPU per rank, else gloo). Every rank trains
the fxtp GraphModule; rank 0 also trains the unmodified single-device model on the same
batches and prints both losses per step, the collectives of one step and the step time.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fxtp
from fxtp.examples.llama import Llama, LlamaConfig, llama_sp_plan

CONFIG = LlamaConfig(vocab_size=512, dim=128, n_layers=2, n_heads=8, n_kv_heads=4,
                     multiple_of=32, max_seq_len=64)
AGREE = 1e-3  # |fxtp loss - single-device loss| allowed at every step (fp32, Adam steps)


class LanguageModel(nn.Module):
    """The Llama with its next-token loss, so loss parallel happens inside the graph."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.llama = Llama(cfg)

    def forward(self, tokens, targets):
        logits = self.llama(tokens)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def plan() -> dict:
    return {f"llama.{k}": v for k, v in llama_sp_plan(loss_parallel=True).items()}


def batches(cfg: LlamaConfig, steps: int, batch: int, device):
    """Sequences from a fixed random bigram chain: learnable, the same on every rank."""
    g = torch.Generator().manual_seed(0)
    successors = torch.randint(0, cfg.vocab_size, (cfg.vocab_size, 4), generator=g)
    for _ in range(steps):
        tokens = torch.empty(batch, cfg.max_seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, cfg.vocab_size, (batch,), generator=g)
        for t in range(cfg.max_seq_len):
            choice = torch.randint(0, 4, (batch,), generator=g)
            tokens[:, t + 1] = successors[tokens[:, t], choice]
        tokens = tokens.to(device)
        yield tokens[:, :-1], tokens[:, 1:]


def train(steps: int, batch: int, lr: float) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{torch.cuda.current_device()}") \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    model = LanguageModel(CONFIG).to(device)
    reference = LanguageModel(CONFIG).to(device) if rank == 0 else None
    if reference is not None:
        reference.load_state_dict(model.state_dict())
    data = list(batches(CONFIG, steps, batch, device))
    gm = fxtp.parallelize(model, plan(), example_inputs=data[0])
    opt = torch.optim.AdamW(gm.parameters(), lr=lr)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=lr) if reference else None
    if rank == 0:
        print(f"fxtp demo: Llama (dim {CONFIG.dim}, {CONFIG.n_layers} layers, vocab "
              f"{CONFIG.vocab_size}), batch {batch} x {CONFIG.max_seq_len} tokens, {world} "
              f"ranks ({dist.get_backend()}), TP + sequence parallel + loss parallel")
        print(f"{'step':>4}  {'fxtp loss':>10}  {'single-device':>13}  {'|diff|':>8}")
    from tqdm import tqdm
    times, worst, counts = [], 0.0, None
    for step, (tokens, targets) in enumerate(tqdm(data, disable=rank != 0, leave=False)):
        start = time.perf_counter()
        with fxtp.count_collectives() as fwd:
            loss = gm(tokens, targets)
        with fxtp.count_collectives() as bwd:
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        counts = counts or (fwd, bwd)
        if reference is not None:
            ref_loss = reference(tokens, targets)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            diff = abs(loss.item() - ref_loss.item())
            worst = max(worst, diff)
            tqdm.write(f"{step:4d}  {loss.item():10.5f}  {ref_loss.item():13.5f}  {diff:8.1e}")
    if rank == 0:
        fwd, bwd = counts
        print(f"collectives per step, forward: {_describe(fwd)}; backward: {_describe(bwd)}")
        print(f"step time: median {statistics.median(times[1:] or times) * 1e3:.1f} ms "
              f"(first step {times[0] * 1e3:.1f} ms)")
        verdict = "agree" if worst <= AGREE else "DISAGREE"
        print(f"loss curves {verdict}: max |fxtp - single-device| = {worst:.2e} "
              f"(allowed {AGREE:g})")
        if worst > AGREE:
            raise SystemExit(1)


def _describe(counter) -> str:
    return ", ".join(f"{n} {kind} ({counter.bytes[kind] / 1024:.0f} KiB)"
                     for kind, n in sorted(counter.counts.items())) or "none"


def _spawned(rank: int, world: int, port: int, args) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        train(args.steps, args.batch, args.lr)
    finally:
        dist.destroy_process_group()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--world", type=int, default=2,
                        help="ranks to spawn when not under torchrun (default 2)")


def main(args: argparse.Namespace) -> None:
    if "RANK" in os.environ:  # under torchrun
        cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(
            os.environ.get("LOCAL_WORLD_SIZE", 1))
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
        try:
            train(args.steps, args.batch, args.lr)
        finally:
            dist.destroy_process_group()
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_spawned, args=(args.world, port, args), nprocs=args.world)
