"""Tied weights follow the tie: an embedding and an LM head sharing one weight are split the
same way (by vocab) for both uses, whichever side the plan names. The side left out gets
the style that splits the weight that way, replicated in and out: a vocab-parallel lookup
for the embedding, a colwise head with gathered logits. Inconsistent plans are errors
naming both FQNs."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxtp
from fxtp import ColwiseParallel, Replicate, RowwiseParallel, Shard
from tests.helpers import corpus
from tests.helpers import transformer_models as tm
from tests.helpers.corpus import L, TOKENS, VOCAB
from tests.helpers.parity import check_parity

TARGETS = torch.randint(0, VOCAB, TOKENS.shape, generator=torch.Generator().manual_seed(3))
MEGATRON_TP = ({"all_reduce": 2 * L + 1, "all_gather": 1}, {"all_reduce": 2 * L + 1})


def nanogpt_parity(rank, world):
    return check_parity(rank, world, corpus.NanoGPT, corpus.nanogpt_plan(), [TOKENS, TARGETS],
                        dtype=torch.float64, strict=True, input_grads=False,
                        output=lambda out: out[1], output_index=1)  # the loss


def test_nanogpt_head_planned_embedding_follows_with_loss_parallel(ranks):
    """nanoGPT (fused ``c_attn``, ``wte`` tied to ``lm_head``, loss inside ``forward``) under
    a plan naming only the head, colwise with sharded logits: ``wte`` becomes a
    vocab-parallel lookup (one all-reduce) and the loss is computed on the class shards
    (3 all-reduces), with no gather of the logits; one gradient for the shared weight."""
    fwd, bwd = ranks.run(nanogpt_parity)[0]
    assert fwd == {"all_reduce": 2 * L + 1 + 3}
    assert bwd == {"all_reduce": 2 * L + 1}


def gpt2_parity(rank, world, side):
    styles = {"lm_head": ColwiseParallel(output_layouts=Replicate()),
              "wte": RowwiseParallel(input_layouts=Replicate())}
    plan = {**tm.gpt2_layer_plan(), side: styles[side]}
    return check_parity(rank, world, corpus.gpt2, plan, [TOKENS], dtype=torch.float64,
                        strict=True, input_grads=False)


@pytest.mark.parametrize("side", ["lm_head", "wte"])
def test_either_side_of_the_tie_may_be_planned(ranks2, side):
    assert ranks2.run(gpt2_parity, side)[0] == MEGATRON_TP


def test_the_side_left_out_gets_the_matching_style(fake_group):
    fake_group(2)
    gm = fxtp.parallelize(corpus.NanoGPT(), corpus.nanogpt_plan(),
                          example_inputs=(TOKENS, TARGETS), device="meta")
    assert type(gm.fxtp.plan["transformer.wte"]) is RowwiseParallel
    assert gm.fxtp.param_placements["lm_head.weight"] == Shard(0)


def test_tied_weight_planned_two_ways_names_both_fqns(fake_group):
    fake_group(2)
    plan = {"wte": ColwiseParallel(), "lm_head": ColwiseParallel()}  # Shard(1) vs Shard(0)
    with pytest.raises(fxtp.PlanError, match=r"tied parameter .*'wte.weight' as S.*1.*"
                                             r"'lm_head.weight' as S.*0.*leave the other out"):
        fxtp.parallelize(corpus.gpt2(), plan, example_inputs=(TOKENS,))


class FunctionalHead(nn.Module):
    """A head that is no module, as torchtune's ``TiedLinear``: ``F.linear`` on the
    embedding's weight."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, 32)
        self.proj = nn.Linear(32, 32)

    def forward(self, tokens):
        return F.linear(self.proj(self.tok(tokens)), self.tok.weight)


def test_logits_sharded_by_no_layout_of_the_plan_warn_with_the_fix(fake_group):
    """With only the embedding planned (torchtune's plan on a tied Llama-3.2: its
    ``output`` key names no module), the head reads the vocab-sharded weight and its
    logits would come back as this rank's part, which the plan never asked for: a
    warning names the parameter and the root layout that returns them whole. Shards a
    style asks for (a colwise module's output) are not reported."""
    fake_group(2)
    plan = {"tok": RowwiseParallel(input_layouts=Replicate())}
    with pytest.warns(UserWarning, match=r"output 0 \(global shape \(2, 16, 128\)\) comes "
                      r"back as this rank's S\(2\) part.*parameter 'tok\.weight'.*"
                      r"PrepareModuleOutput\(output_layouts=Shard\(2\), "
                      r"desired_output_layouts=Replicate\(\)\)"):
        gm = fxtp.parallelize(FunctionalHead(), plan, example_inputs=(TOKENS,))
    assert gm.fxtp.output_placements == (Shard(2),) and len(gm.fxtp.unplanned_outputs) == 1
    whole = {**plan, "": fxtp.PrepareModuleOutput(output_layouts=Shard(2),
                                                  desired_output_layouts=Replicate())}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gm = fxtp.parallelize(FunctionalHead(), whole, example_inputs=(TOKENS,))
        assert gm(TOKENS).shape == (2, 16, VOCAB) and gm.fxtp.unplanned_outputs == []
        colwise = fxtp.parallelize(nn.Linear(4, 6), ColwiseParallel(),
                                   example_inputs=(torch.randn(3, 4),))
        assert colwise.fxtp.output_placements == (Shard(1),)
