"""fxtp.explain: the report states, before anything runs, the collectives a step issues
forward and backward (checked against what gloo ranks then measure), shapes, placements,
per-layer costs, parameter memory and fallbacks; it prints as a table and round-trips
through JSON."""
import dataclasses
import json
import warnings

import pytest
import torch
from torch.export import Dim

import fxtp
from fxtp.inspection.report import Comm, Report
from tests.helpers import transformer_models as tm
from tests.helpers.models import UNRULED_PLAN, Unruled
from tests.helpers.models import TARGETS, WithLoss, prefixed
from tests.helpers.parity import example

TOKENS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
L = 2
CFG = tm.LlamaConfig()
ACTIVATION = 2 * 16 * CFG.dim * 4  # one fp32 (B, T, D) activation


def llama():
    return tm.Llama(tm.LlamaConfig(n_heads=8, n_kv_heads=4))


CASES = {
    "llama": lambda: (llama(), tm.llama_plan(), [TOKENS], {}),
    "llama_sp": lambda: (llama(), tm.llama_plan(seq_parallel=True), [TOKENS], {}),
    "gpt2_sp_tied": lambda: (tm.GPT2(), tm.gpt2_sp_plan(), [TOKENS], {}),
    "llama_sp_loss_parallel": lambda: (
        WithLoss(llama()), prefixed(tm.llama_sp_plan(loss_parallel=True)), [TOKENS, TARGETS],
        {}),
    "fallback_input_grads": lambda: (Unruled(), UNRULED_PLAN, [example(2, 4, 16)], {}),
    "llama_dynamic": lambda: (llama(), tm.llama_plan(), [TOKENS], dict(dynamic_shapes={
        "tokens": {0: Dim("batch", max=64), 1: Dim("seq", min=2, max=32)}})),
}


def explained_and_measured(rank, world, case):
    """The report of a case, and the collectives one forward and backward step issues."""
    torch.manual_seed(0)
    model, plan, inputs, options = CASES[case]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = fxtp.parallelize(model, plan, example_inputs=inputs, **options)
    input_grads = case == "fallback_input_grads"
    xs = [x.clone().requires_grad_(input_grads) if x.is_floating_point() else x
          for x in inputs]
    with fxtp.count_collectives() as fwd:
        out = gm(*xs)
    with fxtp.count_collectives() as bwd:
        out.sum().backward()
    measured = {"forward": {"counts": dict(fwd.counts), "bytes": dict(fwd.bytes)},
                "backward": {"counts": dict(bwd.counts), "bytes": dict(bwd.bytes)}}
    return fxtp.explain(gm, input_grads=input_grads), measured


def explained(world, case, rank=0):
    """The report of a case (a name in CASES, or such a function) on one rank of a fake
    group (no run)."""
    import torch.distributed as dist
    from fxtp.kernels.torch_compat import init_fake_process_group
    init_fake_process_group(world, rank=rank)
    try:
        torch.manual_seed(0)
        model, plan, inputs, options = (CASES.get(case) or case)()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fxtp.explain(fxtp.parallelize(model, plan, example_inputs=inputs,
                                                 **options))
    finally:
        dist.destroy_process_group()


def totals(report):
    s = report.summary
    return {"forward": dataclasses.asdict(s.forward), "backward": dataclasses.asdict(s.backward)}


@pytest.mark.parametrize("case", list(CASES))
def test_static_collectives_equal_what_the_ranks_measure(ranks, case):
    """Counts and bytes per rank, forward and backward, by kind: the backward ones derived
    from the forward collectives' conjugates."""
    report, measured = ranks.run(explained_and_measured, case)[0]
    assert totals(report) == measured
    assert report.summary.bytes_per_step == sum(
        sum(measured[d]["bytes"].values()) for d in ("forward", "backward"))


