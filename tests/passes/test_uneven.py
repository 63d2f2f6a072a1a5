"""Sizes that do not divide by the world size are dealt unevenly, invisibly to the user.

A sharded dim whose size does not divide by the world size is dealt in whole units as
``torch.chunk`` deals them (``UnitShard``): vocabulary rows for the embedding, the head and
loss parallel, whole heads for attention projections whose head count does not divide
(6 heads at 4 ranks: 2, 2, 2, 0). Results, gradients and optimizer steps match the single
device at Megatron's collective counts, and checkpoints keep global shapes."""
import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

import fxtp
from fxtp.passes.placement import UnitShard
from tests.helpers import corpus
from tests.helpers import transformer_models as tm
from tests.helpers.corpus import L
from tests.helpers.harness import pool_of
from tests.helpers.parity import check_parity

GPT2_VOCAB = 50257  # GPT-2's: divides by none of 2, 3, 4
TOKENS = torch.randint(0, GPT2_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
TARGETS = torch.randint(0, GPT2_VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
MEGATRON_TP = ({"all_reduce": 2 * L + 1, "all_gather": 1}, {"all_reduce": 2 * L + 1})


def gpt2_six_heads():
    """GPT-2's vocabulary with 6 heads of 8 (hidden 48, MLP 192)."""
    return tm.GPT2(tm.GPT2Config(vocab_size=GPT2_VOCAB, n_head=6, n_embd=48))


def gpt2_parity(rank, world):
    programs = []
    counts = check_parity(rank, world, gpt2_six_heads, corpus.gpt2_tp_plan(), [TOKENS],
                          dtype=torch.float64, strict=True, input_grads=False, steps=2,
                          post=programs.append)
    return counts, programs[0].fxtp.param_placements


@pytest.mark.parametrize("world", [2, 4])
def test_gpt2_vocabulary_and_six_heads_at_parity(pools, world):
    """Vocab-parallel embedding, colwise head with gathered logits (tied), attention and
    MLP: parity in fp64 with no fallback (strict) and Megatron's counts."""
    counts, placements = pool_of(pools, world).run(gpt2_parity)[0]
    assert counts == MEGATRON_TP
    assert placements["wte.weight"] == UnitShard(0, GPT2_VOCAB)
    heads = Shard(0) if 6 % world == 0 else UnitShard(0, 6)
    assert placements["h.0.attn.q_proj.weight"] == heads
    assert placements["h.0.attn.c_proj.weight"] == (Shard(1) if 6 % world == 0 else
                                                    UnitShard(1, 6))


def nanogpt_parity(rank, world):
    make = lambda: corpus.NanoGPT(vocab_size=GPT2_VOCAB, n_head=6, n_embd=48)  # noqa: E731
    return check_parity(rank, world, make, corpus.nanogpt_plan(), [TOKENS, TARGETS],
                        dtype=torch.float64, strict=True, input_grads=False, steps=2,
                        output=lambda out: out[1], output_index=1)


def test_loss_parallel_on_an_uneven_vocabulary(pools):
    """nanoGPT's loss on 50257 classes dealt over 2 ranks (25129, 25128), never gathered:
    its 3 all-reduces count each class once."""
    fwd, bwd = pool_of(pools, 2).run(nanogpt_parity)[0]
    assert fwd == {"all_reduce": 2 * L + 1 + 3}
    assert bwd == {"all_reduce": 2 * L + 1}


def mlp_parity(rank, world):
    from tests.helpers import models
    return check_parity(rank, world, lambda: models.MLP(dim=8, hidden=6), models.MLP_PLAN,
                        [torch.randn(4, 8, generator=torch.Generator().manual_seed(2))],
                        dtype=torch.float32, strict=True)


def test_colwise_and_rowwise_linears_with_uneven_features(ranks4):
    """6 hidden features at 4 ranks, fp32: colwise 2, 2, 2, 0 and rowwise alike; one
    all-reduce forward, one backward (the input's gradient)."""
    assert ranks4.run(mlp_parity)[0] == ({"all_reduce": 1}, {"all_reduce": 1})


def uneven_state_dict(rank, world):
    torch.manual_seed(0)
    model = gpt2_six_heads()
    gm = fxtp.parallelize(model, corpus.gpt2_tp_plan(), example_inputs=(TOKENS,))
    sd = fxtp.state_dict(gm)
    embedding, heads = sd["wte.weight"], sd["h.0.attn.q_proj.weight"]
    assert isinstance(embedding, DTensor) and embedding.placements == (Shard(0),)
    assert embedding.shape == (GPT2_VOCAB, 48)
    assert embedding.to_local().data_ptr() == \
        gm.get_parameter("wte.weight").to_local().data_ptr()
    assert heads.placements == (Replicate(),) and heads.shape == (48, 48)  # gathered whole
    assert gm.state_dict()["h.0.attn.q_proj.weight"].placements == (Replicate(),)
    full = fxtp.full_state_dict(gm)
    for key, value in model.state_dict().items():
        assert torch.equal(full[key], value), key


def test_state_dict_keeps_global_shapes(ranks4):
    """Vocabulary rows are DTensor's own uneven ``Shard`` (shared with the module); whole
    heads, which DTensor cannot describe, are handed out gathered."""
    ranks4.run(uneven_state_dict)
