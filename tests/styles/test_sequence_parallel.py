"""Sequence parallel: norms run on sequence shards, layer inputs are all-gathered on entry
and rowwise outputs reduce-scattered back, against the single-device model, with the
collectives of Megatron's sequence parallelism and one bucketed all-reduce for the
replicated parameters used on shards."""
import pytest
import torch
import torch.nn as nn

import fxtp
from fxtp import Replicate, Shard
from tests.helpers import models, transformer_models as tm
from tests.helpers.models import TARGETS, WithLoss, prefixed
from tests.helpers.parity import check_parity, example

TOKENS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
DTYPES = pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
L = 2


def llama(rank, world, dtype):
    return check_parity(rank, world, lambda: tm.Llama(tm.LlamaConfig(n_heads=8, n_kv_heads=4)),
                        tm.llama_sp_plan(), [TOKENS], dtype=dtype, input_grads=False,
                        with_bytes=True)


def gpt2(rank, world, dtype):
    return check_parity(rank, world, tm.GPT2, tm.gpt2_sp_plan(), [TOKENS], dtype=dtype,
                        input_grads=False)


@DTYPES
def test_llama_sequence_parallel(ranks, dtype):
    fwd, bwd, fwd_bytes, bwd_bytes = ranks.run(llama, dtype)[0]
    # per layer: gather before attention and feed-forward, reduce-scatter after wo and w2;
    # the embedding's sum is reduce-scattered, the final norm's output gathered for the head,
    # and the logits gathered.
    assert fwd == {"all_gather": 2 * L + 2, "reduce_scatter": 2 * L + 1}
    # the conjugates; the logits gather's backward is a local chunk; one all-reduce per
    # block for its 2 norm weights' gradients and one for the final norm's (each block
    # reads only its own parameters: per-block FSDP)
    assert bwd == {"all_gather": 2 * L + 1, "reduce_scatter": 2 * L + 1, "all_reduce": L + 1}
    cfg, (b, t), world = tm.LlamaConfig(), TOKENS.shape, ranks.world
    item = 8 if dtype == torch.float64 else 4
    activation = b * t * cfg.dim * item  # one full (B, T, D) activation
    assert fwd_bytes == {"all_gather": (2 * L + 1) * activation // world
                         + b * t * cfg.vocab_size // world * item,
                         "reduce_scatter": (2 * L + 1) * activation}
    assert bwd_bytes == {"all_gather": (2 * L + 1) * activation // world,
                         "reduce_scatter": (2 * L + 1) * activation,
                         "all_reduce": (2 * L + 1) * cfg.dim * item}


@DTYPES
def test_gpt2_sequence_parallel_with_tied_embeddings_and_rowwise_biases(ranks, dtype):
    fwd, bwd = ranks.run(gpt2, dtype)[0]
    assert fwd == {"all_gather": 2 * L + 2, "reduce_scatter": 2 * L + 1}
    # + the all-gather of the position embedding's gradient (its output was chunked to add
    # to the sequence shards, as Megatron does); one all-reduce per block for its 2
    # LayerNorms and rowwise biases, one for ln_f
    assert bwd == {"all_gather": 2 * L + 2, "reduce_scatter": 2 * L + 1, "all_reduce": L + 1}


HF_LLAMA_SP_PLAN = {
    "model.embed_tokens": fxtp.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "model.norm": fxtp.SequenceParallel(),
    "model.layers.*.input_layernorm": fxtp.SequenceParallel(),
    "model.layers.*.post_attention_layernorm": fxtp.SequenceParallel(),
    "model.layers.*.self_attn": fxtp.PrepareModuleInput(
        input_kwarg_layouts={"hidden_states": Shard(1)},
        desired_input_kwarg_layouts={"hidden_states": Replicate()}),
    "model.layers.*.mlp": fxtp.PrepareModuleInput(input_layouts=(Shard(1),),
                                                  desired_input_layouts=(Replicate(),)),
    "model.layers.*.self_attn.[qkv]_proj": fxtp.ColwiseParallel(),
    "model.layers.*.self_attn.o_proj": fxtp.RowwiseParallel(output_layouts=Shard(1)),
    "model.layers.*.mlp.[gu][ap]*_proj": fxtp.ColwiseParallel(),
    "model.layers.*.mlp.down_proj": fxtp.RowwiseParallel(output_layouts=Shard(1)),
    "lm_head": fxtp.ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
}

