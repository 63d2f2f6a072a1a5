"""Every op fxtp splits, moves, decomposes or replaces keeps the dtype the single-device
program gives it, with autocast on and off, in fp32, bf16 and fp64 models: the output, every
gradient (:func:`tests.helpers.parity.check_parity` compares dtypes with values) and the parameters
after AdamW steps, to bf16's tolerance wherever autocast or the model computes in bf16.

The constructs: a row-parallel linear's bias added after its partial sums are reduced;
a planned module called inside an autocast region (outlined as a submodule, whose call stays
in the region); loss parallel's cross-entropy; softmax, log-softmax and norms over a sharded
dim (kernels summing partial sums, and the decompositions into reductions); a composite op
decomposed; an activation-checkpointed region. Then the region's modes after an op in it
raises, and the order of random draws against planned modules.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import fxtp
from tests.helpers.parity import check_parity, example

DIM, HIDDEN, CLASSES = 8, 16, 12
COLWISE, ROWWISE = fxtp.ColwiseParallel(), fxtp.RowwiseParallel()
SHARDED_OUT = fxtp.ColwiseParallel(output_layouts=fxtp.Shard(-1), use_local_output=True)


class Construct(nn.Module):
    """``x -> proj -> <construct> -> out`` (the construct given as ``body``), inside a bf16
    autocast region where ``autocast`` is set."""

    def __init__(self, body, autocast: bool):
        super().__init__()
        self.proj, self.out = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)
        self.body, self.autocast = body, autocast

    def region(self):
        device = self.proj.weight.device.type
        return torch.autocast(device, dtype=torch.bfloat16) if self.autocast else \
            contextlib.nullcontext()

    def forward(self, x):
        with self.region():
            return self.body(self, x)


def rowwise_bias(m, x):
    return m.out(torch.relu(m.proj(x)))


def softmax_of_shards(m, x):
    h = m.proj(x)
    wide = torch.promote_types(h.dtype, torch.float32)  # softmax's dtype argument
    return m.out(torch.softmax(h, -1, dtype=wide).to(h.dtype) + F.log_softmax(h, -1))


def layer_norm_of_shards(m, x):
    return m.out(F.layer_norm(m.proj(x), (HIDDEN,)))


def rms_norm_of_shards(m, x):  # decomposed into reductions
    return m.out(F.rms_norm(m.proj(x), (HIDDEN,)))


def variance_of_shards(m, x):  # written by hand: decomposed into reductions
    h = m.proj(x)
    return m.out((h - h.mean(-1, keepdim=True)) / (h.var(-1, keepdim=True) + 1e-5).sqrt())


def composite(m, x):  # einsum: a composite op, decomposed into what torch runs for it
    return m.out(torch.einsum("bsh,bsh->bsh", m.proj(x), m.proj(x)))


def checkpointed(m, x):
    return checkpoint(rowwise_bias, m, x, use_reentrant=False)


CONSTRUCTS = {
    "rowwise bias": (rowwise_bias, {"proj": COLWISE, "out": ROWWISE}),
    "softmax of shards": (softmax_of_shards, {"proj": SHARDED_OUT, "out": ROWWISE}),
    "layer norm of shards": (layer_norm_of_shards, {"proj": SHARDED_OUT, "out": ROWWISE}),
    "rms norm of shards": (rms_norm_of_shards, {"proj": SHARDED_OUT, "out": ROWWISE}),
    "variance of shards": (variance_of_shards, {"proj": SHARDED_OUT, "out": ROWWISE}),
    "composite op": (composite, {"proj": COLWISE, "out": ROWWISE}),
    "checkpoint region": (checkpointed, {"proj": COLWISE, "out": ROWWISE}),
    "outlined colwise": (lambda m, x: m.proj(x),
                         {"proj": fxtp.ColwiseParallel(output_layouts=fxtp.Replicate())}),
    "outlined rowwise": (lambda m, x: m.out(m.proj(x)),
                         {"out": fxtp.RowwiseParallel(input_layouts=fxtp.Replicate())}),
}
DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def sweep(rank, world, name):
    """Each dtype, autocast off and on: parity with fxtp's gathers counted as failures."""
    body, plan = CONSTRUCTS[name]
    for dtype in DTYPES:
        for autocast in (False, True):
            low = autocast and dtype != torch.float64 or dtype == torch.bfloat16
            check_parity(rank, world, lambda: Construct(body, autocast), plan,
                         [example(2, 4, DIM)], dtype=dtype, strict=True, steps=2,
                         compare_dtype=torch.bfloat16 if low else dtype)


@pytest.mark.parametrize("name", CONSTRUCTS)
def test_dtypes_and_values_match_single_device(ranks, name):
    ranks.run(sweep, name)


