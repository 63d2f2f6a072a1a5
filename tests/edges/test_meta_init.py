"""Models built on the meta device: only this rank's shards are ever allocated, initialized
from the global shapes (the single-device distribution), one random stream per rank for
shards and one shared stream for replicated tensors."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fxtp
from tests.helpers import transformer_models as tm
from tests.helpers.parity import local_of

TOKENS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
MODELS = {"llama": (lambda: tm.Llama(tm.LlamaConfig(n_heads=8, n_kv_heads=4)), tm.llama_sp_plan),
          "gpt2": (tm.GPT2, tm.gpt2_sp_plan),  # GPT-2's LM head is tied to its embedding
          # 67 vocabulary rows: dealt unevenly (UnitShard), initialized as DTensor's uneven
          # Shard
          "gpt2_vocab_67": (lambda: tm.GPT2(tm.GPT2Config(vocab_size=67)), tm.gpt2_sp_plan)}


def on_meta(make):
    with torch.device("meta"):
        return make()


def same_as_a_real_model_with_the_gathered_weights(rank, world, name):
    make, plan = MODELS[name]
    torch.manual_seed(0)
    model = on_meta(make).double()
    gm = fxtp.parallelize(model, plan(), example_inputs=(TOKENS,), init_fn=tm.init_weights)
    assert all(t.is_meta for t in model.state_dict().values())  # the user's model untouched
    full = fxtp.full_state_dict(gm)
    real = make().double()
    real.load_state_dict(full)
    reference = fxtp.parallelize(real, plan(), example_inputs=(TOKENS,))
    out, ref_out = gm(TOKENS), reference(TOKENS)
    assert torch.equal(out, ref_out)
    out.square().sum().backward()
    ref_out.square().sum().backward()
    for (n, p), (_, q) in zip(gm.named_parameters(), reference.named_parameters()):
        assert torch.equal(p.grad, q.grad), n
    if name.startswith("gpt2"):  # the tied tensor was initialized once, as the embedding
        assert gm.lm_head.weight is gm.wte.weight
        assert 0.9 < full["wte.weight"].std() < 1.1
    return full


@pytest.mark.parametrize("name", list(MODELS))
def test_a_meta_model_computes_as_a_real_one_holding_its_gathered_weights(ranks, name):
    """Buffers, ties and every shard land where the graph reads them: outputs and
    gradients equal, bit for bit, those of the model parallelized from real weights (which
    the parity tests compare with single-device training)."""
    fulls = ranks.run(same_as_a_real_model_with_the_gathered_weights, name)
    assert all(torch.equal(fulls[0][k], f[k]) for f in fulls for k in fulls[0])


class Layers(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16, padding_idx=37)
        self.up = nn.Linear(16, 256)
        self.down = nn.Linear(256, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, tokens):
        return self.norm(self.down(torch.relu(self.up(self.embed(tokens)))))


LAYERS_PLAN = {"embed": fxtp.RowwiseParallel(), "up": fxtp.ColwiseParallel(),
               "down": fxtp.RowwiseParallel()}


def initialize(rank, world, seed):
    torch.manual_seed(seed)
    gm = fxtp.parallelize(on_meta(Layers), LAYERS_PLAN, example_inputs=(TOKENS,))
    local = {n: local_of(t).detach().clone() for n, t in gm.state_dict().items()}
    return local, fxtp.full_state_dict(gm)


def test_meta_init_draws_from_global_fans_with_independent_shards(ranks):
    """nn.Linear's bound is 1/sqrt(fan_in) of the global in_features: a rowwise shard with
    its local fan-in would exceed it. Shards of one tensor differ between ranks; replicated
    tensors are the same on every rank; the same seed gives the same shards."""
    world = ranks.world
    runs = ranks.run(initialize, 0)
    local, full = runs[0]
    for name, fan_in in [("up", 16), ("down", 256)]:
        bound = 1 / math.sqrt(fan_in)
        weight, bias = full[f"{name}.weight"], full[f"{name}.bias"]
        assert weight.abs().max() <= bound and bias.abs().max() <= bound
        assert weight.abs().max() > 0.99 * bound  # 4096 draws of uniform(-b, b)
        assert abs(weight.std() / (bound / math.sqrt(3)) - 1) < 0.05
    embed = full["embed.weight"]
    assert abs(embed.std() - 1) < 0.1 and torch.all(embed[37] == 0)  # padding_idx row
    assert torch.equal(full["norm.weight"], torch.ones(16))
    for name, dim in [("up.weight", 0), ("down.weight", 1), ("embed.weight", 0)]:
        shards = full[name].chunk(world, dim)
        assert not any(torch.equal(shards[0], s) for s in shards[1:]), name
    for r, (other_local, _) in enumerate(runs):
        assert torch.equal(other_local["down.bias"], local["down.bias"])  # replicated
    again, other_seed = ranks.run(initialize, 0), ranks.run(initialize, 1)
    assert all(torch.equal(a[0][k], b[0][k]) for a, b in zip(runs, again) for k in local)
    assert not torch.equal(other_seed[0][0]["up.weight"], local["up.weight"])


class Scaled(nn.Module):
    """A linear followed by a learned per-feature scale with no reset_parameters()."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return self.proj(x) * self.scale


