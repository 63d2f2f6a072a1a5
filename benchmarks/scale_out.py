"""TP inside, FSDP2 across: fxtp against torchtitan's recipe on a ("dp", "tp") mesh.

4 gloo CPU ranks (one thread each), mesh 2 x 2. Both variants shard
:class:`fxtp.examples.llama.Llama` with torchtitan's TP + SP plan on ``mesh["tp"]`` and then
``fully_shard`` every block and the root on ``mesh["dp"]``; "compiled" compiles each block
first (regional compilation, as torchtitan does). The loss is torchtitan's default, loss
parallel: the head's logits stay sharded by class and the loss is torch's ``loss_parallel()``
for the DTensor recipe and ``fxtp.cross_entropy`` for fxtp (``--replicated-head``: gather
the logits and take ``F.cross_entropy`` on every rank, in both). The DTensor recipe is torch's
``parallelize_module`` (with the benchmark's local head counts, see
:data:`benchmarks.dtensor_tp.WHY_DTENSOR_PATCHED`); fxtp's is ``fxtp.parallelize``. Each
(variant, size) runs in fresh processes: step time (forward, backward, AdamW) as the median
of ``--repeats`` runs of ``--steps`` steps after warm-up; peak memory per rank twice: the
peak of live tensors over one more step (torch's ``MemTracker``: what scales with the model)
and peak RSS above the process's RSS before the model was built (which also counts the
libraries a variant imports: fxtp's trace loads torch.export, about 30 MiB that does not
grow with the model). Results: ``benchmarks/results/scale_out.json``.

``--cuda``: the same on one CUDA device, as rank 0 of 4 on a fake process group (each
rank's compute and the frameworks' overhead; collectives move nothing, so the all-gathers'
output is garbage, which does not change the time), with a third, GPU-sized model; peak
memory is the CUDA allocator's peak (and, eager, ``MemTracker``'s live-tensor peak beside it),
and the attention kernels each variant ran are recorded (``sdpa_kernels``: the backend SDPA
picks decides what attention keeps for backward). It builds both models on the meta device
and allocates them after ``fully_shard`` (``--meta-init``, torchtitan's order): a model
built on the GPU and sharded after leaves each recipe's allocator with the blocks the full
model was freed from, and parameters and optimizer state then land in blocks up to 1 MiB
larger than asked, which showed as peak memory neither recipe's tensors hold.
Results: ``benchmarks/results/scale_out_cuda.json``.

``--fake``: one CPU process as rank 0 of a fake group of 4, as ``--cuda`` does on a GPU:
one rank's compute and framework overhead, with neither the gloo transport nor 4 ranks
sharing this machine's cores. Each eager variant then also reports ``shared_ms``: the time
per step, by torch's profiler over ``--steps`` more steps (a few ms high from profiling),
inside work both recipes do the same way (matmuls, attention kernels, FSDP2's own regions,
the optimizer step); ``ratio_eager["floor"]`` = fxtp's ``shared_ms`` / the DTensor
recipe's step time is the least eager ratio fxtp could reach were everything else it runs
(the model's elementwise ops, TP's collectives) free. Results:
``benchmarks/results/scale_out_fake.json``.

``--replicated-head`` adds a third eager variant, ``handwritten_eager``: Megatron's TP + SP
written by hand (:func:`benchmarks.handwritten.handwritten_sp`: weights cut per rank, hooks
for the sequence all-gathers and reduce-scatters, no framework between the model and its
kernels), with FSDP2 per block the same way. It is what any TP recipe doing this math costs
on this machine, and ``ratio_handwritten_eager`` sets both recipes against it.

    python -m benchmarks.scale_out [--quick] [--cuda | --fake] [--replicated-head] [--meta-init]
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import pathlib
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


from benchmarks.ranks import spawn_ranks

RESULTS = pathlib.Path(__file__).parent / "results"
VARIANTS = ("dtensor_eager", "fxtp_eager", "dtensor_compiled", "fxtp_compiled")
HANDWRITTEN = "handwritten_eager"  # Megatron-style TP + SP by hand; replicated head only


def sizes(quick: bool, cuda: bool = False) -> dict:
    """Name -> (config, batch per dp rank, sequence length)."""
    from fxtp.examples.llama import LlamaConfig
    small = (LlamaConfig(dim=128, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=1024,
                         multiple_of=32, max_seq_len=64), 4, 64)
    if quick:
        return {"small": small}
    found = {"small": small,
             "medium": (LlamaConfig(dim=512, n_layers=4, n_heads=8, n_kv_heads=4,
                                    vocab_size=4096, multiple_of=64, max_seq_len=128), 4, 128)}
    if cuda:
        found["large"] = (LlamaConfig(dim=2048, n_layers=8, n_heads=16, n_kv_heads=8,
                                      vocab_size=32768, multiple_of=256, max_seq_len=1024),
                          4, 1024)
    return found


def torchtitan_plan(loss_parallel: bool):
    """torchtitan's Llama TP + SP plan, in torch's own styles; with ``loss_parallel`` (its
    default) the head's output stays a DTensor sharded by class, for ``loss_parallel()``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel)
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1),
                                  output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                 desired_input_layouts=(Replicate(), None)),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                    desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }


