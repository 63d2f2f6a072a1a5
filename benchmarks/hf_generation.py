"""Serving every transformers causal-LM family that trains at parity
(``benchmarks/results/hf_families.json``): ``fxtp.parallelize_causal_lm`` under the family's
own plan on 2 gloo ranks, greedy generation of 6 tokens after a 5-token prompt for 2
sequences, against the model's own ``generate()`` on one device.

Each family is the small model of ``benchmarks.hf_families`` in the dtype (and experts
implementation) its training parity ran in, in ``eval()`` mode, its weights drawn from
N(0, 0.3) (away from near-uniform logits, whose argmax ties); a hybrid family's 2 layers
are one linear-attention and one attention layer (:func:`mixed_layers`). The tokens must be equal
and
the module strict (no fallback); a decode step's collectives are recorded. A family
whose cache ``parallelize_causal_lm`` cannot hold (linear-attention and state-space
layers) is recorded with the error that refuses it. Results:
``benchmarks/results/hf_generation.json``.

    python -m benchmarks.hf_generation [FAMILY ...]   # some families: their entries updated
"""
from __future__ import annotations

import argparse
import datetime
import json
import warnings

import torch

from benchmarks.hf_families import RESULTS, _last_error, make, write_report

PROMPT, NEW, BATCH, CACHE = 5, 6, 2, 24
LAYERS_BY_KEY = {"jamba": dict(attn_layer_period=2, attn_layer_offset=1),
                 "nemotron_h": dict(layers_block_type=["linear_attention", "full_attention"])}


def mixed_layers(kind: str) -> dict:
    """Config values giving a hybrid family's 2 small layers one linear-attention (or
    state-space) layer and one attention layer, as its real configs mix them (the first
    2 of its default ``layer_types`` may be linear only, which leaves its cache no
    sequence length)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    if kind in LAYERS_BY_KEY:
        return LAYERS_BY_KEY[kind]
    types = getattr(CONFIG_MAPPING[kind](), "layer_types", None) or []
    linear = [t for t in types if "linear" in t or "mamba" in t]
    other = [t for t in types if t not in linear]
    return dict(layer_types=[linear[0], other[0]]) if linear and other else {}


def generate(rank, world, kind, dtype, experts):
    import fxtp
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = make(kind, experts, **mixed_layers(kind)).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    gm = fxtp.parallelize_causal_lm(model, batch_size=BATCH, max_cache_len=CACHE, strict=True)
    ids = torch.randint(3, 128, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))
    tokens = gm.generate(ids, max_new_tokens=NEW, do_sample=False)
    expected = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    with fxtp.count_collectives() as decode:
        gm(input_ids=tokens[:, -1:], cache_position=torch.tensor([tokens.shape[1]]))
    return torch.equal(tokens, expected), dict(decode.counts)


def run(pool, kind, trained: dict) -> dict:
    dtype = getattr(torch, trained["dtype"].removeprefix("torch."))
    try:
        equal, decode = pool.run(generate, kind, dtype, trained["experts"], timeout=300)[0]
    except Exception as e:  # noqa: BLE001 - reported
        message = _last_error(str(e))
        refused = "PlanError" in message and "parallelize_causal_lm" in message
        return {"result": "refused" if refused else "failed", "why": message}
    return {"result": "equal" if equal else "differs", "dtype": str(dtype),
            "decode": decode}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kinds", nargs="*", help="model types (default: every family)")
    args = parser.parse_args()
    from tests.helpers.harness import RankPool
    import transformers
    trained = json.loads((RESULTS / "hf_families.json").read_text())["families"]
    kinds = args.kinds or [k for k, found in trained.items() if found["result"] == "parity"]
    report = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "transformers": transformers.__version__, "world": 2, "families": {}}
    pool = RankPool(2)
    try:
        for kind in kinds:
            report["families"][kind] = found = run(pool, kind, trained[kind])
            print(kind, json.dumps(found), flush=True)
    finally:
        pool.close()
    write_report(report, RESULTS / "hf_generation.json", partial=bool(args.kinds))


if __name__ == "__main__":
    main()
