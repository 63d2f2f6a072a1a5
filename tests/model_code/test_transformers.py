"""Whole transformers under the standard TP plan: GPT-2 style (tied embeddings) and
Llama-3 style (RMSNorm in fp32, rotary embeddings real or complex, GQA, SwiGLU), against
the single-device model, with the exact collectives of an L-layer model."""
import pytest
import torch

import fxtp
from fxtp import Replicate
from tests.helpers import transformer_models as tm
from tests.helpers.parity import check_parity

TOKENS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
DTYPES = pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])


def gpt2_plan():
    return {"wte": fxtp.RowwiseParallel(input_layouts=Replicate()), **tm.gpt2_layer_plan(),
            "lm_head": fxtp.ColwiseParallel(output_layouts=Replicate())}


def llama_plan():
    return tm.llama_tp_plan()


def gpt2(rank, world, dtype, tie):
    return check_parity(rank, world, lambda: tm.GPT2(tie_weights=tie), gpt2_plan(), [TOKENS],
                        dtype=dtype, input_grads=False)


def llama(rank, world, dtype, rope, repeat, n_kv_heads=4, with_bytes=False):
    cfg = tm.LlamaConfig(n_heads=8, n_kv_heads=n_kv_heads, rope=rope, repeat_mode=repeat)
    return check_parity(rank, world, lambda: tm.Llama(cfg), llama_plan(), [TOKENS],
                        dtype=dtype, input_grads=False, with_bytes=with_bytes)


L = 2
# forward: 2 per layer, the vocab-parallel embedding's sum, the logits' gather;
# backward: 2 per layer and the final norm's output feeding the colwise lm_head.
EXPECTED = ({"all_reduce": 2 * L + 1, "all_gather": 1}, {"all_reduce": 2 * L + 1})


@DTYPES
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_gpt2(ranks, dtype, tie):
    assert ranks.run(gpt2, dtype, tie)[0] == EXPECTED


@DTYPES
@pytest.mark.parametrize("rope,repeat", [("real", "expand"), ("complex", "repeat_interleave")])
def test_llama(ranks, dtype, rope, repeat):
    assert ranks.run(llama, dtype, rope, repeat)[0] == EXPECTED


def llama_prepared(rank, world):
    plan = {**llama_plan(),
            "layers.*.attention": fxtp.PrepareModuleInput(
                input_layouts=(Replicate(), None), desired_input_layouts=(Replicate(), None)),
            "layers.*.feed_forward": fxtp.PrepareModuleInput(input_layouts=Replicate(),
                                                             desired_input_layouts=Replicate())}
    cfg = tm.LlamaConfig(n_heads=8, n_kv_heads=4)
    return check_parity(rank, world, lambda: tm.Llama(cfg), plan, [TOKENS],
                        dtype=torch.float64, input_grads=False)


def test_prepare_module_input_changes_no_collective_count(ranks):
    assert ranks.run(llama_prepared)[0] == EXPECTED


def test_collective_bytes_are_the_megatron_formula(ranks):
    """Per rank and step: each all-reduce moves one (B, T, D) activation; the logits
    gather sends this rank's (B, T, V / N) shard."""
    world = ranks.world
    fwd, bwd, fwd_bytes, bwd_bytes = ranks.run(llama, torch.float64, "real", "expand", 4,
                                               True)[0]
    cfg, (b, t) = tm.LlamaConfig(), TOKENS.shape
    activation = b * t * cfg.dim * 8
    assert fwd_bytes == {"all_reduce": (2 * L + 1) * activation,
                         "all_gather": b * t * cfg.vocab_size // world * 8}
    assert bwd_bytes == {"all_reduce": (2 * L + 1) * activation}


@pytest.mark.parametrize("repeat_mode", ["expand", "repeat_interleave"])
def test_llama_with_fewer_kv_heads_than_ranks_gathers_no_keys_or_values(ranks4, repeat_mode):
    """2 KV heads on 4 ranks: each rank computes the KV head its query heads use (the KV
    weights stay whole; their gradients join each block's bucketed all-reduce): no k / v
    gathers, whichever way the heads are repeated."""
    fwd, bwd = ranks4.run(llama, torch.float64, "real", repeat_mode, 2)[0]
    assert fwd == {"all_reduce": 2 * L + 1, "all_gather": 1}
    assert bwd == {"all_reduce": 3 * L + 1}


def torch_reference_plan(local_output_for_attn):
    """The plan torch's own TP tests give their test Transformer (no sequence parallel),
    written with torch's style objects and placements, unchanged."""
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=TorchReplicate(),
                                          output_layouts=TorchReplicate()),
        "pos_embeddings": RowwiseParallel(input_layouts=TorchReplicate(),
                                          output_layouts=TorchReplicate()),
        "layers.*.attention.wq": ColwiseParallel(use_local_output=local_output_for_attn),
        "layers.*.attention.wk": ColwiseParallel(use_local_output=local_output_for_attn),
        "layers.*.attention.wv": ColwiseParallel(use_local_output=local_output_for_attn),
        "layers.*.attention.wo": RowwiseParallel(),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(),
        "output": ColwiseParallel(output_layouts=TorchReplicate()),
    }


def torch_transformer(rank, world, local_output_for_attn):
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer
    args = ModelArgs(dropout_p=0.0, vocab_size=16)
    tokens = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(0))
    return check_parity(rank, world, lambda: Transformer(args),
                        torch_reference_plan(local_output_for_attn), [tokens],
                        dtype=torch.float64, input_grads=False)


@pytest.mark.parametrize("local_output", [True, False], ids=["local", "dtensor"])
def test_torch_reference_plan_verbatim_on_torchs_test_transformer(ranks, local_output):
    fwd, bwd = ranks.run(torch_transformer, local_output)[0]
    # 2 per layer; the token and position embeddings' partial lookups, summed, then
    # reduced once (the plan's layouts say once each); logits gather
    assert fwd == {"all_reduce": 2 * 2 + 1, "all_gather": 1}
    assert bwd == {"all_reduce": 2 * 2 + 1}


def dynamic(rank, world, model_name):
    from torch.export import Dim
    make, plan, arg = {"gpt2": (tm.GPT2, gpt2_plan, "idx"),
                       "llama": (lambda: tm.Llama(tm.LlamaConfig(n_heads=8, n_kv_heads=4)),
                                 llama_plan, "tokens")}[model_name]
    shapes = [(2, 16), (3, 5), (1, 32)]
    inputs = [[torch.randint(0, 64, s, generator=torch.Generator().manual_seed(i))]
              for i, s in enumerate(shapes)]
    return check_parity(rank, world, make, plan(), [TOKENS], dtype=torch.float64,
                        input_grads=False, inputs_per_step=inputs,
                        dynamic_shapes={arg: {0: Dim("batch", max=64),
                                              1: Dim("seq", min=2, max=32)}})


@pytest.mark.parametrize("model_name", ["gpt2", "llama"])
def test_one_graph_serves_every_batch_and_sequence_length(ranks, model_name):
    """Traced once with dynamic batch and sequence dims; three steps of three shapes."""
    assert ranks.run(dynamic, model_name)[0] == EXPECTED