def build(variant: str, model, tokens, mesh, loss_parallel: bool, device=None):
    """The sharded model: TP on ``mesh["tp"]``, then ``fully_shard`` per block and root.
    With ``device``, ``model`` is on the meta device and is allocated there after
    ``fully_shard`` and initialized (torchtitan's order: no rank ever holds more than its
    share, and neither recipe's allocator keeps the blocks the full model was freed from)."""
    import fxtp
    from fxtp.examples.llama import llama_sp_plan
    from torch.distributed.fsdp import fully_shard
    if variant == HANDWRITTEN:
        from benchmarks.handwritten import handwritten_sp
        module = handwritten_sp(model, mesh["tp"].get_local_rank(), mesh["tp"].size(),
                                mesh["tp"].get_group().group_name)
    elif variant.startswith("dtensor"):
        from torch.distributed.tensor.parallel import parallelize_module
        for layer in model.layers:  # see benchmarks.dtensor_tp.WHY_DTENSOR_PATCHED
            layer.attention.n_heads //= mesh["tp"].size()
            layer.attention.n_kv_heads //= mesh["tp"].size()
        module = parallelize_module(model, mesh["tp"], torchtitan_plan(loss_parallel))
    else:
        module = fxtp.parallelize(model, llama_sp_plan(loss_parallel), mesh["tp"],
                                  example_inputs=(tokens,),
                                  **({"device": "meta"} if device else {}))
    for i, block in list(module.layers.named_children()):
        if variant.endswith("compiled"):
            block = torch.compile(block)
            module.layers.register_module(i, block)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(module, mesh=mesh["dp"])
    if device:
        module.to_empty(device=device)
        if variant.startswith("dtensor"):
            with torch.no_grad():
                for m in module.modules():
                    if hasattr(m, "reset_parameters"):
                        m.reset_parameters()
        else:
            fxtp.init_weights(module, model)
    return module


def loss_backward(variant: str, loss_parallel: bool, tp_mesh):
    """``(logits, targets) -> loss``, backward run, as each recipe writes it: torch's
    ``loss_parallel()`` on the DTensor logits, ``fxtp.cross_entropy`` on fxtp's local shard,
    or, with the head replicated, ``F.cross_entropy``."""
    def replicated(logits, targets):
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        return loss

    def dtensor(logits, targets):
        from torch.distributed.tensor.parallel import loss_parallel as context
        with context():  # active for the backward too, as torch's docs require
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
        return loss

    def fxtp(logits, targets):
        import fxtp
        loss = fxtp.cross_entropy(logits.flatten(0, 1), targets.flatten(), group=tp_mesh)
        loss.backward()
        return loss

    return replicated if not loss_parallel else dtensor if variant.startswith("dtensor") else fxtp