def test_llama_report_states_the_megatron_collectives_shapes_and_memory():
    world = 4
    report = explained(world, "llama")
    s = report.summary
    logits_shard = 2 * 16 * CFG.vocab_size // world * 4
    assert totals(report) == {
        "forward": {"counts": {"all_reduce": 2 * L + 1, "all_gather": 1},
                    "bytes": {"all_reduce": (2 * L + 1) * ACTIVATION,
                              "all_gather": logits_shard}},
        "backward": {"counts": {"all_reduce": 2 * L + 1},
                     "bytes": {"all_reduce": (2 * L + 1) * ACTIVATION}}}
    layers = {l.layer: l for l in s.layers}
    assert list(layers) == ["tok_embeddings", "layers.0", "layers.1", "norm", "output"]
    for i in range(L):  # attention and feed-forward: one all-reduce each way, each
        assert layers[f"layers.{i}"].forward.counts == {"all_reduce": 2}
        assert layers[f"layers.{i}"].backward.bytes == {"all_reduce": 2 * ACTIVATION}
    assert layers["output"].forward.counts == {"all_gather": 1}
    assert layers["output"].backward.counts == {"all_reduce": 1}  # the head's input
    model = llama()
    full = sum(p.numel() * 4 for p in model.parameters())
    norms = sum(p.numel() * 4 for n, p in model.named_parameters() if "norm" in n)
    assert (s.param_bytes_unsharded, s.param_bytes) == (full, (full - norms) // world + norms)
    assert s.fallbacks == [] and s.symbolic_dims == {}
    nodes = {n.name: n for n in report.nodes}
    wq = nodes["layers_0_attention_wq_weight"]
    assert (wq.module, wq.global_shape, wq.local_shape, wq.placement) == \
        ("layers.0.attention.wq", [32, 32], [8, 32], "S(0)")
    gather = next(n for n in report.nodes if n.collective == "all_gather")
    assert (gather.op, gather.module, gather.global_shape, gather.local_shape) == \
        ("fxtp.all_gather", "output", [2, 16, 64], [2, 16, 64])
    assert gather.forward == [Comm("all_gather", logits_shard)]
    assert gather.backward == []  # the gradient of replicated logits is chunked


def test_sequence_parallel_report_lists_each_gather_and_scatter():
    world = 2
    report = explained(world, "llama_sp")
    kinds = [n.collective for n in report.nodes if n.collective]
    assert sorted(kinds) == sorted(["all_gather"] * (2 * L + 2) +
                                   ["reduce_scatter"] * (2 * L + 1) +
                                   ["grad_sync_bucket"] * (L + 1))  # per block, + the rest
    buckets = [n for n in report.nodes if n.collective == "grad_sync_bucket"]
    assert all(b.forward == [] for b in buckets)
    assert {b.module: b.backward for b in buckets} == {  # 2 norms per block, the final one
        **{f"layers.{i}": [Comm("all_reduce", 2 * CFG.dim * 4)] for i in range(L)},
        "": [Comm("all_reduce", CFG.dim * 4)]}
    scatter = next(n for n in report.nodes if n.collective == "reduce_scatter")
    assert (scatter.module, scatter.global_shape, scatter.local_shape, scatter.placement) == \
        ("tok_embeddings", [2, 16, 32], [2, 8, 32], "S(1)")
    assert scatter.forward == [Comm("reduce_scatter", ACTIVATION)]
    assert scatter.backward == [Comm("all_gather", ACTIVATION // world)]


def test_fallbacks_are_listed_with_their_module():
    report = explained(2, "fallback_input_grads")
    (fallback,) = report.summary.fallbacks
    assert (fallback.op, fallback.module) == ("aten._fft_r2c.default", "mix")
    assert "gathering its inputs to Replicate" in fallback.message
    assert next(n for n in report.nodes if n.name == fallback.node).fallback == \
        fallback.message


def test_dynamic_dims_are_reported_symbolically_with_their_size_hints():
    report = explained(2, "llama_dynamic")
    hints = report.summary.symbolic_dims
    assert sorted(hints.values()) == [2, 16]
    batch, seq = sorted(hints, key=hints.get)
    embedding = next(n for n in report.nodes if n.op == "fxtp.vocab_parallel_embedding")
    assert embedding.global_shape == [batch, seq, 32]
    assert "Symbolic dims (sizes and bytes use these hints)" in str(report)


def test_report_prints_a_table_of_nodes_and_a_summary():
    text = str(explained(2, "llama"))
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("node "))
    assert header.split() == ["node", "op", "module", "global", "shape", "local", "shape",
                              "placement", "collective", "forward", "backward"]
    row = next(line for line in lines if line.startswith("all_reduce "))
    assert row.split()[1:] == ["fxtp.all_reduce", "tok_embeddings", "(2,", "16,", "32)",
                               "(2,", "16,", "32)", "R", "all_reduce", "AR", "4.0", "KiB",
                               "-"]
    summary = lines[lines.index(next(l for l in lines if l.startswith("Collectives per"))):]
    summary = next(line for line in summary if line.startswith("all_reduce "))
    assert summary.split() == ["all_reduce", "5", "20.0", "KiB", "5", "20.0", "KiB"]
    assert "Fallbacks (ops gathered to Replicate): none" in text


def test_json_round_trips_to_the_report_and_checks_field_types():
    report = explained(2, "llama_dynamic")
    data = json.loads(report.to_json())
    assert data["schema_version"] == 2
    assert data["summary"]["held_whole"] == []  # every parameter the plan shards, sharded
    assert Report.from_json(report.to_json()) == report
    node = data["nodes"][0]
    assert set(node) == {"name", "op", "module", "dtype", "global_shape", "local_shape",
                         "placement", "collective", "forward", "backward", "fallback"}
    for path, bad in [(("summary", "bytes_per_step"), "12"),
                      (("summary", "forward", "counts"), {"all_reduce": 1.5}),
                      (("nodes", 0, "global_shape"), [2.0]),
                      (("nodes", 0, "placement"), None)]:
        broken = json.loads(report.to_json())
        *parents, last = path
        target = broken
        for key in parents:
            target = target[key]
        target[last] = bad
        with pytest.raises(TypeError, match=r"report\." + str(path[0])):
            Report.from_dict(broken)
    del data["summary"]["fallbacks"]
    with pytest.raises(TypeError, match="fallbacks"):
        Report.from_dict(data)
