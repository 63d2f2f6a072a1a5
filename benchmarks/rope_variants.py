"""Per-rank training step of one Llama with its rotary embedding written three ways:
complex numbers (Meta's), stacked rotated pairs (torchtune's ``torch.stack``) and HF's
``rotate_half`` (``torch.cat``). The functions are equal; with every op sharded by a rule
(no fallback gathers) their step times should be too.

World size 8 on a fake process group in this process (collectives move nothing: the
per-rank compute and framework cost is measured), sequence-parallel plan, fp32 on CPU.
The variants are timed in alternating rounds in one process, so they share the machine's
state; each figure is the median over rounds.

    python -m benchmarks.rope_variants [--rounds 7] [--steps 3]

Results: ``benchmarks/results/rope_variants.json``.
"""
from __future__ import annotations

import argparse
import json
import pathlib

import torch
import torch.distributed as dist

from benchmarks.timing import alternating

RESULTS = pathlib.Path(__file__).parent / "results"
VARIANTS = ("complex", "stack", "real")
SHAPE = dict(dim=1024, n_layers=2, n_heads=16, n_kv_heads=8, vocab_size=8192, multiple_of=256,
             max_seq_len=512)
TARGET = 1.10  # stack vs complex


def build(rope: str, world: int):
    import fxtp
    from fxtp.examples.llama import Llama, LlamaConfig, llama_sp_plan
    torch.manual_seed(0)
    model = Llama(LlamaConfig(rope=rope, **SHAPE))
    tokens = torch.randint(0, SHAPE["vocab_size"], (1, SHAPE["max_seq_len"]))
    gm = fxtp.parallelize(model, llama_sp_plan(), example_inputs=(tokens,))
    assert gm.fxtp.fallbacks == [], gm.fxtp.fallbacks
    return gm, tokens, torch.optim.AdamW(gm.parameters(), lr=1e-4)


def step(gm, tokens, opt):
    gm(tokens).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3, help="steps timed per round")
    parser.add_argument("--world", type=int, default=8)
    args = parser.parse_args(argv)
    from fxtp.kernels.torch_compat import init_fake_process_group
    init_fake_process_group(args.world, rank=0)
    torch.set_num_threads(1)
    try:
        runs = {rope: build(rope, args.world) for rope in VARIANTS}
        for run in runs.values():
            step(*run)  # warm-up
        seconds = alternating({rope: (lambda run=run: step(*run)) for rope, run in runs.items()},
                              args.rounds, args.steps)
    finally:
        dist.destroy_process_group()
    ms = {rope: 1e3 * s for rope, s in seconds.items()}
    result = {"shape": SHAPE, "world": args.world, "ms_per_step": ms,
              "stack_vs_complex": ms["stack"] / ms["complex"],
              "real_vs_complex": ms["real"] / ms["complex"], "target": TARGET}
    for rope in VARIANTS:
        print(f"{rope:>8}: {ms[rope]:8.1f} ms/step  ({ms[rope] / ms['complex']:.3f}x complex)")
    verdict = "met" if result["stack_vs_complex"] <= TARGET else "MISSED"
    print(f"stack RoPE / complex RoPE = {result['stack_vs_complex']:.3f} "
          f"(target <= {TARGET}: {verdict})")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "rope_variants.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
