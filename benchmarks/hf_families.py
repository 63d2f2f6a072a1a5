"""Every transformers causal-LM family that carries a tensor-parallel plan, under
``plan="auto"`` (or the plan fxtp derives, ``--plan derive``): parity with the
single-device model on 2 gloo ranks (``--world``).

Each family is built from its config class with small sizes (2 layers, hidden 32, 8 heads,
4 KV heads, vocabulary 128, 4 experts; the MLA families with their own head dims and all
KV heads), run once on one device, and checked by ``tests.helpers.parity.check_parity`` in strict
mode (a fallback fails): forward, every gradient, 3 AdamW steps, in fp64 with a tight
tolerance; else in fp64 with fp32's tolerance (a model that computes in fp32 inside:
Gemma's norms, linear attention); else in fp32. A mixture of experts whose default
``grouped_mm`` experts have no fp64 kernel on CPU is tried in fp64 with transformers'
``batched_mm`` experts first, at either tolerance. Each attempt's failure is recorded.
Families whose small config the config class refuses, or whose model does not run with it
on one device, are listed as such, and so are those whose plan names no layer (their
embedding's or head's alone), which ``"auto"`` refuses, and those torch.export itself
cannot trace (fxtp traces with it). Under ``--plan derive`` the family's own plan is not
needed, and the families that carry one for their embedding and head alone are checked
too. Results: ``benchmarks/results/hf_families.json`` (``hf_families_derive_w4.json``
for ``--plan derive --world 4``).

    python -m benchmarks.hf_families [FAMILY ...]   # some families: their entries updated
    python -m benchmarks.hf_families --plan derive --world 4
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import time
import warnings

import torch

RESULTS = pathlib.Path(__file__).parent / "results"
SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=4, head_dim=4,
             max_position_embeddings=64, attention_dropout=0.0, hidden_dropout=0.0,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             num_local_experts=4, num_experts=4, n_routed_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
             n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4,
             qk_nope_head_dim=4, v_head_dim=4, sliding_window=8, use_cache=False,
             intermediate_size_mlp=64, shared_expert_intermediate_size=32,
             linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=4,
             linear_value_head_dim=4, decoder_sparse_step=1,
             vocab_size_per_layer_input=128)  # Gemma-3n / 4: 262144 x layers by default
MLA = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa", "hy_v4",
       "minicpm3", "longcat_flash", "axk1", "axk2", "youtu", "sarvam_mla")
OWN = {  # what a family's config needs beyond SMALL to build and run small
    "codegen": dict(rotary_dim=4), "gptj": dict(rotary_dim=4),
    "bamba": dict(mamba_n_heads=8, mamba_d_head=8),
    "granitemoehybrid": dict(mamba_n_heads=8, mamba_d_head=8),
    "dots3_note_text": dict(num_key_value_heads=8),
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default",
                                                                    "rope_theta": 10000.0}}),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "gemma3n_text": dict(num_kv_shared_layers=0),  # its 15 shared layers of 2
    "longcat_flash": dict(head_dim=4),
    # its NVFP4 keys need 16-wide heads; its indexer scores keys with query heads of one
    # KV head, 2 at the small config's 8 heads over 4
    "kolibri1_1": dict(head_dim=16, index_num_heads=2),
    "qwen4_exp_text": dict(indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=4,
                           indexer_budget=4, indexer_compress_ratio=2),  # its attention's
}
SKIP = {"phi4_multimodal": "its default audio and vision towers do not fit a small config",
        "llama4": "its config is the multimodal one; its causal LM is llama4_text's"}


def families() -> list[str]:
    """Model types whose config carries ``base_model_tp_plan`` and that have a causal LM."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return [kind for kind, name in CONFIG_MAPPING_NAMES.items()
            if kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and
            getattr(getattr(transformers, name, None), "base_model_tp_plan", None)]


def make(kind: str, experts: str | None = None, **overrides):
    """The small model of ``kind``; ``experts`` names transformers' experts implementation
    (``None``: the family's default); ``overrides``: config values beyond its own."""
    sizes = dict(SMALL)
    if kind in MLA:  # head dims of their own; every head has its key
        sizes.pop("head_dim")
        sizes["num_key_value_heads"] = sizes["num_attention_heads"]
    sizes.update(OWN.get(kind, {}), **overrides)
    model = build(kind, sizes)
    if experts is not None:
        model.set_experts_implementation(experts)
    return model