def test_meta_tensors_nothing_initializes_are_named_with_the_fix(fake_group):
    fake_group(2)
    with torch.device("meta"):
        model = Scaled()
    with pytest.raises(fxtp.PlanError, match=r"meta-device tensors were left uninitialized: "
                                             r"'scale' \(Scaled has no reset_parameters\(\)\)"
                                             r".*init_fn=fn"):
        fxtp.parallelize(model, {"proj": fxtp.ColwiseParallel()},
                         example_inputs=(torch.randn(2, 8),))


LLAMA_3_8B = dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                  multiple_of=1024, ffn_dim_multiplier=1.3, max_seq_len=64)


def parallelize_8b_and_measure(layers=32, world=8, rank=3):
    """Run in a fresh process: parallelize a meta Llama-3-8B (of ``layers`` blocks) at
    ``world``; print JSON."""
    import time
    from fxtp.kernels.torch_compat import init_fake_process_group
    init_fake_process_group(world, rank=rank)
    start = time.perf_counter()
    config = tm.LlamaConfig(**{**LLAMA_3_8B, "n_layers": layers})
    model = on_meta(lambda: tm.Llama(config)).to(torch.bfloat16)
    gm = fxtp.parallelize(model, tm.llama_sp_plan(), example_inputs=(TOKENS[:1, :8],),
                          init_fn=tm.init_weights)
    print(json.dumps({"seconds": time.perf_counter() - start, **measures(gm, model)}))


GiB = 2 ** 30


def measures(gm, model) -> dict:
    """This process's peak RSS, the bytes ``gm`` holds, the bytes of the full ``model``,
    the local shape of the first w1 and how many NaN (uninitialized) values ``gm`` has."""
    import resource
    return {
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "local_bytes": sum(local_of(t).numel() * t.element_size()
                           for t in [*gm.parameters(), *gm.buffers()]),
        "full_bytes": sum(t.numel() * t.element_size() for t in model.state_dict().values()),
        "w1": list(local_of(gm.get_parameter("layers.0.feed_forward.w1.weight")).shape),
        "unwritten": sum(int(local_of(t).isnan().sum()) for t in gm.state_dict().values()),
    }


