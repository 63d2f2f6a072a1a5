"""LoRA fine-tuning (PEFT) under tensor parallelism. ``plan="auto"`` on a ``PeftModel``
takes the wrapped transformers model's plan under its FQN; a LoRA layer planned colwise or
rowwise splits its adapters with its base layer (colwise: ``lora_B`` by output features;
rowwise: ``lora_A`` by input features; the r-wide side replicated), so the adapters add
no collective. Parity in fp64 with the single-device PEFT model (base weights frozen, as
PEFT leaves them), strict (no fallback). DoRA's weight norm over a rowwise layer's sharded
input features is summed across ranks, never gathered."""
import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import fxtp
from fxtp.passes.graph import STAMPED
from tests.helpers import corpus
from tests.helpers.corpus import L, TOKENS
from tests.helpers.parity import check_parity

peft = pytest.importorskip("peft", reason="pip install -e '.[test]'")
TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
LAYER = "base_model.model.model.layers.0."


R = 4


def lora_llama(use_dora=False, layers=L, modules_to_save=None, dropout=0.0,
               checkpointing=None):
    """A small Hugging Face Llama with rank-4 adapters on five of its seven projections,
    both factors random (PEFT's default makes ``lora_B`` zero: no gradient to check).
    ``checkpointing``: Hugging Face's gradient checkpointing with these keyword arguments,
    and the embedding's output made to require gradients, as PEFT's recipe has it."""
    config = peft.LoraConfig(r=R, lora_alpha=8, target_modules=TARGETS, lora_dropout=dropout,
                             init_lora_weights=False, use_dora=use_dora,
                             modules_to_save=modules_to_save)
    model = corpus._hf("LlamaConfig", "LlamaForCausalLM", num_hidden_layers=layers)
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
        model.enable_input_require_grads()
    return peft.get_peft_model(model, config)


def lora_parity(rank, world, plan, use_dora=False):
    return check_parity(rank, world, lambda: lora_llama(use_dora), plan, [TOKENS],
                        dtype=torch.float64, strict=True, input_grads=False,
                        kwargs={"use_cache": False}, output=lambda out: out.logits,
                        with_bytes=use_dora)


def test_auto_on_a_lora_model_trains_its_adapters_as_on_one_device(ranks):
    """Forward, Megatron's collectives, as for the model without adapters: the row-parallel
    outputs, the vocab-parallel embedding and the gathered logits. Backward, the colwise
    inputs' gradients, into which the colwise adapters' r-wide ``lora_A`` gradients are
    summed, and buckets of the adapters' partial weight gradients: 6 all-reduces at 2
    layers where the model without adapters needs 4 (summing each ``lora_A`` output's
    gradient on its own took 12)."""
    assert ranks.run(lora_parity, "auto")[0] == ({"all_reduce": 2 * L + 1, "all_gather": 1},
                                                 {"all_reduce": 3 * L})


def test_a_lora_layer_splits_its_adapters_with_its_base_layer(fake_group):
    fake_group(2)
    gm = fxtp.parallelize(lora_llama(), "auto", example_inputs=(TOKENS,),
                          example_kwargs={"use_cache": False})
    placements = {name[len(LAYER):]: p for name, p in gm.fxtp.param_placements.items()
                  if name.startswith(LAYER)}
    assert placements["self_attn.q_proj.base_layer.weight"] == Shard(0)
    assert placements["self_attn.q_proj.lora_B.default.weight"] == Shard(0)
    assert placements["self_attn.q_proj.lora_A.default.weight"] == Replicate()
    assert placements["self_attn.k_proj.weight"] == Shard(0)  # no adapter
    assert placements["self_attn.o_proj.base_layer.weight"] == Shard(1)
    assert placements["self_attn.o_proj.lora_A.default.weight"] == Shard(1)
    assert placements["self_attn.o_proj.lora_B.default.weight"] == Replicate()
    assert not gm.fxtp.fallbacks


def test_dora_trains_as_on_one_device_with_no_gather(ranks):
    """DoRA (``use_dora=True``) scales each output feature by a trained magnitude over the
    norm of the adapted weight's row, ``|W + s B A|`` over the input features. Colwise,
    rows are local. Rowwise, the input features are sharded: each norm is one all-reduce
    of the layer's output size (was: a reported gather of the whole weight), and PEFT's
    ``B A``, built as ``lora_B(lora_A(eye))``, is partial at (in, r) and reduce-scattered
    there, by rows, into the weight's layout (was: at (in, out)). Backward as plain LoRA:
    the magnitudes' partial gradients join their block's bucket."""
    fwd, bwd, fwd_bytes, _ = ranks.run(lora_parity, "auto", True)[0]
    rowwise_in = [corpus.HIDDEN, 64]  # o_proj, down_proj
    assert fwd == {"all_reduce": 2 * L + 1 + len(rowwise_in) * L,
                   "reduce_scatter": len(rowwise_in) * L, "all_gather": 1}
    assert bwd == {"all_reduce": 3 * L}
    assert fwd_bytes["reduce_scatter"] == L * sum(n * R * 8 for n in rowwise_in)  # fp64