def train_step(module, opt, tokens, targets, loss_fn) -> torch.Tensor:
    """One step: forward, loss and backward by ``loss_fn``, AdamW; the detached loss."""
    loss = loss_fn(module(tokens), targets)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def tensor_peak_mib(step, module, opt, device) -> float:
    """Peak MiB of live tensors (parameters, gradients, optimizer state, activations) over
    one training ``step()``, by torch's ``MemTracker``."""
    from torch.distributed._tools.mem_tracker import MemTracker
    tracker = MemTracker()
    tracker.track_external(module, opt)
    with tracker:
        step()
    return tracker.get_tracker_snapshot("peak")[device]["Total"] / 2 ** 20


SHARED_WORK = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product",
               "FSDP::", "Optimizer.step")


def shared_ms(step, steps: int) -> float:
    """Milliseconds per ``step()`` (over ``steps``) inside :data:`SHARED_WORK`'s events,
    by the union of their spans (a matmul inside another counted once)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.name.startswith(SHARED_WORK))
    total_us, covered = 0, float("-inf")
    for start, end in spans:
        if end > covered:
            total_us += end - max(start, covered)
            covered = end
    return total_us / 1e3 / steps


def sdpa_kernels(step) -> list:
    """The attention kernels one training ``step()`` runs, by name."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "attention" in func.name():
                self.seen.add(func.name())
            return func(*args, **(kwargs or {}))

    with Record() as record:
        step()
    return sorted(record.seen)