def in_a_fresh_process(function: str, *args) -> dict:
    """Run ``function(*args)`` of this module in a new Python process (its peak memory is
    its own); return the JSON it printed last."""
    call = f"{function}({', '.join(map(repr, args))})"
    run = subprocess.run(
        [sys.executable, "-c", f"from tests.edges.test_meta_init import {function}; {call}"],
        cwd=Path(__file__).resolve().parents[2], env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a 25 s measurement in a fresh process
@pytest.mark.parametrize("layers", [4, 32])
def test_an_8b_model_at_world_8_allocates_only_its_shards(layers):
    """Llama-3-8B's shapes (dim 4096, 14336 hidden, 128256 vocabulary, GQA 8 kv heads; 4
    of its 32 layers, and all 32) in bf16 (fp32 would double
    memory and time), on a fake group of 8 (rank 3). Peak RSS of the process, imports and
    tracing included, stays within the local shards plus 0.75 GiB: torch and the 32-layer
    traced graph take ~0.45 GiB here, and any full embedding or output matrix (1 GiB in
    bf16) would exceed it; the full 32-layer model is 15 GiB."""
    got = in_a_fresh_process("parallelize_8b_and_measure", layers)
    cfg = tm.LlamaConfig(**{**LLAMA_3_8B, "n_layers": layers})
    hidden, kv = 14336, cfg.n_kv_heads * cfg.dim // cfg.n_heads
    layer = 2 * cfg.dim * cfg.dim + 2 * cfg.dim * kv + 3 * cfg.dim * hidden
    sharded = cfg.n_layers * layer + 2 * cfg.vocab_size * cfg.dim
    replicated = (2 * cfg.n_layers + 1) * cfg.dim + 2 * cfg.max_seq_len * cfg.dim // cfg.n_heads
    assert got["w1"] == [hidden // 8, cfg.dim]
    assert got["local_bytes"] == 2 * (sharded // 8 + replicated)  # bf16, 32 layers: 1.87 GiB
    assert got["full_bytes"] > 2 * sharded  # 15 GiB at 32 layers
    assert got["unwritten"] == 0
    assert got["peak_rss"] < got["local_bytes"] + 0.75 * GiB, got


def shard_further_and_measure(world=8, rank=3, layers=8):
    """Run in a fresh process: the FSDP2 route for a meta Llama-3-8B-wide model of
    ``layers`` blocks on a (dp 2, tp 4) mesh of a fake group; print JSON."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from fxtp.kernels.torch_compat import init_fake_process_group
    init_fake_process_group(world, rank=rank)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    config = tm.LlamaConfig(**{**LLAMA_3_8B, "n_layers": layers})
    model = on_meta(lambda: tm.Llama(config)).to(torch.bfloat16)
    gm = fxtp.parallelize(model, tm.llama_sp_plan(), mesh["tp"],
                          example_inputs=(TOKENS[:1, :8],), device="meta")
    for block in gm.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(gm, mesh=mesh["dp"])
    gm.to_empty(device="cpu")
    fxtp.init_weights(gm, model, init_fn=tm.init_weights)
    print(json.dumps(measures(gm, model)))


@pytest.mark.slow  # 20 s; each rank's exact share is also asserted by test_scale_out.py
def test_the_fsdp2_route_allocates_only_the_dp_x_tp_share():
    """``parallelize(..., device="meta")``, ``fully_shard`` per block and root,
    ``to_empty``, ``fxtp.init_weights``: an 8-block model of Llama-3-8B's width (5.2 GiB
    in bf16) at dp 2 x tp 4 holds 1/8 of it, and the process peaks within that plus
    0.6 GiB (torch, FSDP and the trace take ~0.4 GiB): the TP shard alone (1/4, 1.3 GiB)
    would exceed it."""
    got = in_a_fresh_process("shard_further_and_measure")
    assert got["w1"] == [14336 // 8, 4096]  # rows: 1/4 by TP, then 1/2 by FSDP
    assert got["unwritten"] == 0
    assert got["local_bytes"] < got["full_bytes"] / 8 * 1.01
    assert got["peak_rss"] < got["local_bytes"] + 0.6 * GiB, got


def test_shards_kept_on_meta_are_traced_for_the_device_they_will_run_on(fake_group):
    """A Hugging Face Llama makes its position ids with ``device=`` its embeddings' device:
    with ``device="meta"`` the program is traced for the group's device (gloo: ``cpu``),
    so after ``to_empty(device="cpu")`` and ``fxtp.init_weights`` with HF's own
    initializer it runs; traced on meta, it asked for meta tensors at run time."""
    from transformers import LlamaConfig, LlamaForCausalLM
    fake_group(2)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = on_meta(lambda: LlamaForCausalLM(config))
    gm = fxtp.parallelize(model, "auto", example_inputs=(TOKENS,),
                          example_kwargs={"use_cache": False}, device="meta", strict=True)
    assert not any("device(type='meta')" in m.code for m in gm.modules()
                   if isinstance(m, torch.fx.GraphModule))
    gm.to_empty(device="cpu")
    fxtp.init_weights(gm, model, init_fn=model._init_weights)
    logits = gm(TOKENS, use_cache=False).logits
    assert logits.shape == (*TOKENS.shape, 128) and torch.isfinite(logits).all()


def test_init_weights_reaches_blocks_compiled_or_checkpointed_in_place(fake_group):
    """torch.compile and checkpoint_wrapper put ``_orig_mod`` / ``_checkpoint_wrapped_module``
    into the blocks' parameter names; init_weights finds them by the model's names and
    draws what it draws for the unwrapped result."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    fake_group(2)
    results = []
    for wrap in (False, True):
        torch.manual_seed(0)
        model = on_meta(lambda: tm.Llama(tm.LlamaConfig(n_layers=2)))
        gm = fxtp.parallelize(model, tm.llama_sp_plan(), example_inputs=(TOKENS,),
                              device="meta")
        if wrap:
            gm.layers.register_module("0", checkpoint_wrapper(gm.layers[0]))
            gm.layers.register_module("1", torch.compile(gm.layers[1], backend="eager"))
        gm.to_empty(device="cpu")
        torch.manual_seed(1)
        fxtp.init_weights(gm, model)
        results.append(fxtp.state_dict(gm))
    assert results[0].keys() == results[1].keys() == model.state_dict().keys()
    for key in results[0]:
        assert torch.equal(local_of(results[0][key]), local_of(results[1][key])), key