def test_a_lora_models_layers_are_traced_once_and_stamped(fake_group):
    """The frozen embedding gives layer 0 an input that needs no gradient, and layer 0's
    adapters give layer 1 one that does: two references, the later layers stamped from
    layer 1. PEFT keeps each adapter in a ``ModuleDict``, a block of its own; such nested
    blocks trace with the layer holding them (before: every layer was traced, 4.2 s
    against 1.1 s to parallelize at 8 layers)."""
    fake_group(2)
    gm = fxtp.parallelize(lora_llama(layers=4), "auto", example_inputs=(TOKENS,),
                          example_kwargs={"use_cache": False})
    layers = LAYER.removesuffix("0.")
    assert gm.meta[STAMPED] == {f"{layers}{i}": f"{layers}1" for i in (2, 3)}


def stamped_lora_parity(rank, world):
    return check_parity(rank, world, lambda: lora_llama(layers=3), "auto", [TOKENS],
                        dtype=torch.float64, strict=True, input_grads=False,
                        kwargs={"use_cache": False}, output=lambda out: out.logits)


def test_stamped_lora_layers_train_as_on_one_device(ranks2):
    """Layer 2 stamped from layer 1: parity and the counts of the unstamped model."""
    assert ranks2.run(stamped_lora_parity)[0] == ({"all_reduce": 2 * 3 + 1, "all_gather": 1},
                                                  {"all_reduce": 3 * 3})


def saved_modules_parity(rank, world):
    return check_parity(rank, world, lambda: lora_llama(modules_to_save=SAVED), "auto",
                        [TOKENS], dtype=torch.float64, strict=True, input_grads=False,
                        kwargs={"use_cache": False}, output=lambda out: out.logits)


SAVED = ["embed_tokens", "lm_head"]


def test_modules_fine_tuned_whole_are_split_as_the_plan_says(ranks):
    """``modules_to_save`` (new tokens: the embedding and head trained whole beside the
    adapters) wraps each module in a ``ModulesToSaveWrapper``; the plan's style for the
    module splits the frozen original and the trainable copy alike (vocab-parallel
    embedding, colwise head), at plain LoRA's forward collectives (before: a PlanError).
    Backward one all-reduce more: the embedding trains, so layer 0's input gradient is
    summed from its sharded q, k and v (the frozen embedding of plain LoRA needs none)."""
    assert ranks.run(saved_modules_parity)[0] == ({"all_reduce": 2 * L + 1, "all_gather": 1},
                                                  {"all_reduce": 3 * L + 1})


def test_a_saved_modules_copy_and_original_are_both_split(fake_group):
    fake_group(2)
    gm = fxtp.parallelize(lora_llama(modules_to_save=SAVED), "auto",
                          example_inputs=(TOKENS,), example_kwargs={"use_cache": False})
    head = "base_model.model.lm_head."
    assert gm.fxtp.param_placements[head + "original_module.weight"] == Shard(0)
    assert gm.fxtp.param_placements[head + "modules_to_save.default.weight"] == Shard(0)
    assert dict(gm.named_parameters())[head + "modules_to_save.default.weight"].requires_grad


def fine_tuning_parity(rank, world, reentrant):
    make = lambda: lora_llama(dropout=0.1, checkpointing={"use_reentrant": reentrant})  # noqa: E731
    programs = []
    counts = check_parity(rank, world, make, "auto", [TOKENS], dtype=torch.float64,
                          strict=True, input_grads=False, kwargs={"use_cache": False},
                          output=lambda out: out.logits, post=programs.append)
    regions = [n for n, _ in programs[0].named_modules()
               if n.rpartition(".")[2] == "checkpoint_0"]
    return counts, regions


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_lora_fine_tuning_with_dropout_and_checkpointing(ranks, reentrant):
    """PEFT's usual recipe: adapter dropout and Hugging Face's gradient checkpointing.
    Each layer keeps its checkpoint region (both forms recomputed non-reentrantly; before,
    every region was dropped: the trace's attribute-recording subclass of each layer made
    Hugging Face's checkpointing wrapper think it was not the outermost, and reentrant
    regions were traced through). Dropout draws single device's masks; the adapter's
    dropout of the layer's input hands its partial gradient on to that input, summed
    there anyway: plain LoRA's collectives (backward was 12 all-reduces)."""
    counts, regions = ranks.run(fine_tuning_parity, reentrant)[0]
    assert counts == ({"all_reduce": 2 * L + 1, "all_gather": 1}, {"all_reduce": 3 * L})
    assert regions == [f"{LAYER.removesuffix('0.')}{i}.checkpoint_0" for i in range(L)]