HF_GPT2_SP_PLAN = {
    "transformer.wte": fxtp.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "transformer.drop": fxtp.SequenceParallel(),
    "transformer.ln_f": fxtp.SequenceParallel(),
    "transformer.h.*.ln_[12]": fxtp.SequenceParallel(),
    "transformer.h.*.attn": fxtp.PrepareModuleInput(input_layouts=(Shard(1),),
                                                    desired_input_layouts=(Replicate(),)),
    "transformer.h.*.mlp": fxtp.PrepareModuleInput(input_layouts=(Shard(1),),
                                                   desired_input_layouts=(Replicate(),)),
    "transformer.h.*.attn.c_attn": fxtp.ColwiseParallel(),
    "transformer.h.*.attn.c_proj": fxtp.RowwiseParallel(output_layouts=Shard(1)),
    "transformer.h.*.mlp.c_fc": fxtp.ColwiseParallel(),
    "transformer.h.*.mlp.c_proj": fxtp.RowwiseParallel(output_layouts=Shard(1)),
    "lm_head": fxtp.ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
}


def hf(rank, world, dtype, name):
    from tests.model_code import test_huggingface
    plan = {"llama": HF_LLAMA_SP_PLAN, "gpt2": HF_GPT2_SP_PLAN}[name]
    return test_huggingface.hf(rank, world, dtype, name, plan)


@DTYPES
def test_hugging_face_llama_sequence_parallel(ranks, dtype):
    pytest.importorskip("transformers")
    fwd, bwd = ranks.run(hf, dtype, "llama")[0]
    assert fwd == {"all_gather": 2 * L + 2, "reduce_scatter": 2 * L + 1}
    assert bwd == {"all_gather": 2 * L + 1, "reduce_scatter": 2 * L + 1, "all_reduce": L + 1}


@DTYPES
def test_hugging_face_gpt2_sequence_parallel(ranks, dtype):
    pytest.importorskip("transformers")
    fwd, bwd = ranks.run(hf, dtype, "gpt2")[0]
    # the fused c_attn is strided-sharded, so its q, k, v split needs no gather
    assert fwd == {"all_gather": 2 * L + 2, "reduce_scatter": 2 * L + 1}
    assert bwd == {"all_gather": 2 * L + 2, "reduce_scatter": 2 * L + 1, "all_reduce": L + 1}


class DropoutBlock(nn.Module):
    """Dropout on sequence shards (SequenceParallel), on feature shards (between the
    colwise and rowwise linears) and on the replicated output."""

    def __init__(self, dim=16):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.drop_seq = nn.Dropout(0.3)
        self.up = nn.Linear(dim, 4 * dim)
        self.drop_hidden = nn.Dropout(0.5)
        self.down = nn.Linear(4 * dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.drop_out = nn.Dropout(0.2)

    def forward(self, x):
        h = self.drop_seq(self.norm(x))
        h = x + self.down(self.drop_hidden(torch.relu(self.up(h))))
        return self.drop_out(self.proj(h))


DROPOUT_PLAN = {
    "": fxtp.PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1)),
    "norm": fxtp.SequenceParallel(),
    "drop_seq": fxtp.SequenceParallel(),
    "up": fxtp.ColwiseParallel(input_layouts=Shard(1)),
    "down": fxtp.RowwiseParallel(output_layouts=Shard(1)),
    "proj": fxtp.PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
}


def dropout(rank, world, dtype):
    from tests.helpers.parity import example
    import torch.distributed as dist
    counts = check_parity(rank, world, DropoutBlock, DROPOUT_PLAN, [example(2, 8, 16)],
                          dtype=dtype)
    # reproducible, and replicated results identical on every rank
    torch.manual_seed(0)
    gm = fxtp.parallelize(DropoutBlock().to(dtype), DROPOUT_PLAN,
                          example_inputs=(example(2, 8, 16).to(dtype),))
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(gm(example(2, 8, 16).to(dtype)))
    assert torch.equal(runs[0], runs[1])
    everyone = [torch.empty_like(runs[0]) for _ in range(world)]
    dist.all_gather(everyone, runs[0])
    assert all(torch.equal(everyone[0], other) for other in everyone)
    return counts