def build(kind: str, values: dict):
    """The causal LM of ``kind`` from its config class with ``values``, with SDPA attention
    where the family takes it (eager where it refuses), on the current default device."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    config = CONFIG_MAPPING[kind](**values)
    config._attn_implementation = "sdpa"
    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[kind])
    try:
        return cls(config)
    except Exception:  # noqa: BLE001 - a family that refuses SDPA
        config._attn_implementation = "eager"
        return cls(config)


def check(rank, world, kind, dtype, tolerance, experts=None, plan="auto"):
    from tests.helpers.corpus import TOKENS
    from tests.helpers.parity import check_parity
    warnings.simplefilter("ignore")
    counts = check_parity(rank, world, lambda: make(kind, experts), plan, [TOKENS], dtype=dtype,
                          strict=True, input_grads=False, kwargs={"use_cache": False},
                          output=lambda out: out.logits, compare_dtype=tolerance)
    return [dict(c) for c in counts]


ATTEMPTS = ((torch.float64, torch.float64, None),  # (dtype, tolerance of, experts)
            (torch.float64, torch.float64, "batched_mm"),  # experts with an fp64 kernel
            (torch.float64, torch.float32, None),  # a model computing in fp32 inside
            (torch.float64, torch.float32, "batched_mm"),  # ... and experts
            (torch.float32, torch.float32, None))  # a kernel without an fp64 form


def run(pool, kind, plan="auto") -> dict:
    from tests.helpers.corpus import TOKENS
    try:  # the small config must build and run on one device
        model = make(kind)
        model(TOKENS, use_cache=False)
    except Exception as e:  # noqa: BLE001 - reported
        return {"result": "config refused", "why": f"{type(e).__name__}: {e}"[:300]}
    from fxtp import PlanError
    from fxtp.plans.huggingface import model_plan
    try:  # a plan for the embedding or head alone: "auto" refuses it
        model_plan(model)
    except PlanError as e:
        if plan == "auto":
            return {"result": "no layer plan", "why": str(e)}
    tried, grouped = [], "grouped_mm" in model.get_experts_implementation().values()
    for dtype, tolerance, experts in ATTEMPTS:
        if experts is not None and not grouped:
            continue
        start = time.perf_counter()
        try:
            fwd, bwd = pool.run(check, kind, dtype, tolerance, experts, plan,
                                timeout=600)[0]
            return {"result": "parity", "dtype": str(dtype), "tolerance": str(tolerance),
                    "experts": experts, "forward": fwd, "backward": bwd,
                    "seconds": round(time.perf_counter() - start, 1), "tried": tried}
        except Exception as e:  # noqa: BLE001 - the next attempt, or reported
            tried.append(f"{dtype} ({tolerance} tolerance, {experts or 'default'} experts):"
                         f" {_last_error(str(e))}")
    try:  # does torch.export itself trace the model, as fxtp needs?
        torch.export.export(model, (TOKENS,), {"use_cache": False}, strict=False)
    except Exception as e:  # noqa: BLE001 - reported
        return {"result": "export refuses", "why": f"{type(e).__name__}: {e}"[:300],
                "tried": tried}
    return {"result": "failed", "tried": tried}


def _last_error(message: str) -> str:
    lines = [line for line in message.splitlines() if "Error" in line]
    return (lines[-1] if lines else message)[:400]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kinds", nargs="*", help="model types (default: every family)")
    parser.add_argument("--plan", choices=("auto", "derive"), default="auto")
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    from tests.helpers.harness import RankPool
    import transformers
    kinds = args.kinds or [k for k in families() if k not in SKIP]
    report = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "transformers": transformers.__version__, "world": args.world,
              "plan": args.plan, "skipped": SKIP, "families": {}}
    pool = RankPool(args.world)
    try:
        for kind in kinds:
            report["families"][kind] = found = run(pool, kind, args.plan)
            print(kind, json.dumps(found), flush=True)
    finally:
        pool.close()
    name = "hf_families" if (args.plan, args.world) == ("auto", 2) else \
        f"hf_families_{args.plan}_w{args.world}"
    write_report(report, RESULTS / f"{name}.json", partial=bool(args.kinds))


def write_report(report: dict, path: pathlib.Path, partial: bool) -> None:
    """Write ``report`` (its ``"families"``) to ``path`` with a summary of the results; a
    ``partial`` re-run of some families updates their entries of the report there."""
    if partial and path.exists():
        rerun, report["families"] = report["families"], json.loads(path.read_text())[
            "families"]
        report["families"].update(rerun)
    results = [f["result"] for f in report["families"].values()]
    report["summary"] = {r: results.count(r) for r in sorted(set(results))}
    print(report["summary"])
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
