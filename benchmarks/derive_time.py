"""How long ``fxtp.derive_plan`` takes on Llama-3-8B's shape (``fxtp.examples.llama``: 32
layers, width 4096, 32 heads, 8 KV heads, FFN 14336, vocabulary 128256) at world 8, built on
the meta device (nothing allocated, no process group), for a (1, 2048) batch of tokens.

Issue 51's target: at most 10 s. Prints each run's seconds and where the time goes
(tracing, placing the candidate plans). Results: ``results/derive_time.json``.

    OMP_NUM_THREADS=1 python -m benchmarks.derive_time [--runs 3] [--layers 32]
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import time

import torch

RESULTS = pathlib.Path(__file__).parent / "results"
TARGET_S = 10.0


def llama_8b(layers: int):
    from fxtp.examples.llama import Llama, LlamaConfig
    cfg = LlamaConfig(vocab_size=128256, dim=4096, n_layers=layers, n_heads=32, n_kv_heads=8,
                      multiple_of=1024, ffn_dim_multiplier=1.3, max_seq_len=2048,
                      rope_theta=500000.0)
    with torch.device("meta"):
        return Llama(cfg)


def one_run(layers: int) -> dict:
    import fxtp
    from fxtp.planning import derive
    model = llama_8b(layers)
    tokens = torch.zeros(1, 2048, dtype=torch.int64)
    spent = {"place": 0.0, "places": 0}
    place = derive._Program._place

    def timed_place(self, plan):
        start = time.perf_counter()
        try:
            return place(self, plan)
        finally:
            spent["place"] += time.perf_counter() - start
            spent["places"] += 1
    derive._Program._place = timed_place
    try:
        start = time.perf_counter()
        plan = fxtp.derive_plan(model, example_inputs=(tokens,), world_size=8)
        total = time.perf_counter() - start
    finally:
        derive._Program._place = place
    assert not plan.placed.fallbacks
    return {"seconds": round(total, 2), "placing_s": round(spent["place"], 2),
            "placements": spent["places"]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args(argv)
    ffn = llama_8b(1).layers[0].feed_forward.w1.out_features
    assert ffn == 14336, ffn
    runs = [one_run(args.layers) for _ in range(args.runs)]
    for run in runs:
        print(json.dumps(run))
    best = min(r["seconds"] for r in runs)
    report = {"date": datetime.date.today().isoformat(), "layers": args.layers, "runs": runs,
              "best_s": best, "target_s": TARGET_S, "met": best <= TARGET_S}
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "derive_time.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