@DTYPES
def test_dropout_masks_match_single_device_for_replicated_and_sharded_values(ranks, dtype):
    """With the same torch.manual_seed, each shard's dropout mask is its part of the mask
    single-device dropout draws (so shards differ), and replicated values draw the same
    mask on every rank: the parity check compares every step to the single-device model."""
    fwd, bwd = ranks.run(dropout, dtype)[0]
    assert fwd == {"all_gather": 2, "reduce_scatter": 1}
    assert bwd == {"all_gather": 2, "reduce_scatter": 1, "all_reduce": 1}


def test_sequence_parallel_on_a_linear_is_an_error():
    from fxtp.plans.resolution import resolve_plan
    with pytest.raises(fxtp.PlanError, match=r"SequenceParallel cannot shard module 'up' of "
                                             r"type Linear.*'weight'.*ColwiseParallel"):
        resolve_plan(DropoutBlock(), {"up": fxtp.SequenceParallel()})


def test_torch_sequence_parallel_is_accepted_verbatim():
    from torch.distributed.tensor.parallel import SequenceParallel
    from fxtp.plans.resolution import resolve_plan
    sharding = resolve_plan(DropoutBlock(), {"norm": SequenceParallel(sequence_dim=0)})["norm"]
    assert isinstance(sharding.style, fxtp.SequenceParallel)
    assert sharding.desired_inputs == (Shard(0),) and sharding.params == {}


# --- sequence parallel + loss parallel ----------------------------------------------------


def sp_loss_inside(rank, world, dtype, name):
    make, plan = {"llama": (lambda: tm.Llama(tm.LlamaConfig(n_heads=8, n_kv_heads=4)),
                            tm.llama_sp_plan(loss_parallel=True)),
                  "gpt2": (tm.GPT2, tm.gpt2_sp_plan(loss_parallel=True))}[name]
    return check_parity(rank, world, lambda: WithLoss(make()), prefixed(plan),
                        [TOKENS, TARGETS], dtype=dtype, input_grads=False)


@DTYPES
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_sequence_parallel_with_loss_parallel_inside_the_model(ranks, dtype, name):
    """The logits stay class-sharded into the loss: no logits gather, the loss's 3
    all-reduces instead; backward as with SP alone, minus nothing (the loss's is local)."""
    fwd, bwd = ranks.run(sp_loss_inside, dtype, name)[0]
    assert fwd == {"all_gather": 2 * L + 1, "reduce_scatter": 2 * L + 1, "all_reduce": 3}
    wpe = 1 if name == "gpt2" else 0  # the position embedding's chunked output
    assert bwd == {"all_gather": 2 * L + 1 + wpe, "reduce_scatter": 2 * L + 1, "all_reduce": L + 1}


def sp_loss_outside(rank, world):
    from tests.styles.test_loss_parallel import loss_outside
    return loss_outside(rank, world, True, tm.llama_sp_plan(loss_parallel=True))


def test_sequence_parallel_with_the_loss_outside_the_model(ranks):
    fwd, bwd = ranks.run(sp_loss_outside)[0]
    assert fwd == {"all_reduce": 3}  # fxtp.cross_entropy's own
    assert bwd == {"all_gather": 2 * L + 1, "reduce_scatter": 2 * L + 1, "all_reduce": L + 1}


def hf_loss(rank, world, name):
    from tests.model_code import test_huggingface as hf_models
    make, plan = {"llama": (hf_models.llama, HF_LLAMA_SP_PLAN),
                  "gpt2": (hf_models.gpt2, HF_GPT2_SP_PLAN)}[name]
    plan = {**plan, "lm_head": fxtp.ColwiseParallel(input_layouts=Shard(1))}
    return check_parity(rank, world, make, plan, [TOKENS], dtype=torch.float32,
                        input_grads=False, kwargs={"labels": TARGETS, "use_cache": False},
                        output=lambda out: out.loss)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_hugging_face_sequence_parallel_with_loss_parallel(ranks, name):
    """fp32 only: Hugging Face computes its loss in fp32."""
    pytest.importorskip("transformers")
    fwd, bwd = ranks.run(hf_loss, name)[0]
    assert fwd == {"all_gather": 2 * L + 1, "reduce_scatter": 2 * L + 1, "all_reduce": 3}
    wpe = 1 if name == "gpt2" else 0
    assert bwd == {"all_gather": 2 * L + 1 + wpe, "reduce_scatter": 2 * L + 1, "all_reduce": L + 1}