def _rank(rank, world, port, variant, size, args, out):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/fxtp_inductor_bench")
    if args.fake:
        from fxtp.kernels.torch_compat import init_fake_process_group
        if args.cuda:
            torch.cuda.set_device(0)
        init_fake_process_group(world, rank=rank)
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=600))
    device = "cuda" if args.cuda else "cpu"
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from fxtp.examples.llama import Llama
        cfg, batch, seq = sizes(args.quick, args.cuda)[size]
        mesh = init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "tp"))
        g = torch.Generator().manual_seed(1 + mesh["dp"].get_local_rank())
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device)
        targets = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device)
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        torch.manual_seed(0)
        if args.meta_init:
            with torch.device("meta"):
                model = Llama(cfg)
        else:
            model = Llama(cfg).to(device)
        module = build(variant, model, tokens, mesh, args.loss_parallel,
                       device if args.meta_init else None)
        opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
        step = functools.partial(train_step, module, opt, tokens, targets,
                                 loss_backward(variant, args.loss_parallel, mesh["tp"]))
        sync = (torch.cuda.synchronize if args.cuda else
                (lambda: None) if args.fake else dist.barrier)
        start = time.perf_counter()
        loss0 = step().item()
        for _ in range(args.warmup - 1):
            step()
        sync()
        warmup = time.perf_counter() - start
        if args.cuda:
            torch.cuda.reset_peak_memory_stats()
        per_step = []
        for _ in range(args.repeats):
            sync()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            sync()
            per_step.append((time.perf_counter() - start) / args.steps)
        found = {"loss0": loss0, "warmup_s": warmup, "median_s": statistics.median(per_step),
                 "min_s": min(per_step)}
        if args.cuda:
            found["peak_mib"] = torch.cuda.max_memory_allocated() / 2 ** 20
            found["sdpa_kernels"] = sdpa_kernels(step)
            if variant.endswith("eager"):
                found["tensor_peak_mib"] = tensor_peak_mib(step, module, opt, tokens.device)
        else:
            found["rss_peak_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                     - base) / 1024
            if variant.endswith("eager"):  # a dispatch mode would re-trace compiled code
                found["peak_mib"] = tensor_peak_mib(step, module, opt, tokens.device)
                if args.fake:
                    found["shared_ms"] = shared_ms(step, args.steps)
        out.put((rank, found))
    except Exception as e:  # noqa: BLE001 - reported in the results
        out.put((rank, {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}))
    finally:
        dist.destroy_process_group()


def run_one(variant, size, args) -> dict:
    results = spawn_ranks(_rank, 4, (variant, size, args), processes=1 if args.fake else 4)
    if "error" in results:
        return results
    found = {"median_ms": 1e3 * max(r["median_s"] for r in results.values()),
             "min_ms": 1e3 * max(r["min_s"] for r in results.values()),
             "warmup_s": max(r["warmup_s"] for r in results.values()),
             "loss0": results[0]["loss0"]}
    for key in ("peak_mib", "rss_peak_mib", "tensor_peak_mib", "shared_ms"):
        if key in results[0]:
            found[key] = max(r[key] for r in results.values())
    if "sdpa_kernels" in results[0]:
        found["sdpa_kernels"] = results[0]["sdpa_kernels"]
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cuda", action="store_true", help="one GPU, rank 0 of a fake group")
    parser.add_argument("--fake", action="store_true", help="one CPU process, rank 0 of a "
                        "fake group; with the floor of the eager ratio")
    parser.add_argument("--sizes", nargs="*", help="default: all (small only with --quick)")
    parser.add_argument("--variants", nargs="*", choices=VARIANTS + (HANDWRITTEN,),
                        help=f"default: all ({HANDWRITTEN} too with --replicated-head and "
                             "no --meta-init)")
    parser.add_argument("--replicated-head", dest="loss_parallel", action="store_false",
                        help="gather the logits and take F.cross_entropy on every rank "
                             "(default: loss parallel, torchtitan's default)")
    parser.add_argument("--meta-init", action="store_true",
                        help="build on the meta device, allocate after fully_shard "
                             "(torchtitan's order); default with --cuda")
    args = parser.parse_args()
    args.meta_init = args.meta_init or args.cuda
    args.fake = args.fake or args.cuda
    if args.variants is None:
        args.variants = VARIANTS + (() if args.loss_parallel or args.meta_init else
                                    (HANDWRITTEN,))
    if HANDWRITTEN in args.variants and (args.loss_parallel or args.meta_init):
        parser.error(f"{HANDWRITTEN} gathers its logits and slices weights it was built "
                     "with: run it with --replicated-head and without --meta-init")
    report = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "mesh": ("dp 2 x tp 2, rank 0 of a fake group on " +
                       (torch.cuda.get_device_name() if args.cuda else "one CPU thread")
                       if args.fake else
                       f"dp 2 x tp 2, gloo, 1 thread per rank, {os.cpu_count()} cores"),
              "peak": ("peak_mib: CUDA allocator peak" if args.cuda else
                       "peak_mib: live tensors (MemTracker, eager); rss_peak_mib: RSS above "
                       "the start"),
              "loss": "loss parallel" if args.loss_parallel else "replicated head",
              "init": "meta device, allocated after fully_shard" if args.meta_init else
                      "built on the device, then sharded",
              "sizes": {}}
    for size in args.sizes or sizes(args.quick, args.cuda):
        rows = report["sizes"][size] = {v: run_one(v, size, args) for v in args.variants}
        for mode in ("eager", "compiled"):
            fx_, dt = rows.get(f"fxtp_{mode}", {}), rows.get(f"dtensor_{mode}", {})
            if "median_ms" in fx_ and "median_ms" in dt:
                rows[f"ratio_{mode}"] = {
                    key: fx_[key] / dt[key]
                    for key in ("median_ms", "peak_mib", "rss_peak_mib", "tensor_peak_mib")
                    if key in fx_ and key in dt}
                if "shared_ms" in fx_:
                    rows[f"ratio_{mode}"]["floor"] = fx_["shared_ms"] / dt["median_ms"]
        hand, dt = rows.get(HANDWRITTEN, {}), rows.get("dtensor_eager", {})
        if "median_ms" in hand and "median_ms" in dt:
            rows["ratio_handwritten_eager"] = {
                "handwritten / dtensor": hand["median_ms"] / dt["median_ms"],
                **({"fxtp / handwritten": rows["fxtp_eager"]["median_ms"] / hand["median_ms"]}
                   if "median_ms" in rows.get("fxtp_eager", {}) else {})}
        print(size, json.dumps(rows, indent=1), flush=True)
    RESULTS.mkdir(exist_ok=True)
    name = ("scale_out_cuda" if args.cuda else "scale_out_fake" if args.fake else
            "scale_out") + (
        "" if args.loss_parallel else "_replicated_head") + ".json"
    (RESULTS / name).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