class Classifier(nn.Module):
    """A column-parallel head whose class-sharded logits meet ``cross_entropy`` in a bf16
    autocast region: single-device autocast computes the loss in fp32."""

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(DIM, DIM), nn.Linear(DIM, CLASSES)

    def forward(self, x, target):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = self.head(self.body(x))
            return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def loss_parallel_sweep(rank, world):
    target = torch.randint(0, CLASSES, (2, 4), generator=torch.Generator().manual_seed(0))
    for dtype in DTYPES:
        check_parity(rank, world, Classifier,
                     {"head": fxtp.ColwiseParallel(output_layouts=fxtp.Shard(-1),
                                                   use_local_output=False)},
                     [example(2, 4, DIM), target], dtype=dtype, strict=True, steps=2,
                     input_grads=False,
                     compare_dtype=torch.float64 if dtype == torch.float64 else torch.bfloat16)


def test_loss_parallel_in_an_autocast_region_returns_autocasts_fp32_loss(ranks):
    ranks.run(loss_parallel_sweep)


class BadTokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.fc = nn.Embedding(CLASSES, DIM), nn.Linear(DIM, DIM)

    def forward(self, tokens):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.fc(self.embed(tokens))
        with torch.no_grad():
            seen = self.embed(tokens)
        return h.float() + seen


def modes_after_a_raise(rank, world):
    tokens = torch.randint(0, CLASSES, (2, 4))
    gm = fxtp.parallelize(BadTokens(), {"fc": fxtp.ColwiseParallel(
        output_layouts=fxtp.Replicate())}, example_inputs=(tokens,))
    left = []
    for bad in (torch.full_like(tokens, CLASSES), torch.full_like(tokens, -CLASSES - 1)):
        with pytest.raises(IndexError):
            gm(bad)
        left.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
                     torch.is_grad_enabled()))
    out = gm(tokens)
    return left, out.dtype, out.requires_grad


def test_a_raise_inside_a_region_leaves_its_modes_as_with_does(ranks2):
    """An op raising inside the autocast region (an embedding lookup of a bad id), then
    inside the no-grad one: each time the process is back in fp32 with gradients on, and
    the next good batch computes as the first would."""
    left, dtype, requires_grad = ranks2.run(modes_after_a_raise)[0]
    assert left == [(False, torch.get_autocast_dtype("cpu"), True)] * 2
    assert (dtype, requires_grad) == (torch.float32, True)


class DropoutsInOrder(nn.Module):
    """A dropout in the root, then a planned module reading the root's input with a
    dropout of its own: the draws must come in this order."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Sequential(nn.Dropout(0.5), nn.Linear(DIM, DIM))

    def forward(self, x):
        return F.dropout(x, 0.5) + self.fc(x)


def dropout_order(rank, world, plan):
    check_parity(rank, world, DropoutsInOrder, plan, [example(2, 4, DIM)],
                 dtype=torch.float64, strict=True)


@pytest.mark.parametrize("plan", [
    {"fc": fxtp.PrepareModuleInput(input_layouts=fxtp.Replicate(),
                                   desired_input_layouts=fxtp.Replicate())},
    {"fc.1": fxtp.ColwiseParallel(output_layouts=fxtp.Replicate())}], ids=["replicated", "colwise"])
def test_planned_modules_draw_random_numbers_in_program_order(ranks, plan):
    ranks.run(dropout_order, plan)


class GroupedQueryAttention(nn.Module):
    """Two query heads and one KV head (fewer than ranks: each rank slices the KV head's
    rows of the whole weights), repeated, with a softmax in fp32 cast back."""

    def __init__(self):
        super().__init__()
        self.q, self.o = nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.k, self.v = nn.Linear(DIM, DIM // 2, bias=False), nn.Linear(DIM, DIM // 2, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 2, DIM // 2).transpose(1, 2)
        k, v = (p(x).view(b, s, 1, DIM // 2).transpose(1, 2).repeat(1, 2, 1, 1)
                for p in (self.k, self.v))
        probs = F.softmax((q @ k.transpose(-2, -1)).float(), dim=-1).to(q.dtype)
        return self.o((probs @ v).transpose(1, 2).reshape(b, s, DIM))


class AttentionInAutocast(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = GroupedQueryAttention()

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = x + self.attn(x)
        return h.float()


def attention_in_autocast(rank, world):
    check_parity(rank, world, AttentionInAutocast, {"attn.[qkv]": fxtp.ColwiseParallel()},
                 [example(1, 4, DIM)], dtype=torch.float32, steps=1,
                 compare_dtype=torch.bfloat16)


def test_a_module_whose_hoisted_reads_precede_the_region_runs_in_it(ranks):
    """The KV head's rows are sliced from its weights at the top of the module's graph:
    its call still runs inside the region (it ran outside, and its matmuls met fp32 and
    bf16 operands)."""
    ranks.run(attention_in_autocast)