class PooledEncoder(nn.Module):
    """A sequence-parallel block, then a pooler reading tokens of its sequence-sharded
    output: BERT's first token, a reward model's last, or some by ``index_select``."""

    def __init__(self, pick, dim=16):
        super().__init__()
        self.norm, self.out_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.pooler, self.pick = nn.Linear(dim, dim), pick

    def forward(self, x):
        h = self.out_norm(x + self.down(torch.relu(self.up(self.norm(x)))))
        if self.pick == "first":
            h = h[:, 0]
        elif self.pick == "last":
            h = h[:, -1]
        else:
            h = h.index_select(1, torch.tensor([0, 5, 13, 6]))
        return torch.tanh(self.pooler(h))


POOLED_PLAN = {"norm": fxtp.SequenceParallel(), "out_norm": fxtp.SequenceParallel(),
               "up": fxtp.ColwiseParallel(input_layouts=Shard(1)),
               "down": fxtp.RowwiseParallel(output_layouts=Shard(1))}


def pooled(rank, world, dtype, pick):
    x = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(0))
    return check_parity(rank, world, lambda: PooledEncoder(pick), POOLED_PLAN, [x],
                        dtype=dtype, strict=True)


@DTYPES
@pytest.mark.parametrize("pick", ["first", "last", "index_select"])
def test_a_pooler_reads_tokens_of_a_sequence_sharded_output(ranks, dtype, pick):
    """Each rank picks the tokens it holds (zeros for the others): the picked rows'
    partial sums are all-reduced, not the sequence gathered; a rank holding none of them
    still runs the block's backward. Forward the block's all-gather and reduce-scatter and
    that all-reduce; backward their conjugates, the input's gradient gathered from the
    sequence shards it was cut into, and one bucketed all-reduce of the norms' and the
    rowwise bias's gradients."""
    assert ranks.run(pooled, dtype, pick)[0] == \
        ({"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1},
         {"all_gather": 2, "reduce_scatter": 1, "all_reduce": 1})


class Residual(nn.Module):
    """``x + attention(x)``: the block's input read sequence-sharded by the residual and
    gathered for the attention."""

    def __init__(self):
        super().__init__()
        self.attention = models.Attention()

    def forward(self, x):
        return x + self.attention(x)


RESIDUAL_PLAN = {
    "": fxtp.PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Shard(1)),
    "attention": fxtp.PrepareModuleInput(input_layouts=Shard(1),
                                         desired_input_layouts=Replicate()),
    "attention.w[qkv]": fxtp.ColwiseParallel(),
    "attention.wo": fxtp.RowwiseParallel(output_layouts=Shard(1)),
}


def _no_fallbacks(gm):
    assert not gm.fxtp.fallbacks, gm.fxtp.fallbacks


def residual(rank, world, order):
    plan = dict(RESIDUAL_PLAN.items() if order == "outer first" else
                reversed(RESIDUAL_PLAN.items()))
    return check_parity(rank, world, Residual, plan, [example(2, 8, 16)],
                        dtype=torch.float64, input_placements=[Shard(1)], post=_no_fallbacks)


@pytest.mark.parametrize("order", ["outer first", "inner first"])
def test_a_value_passed_down_is_laid_out_outer_module_first_whatever_the_plans_order(
        ranks2, order):
    """The root's layout of its input wraps the attention's, which wraps each projection's:
    one gather into the attention, the root's sequence shard kept for the residual."""
    fwd, bwd = ranks2.run(residual, order)[0]
    assert fwd == {"all_gather": 1, "reduce_scatter": 1}
    assert bwd == {"all_gather": 1, "reduce_scatter": 1}
