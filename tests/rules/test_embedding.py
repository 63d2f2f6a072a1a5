"""Embeddings: ColwiseParallel shards the embedding dim, RowwiseParallel the vocabulary
(masked local lookup, then all-reduce or reduce-scatter per ``output_layouts``)."""
import pytest
import torch
import torch.nn as nn

import fxtp
from fxtp import Replicate, Shard
from tests.helpers.parity import check_parity

VOCAB, DIM = 16, 8


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM, padding_idx=3)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, idx):
        return self.proj(self.tok(idx))


TOKENS = torch.tensor([[0, 3, 5, 15, 8, 7, 3, 11], [9, 1, 3, 12, 4, 2, 14, 6]])
PLANS = {
    "colwise": ({"tok": fxtp.ColwiseParallel(output_layouts=Replicate())},
                {"all_gather": 1}, {}),
    "rowwise": ({"tok": fxtp.RowwiseParallel()}, {"all_reduce": 1}, {}),
    "rowwise_to_sequence_shards": (
        {"tok": fxtp.RowwiseParallel(output_layouts=Shard(1)),
         "proj": fxtp.PrepareModuleInput(input_layouts=Shard(1),
                                         desired_input_layouts=Replicate())},
        {"reduce_scatter": 1, "all_gather": 1},
        {"all_gather": 1}),  # the reduce-scatter's conjugate; the gather's is a local chunk
}


def embed(rank, world, plan, dtype):
    return check_parity(rank, world, Embed, plan, [TOKENS], dtype=dtype, input_grads=False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("name", list(PLANS))
def test_embedding_styles_match_single_device(ranks, name, dtype):
    plan, fwd_expected, bwd_expected = PLANS[name]
    fwd, bwd = ranks.run(embed, plan, dtype)[0]
    assert fwd == fwd_expected
    assert bwd == bwd_expected


def saved_bytes(fn, *args) -> int:
    """Bytes of the tensors autograd keeps for the backward of ``fn(*args)`` (a tensor kept
    by several nodes counts once)."""
    kept = {}

    def pack(tensor):
        kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn(*args)
    return sum(kept.values())


@pytest.mark.parametrize("padding_idx", [-1, 3, 12])
def test_vocab_sharded_lookup_matches_the_full_table_and_keeps_only_the_indices(padding_idx):
    """Each simulated rank's lookup on its rows, summed over ranks, is the full embedding;
    each rank's weight gradient is the matching rows of the full one (padding row: none);
    and backward keeps nothing but the indices the caller holds anyway."""
    from fxtp.kernels.local_ops import vocab_parallel_embedding
    torch.manual_seed(0)
    full = torch.randn(VOCAB, DIM, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(*TOKENS.shape, DIM, dtype=torch.float64)
    pad = None if padding_idx < 0 else padding_idx
    expected = torch.nn.functional.embedding(TOKENS, full, padding_idx=pad)
    expected.backward(grad_out)
    world = 4
    rows = VOCAB // world
    outputs = []
    for rank in range(world):
        shard = full.detach()[rank * rows:(rank + 1) * rows].clone().requires_grad_()
        out = vocab_parallel_embedding(shard, TOKENS, rank * rows, padding_idx)
        out.backward(grad_out)
        outputs.append(out.detach())
        torch.testing.assert_close(shard.grad, full.grad[rank * rows:(rank + 1) * rows],
                                   rtol=0, atol=0)
        assert saved_bytes(vocab_parallel_embedding, shard, TOKENS, rank * rows,
                           padding_idx) == TOKENS.untyped_storage().nbytes()
    torch.testing.assert_close(sum(outputs), expected.detach(), rtol=0, atol=0)


def test_vocab_sharded_lookup_under_dynamo_matches_eager():
    """Traced by dynamo, each simulated rank's lookup gives eager's output and weight
    gradient (torch 2.11's dynamo got the gradient wrong when the lookup filled its output
    in place; the CUDA bf16 compile test caught it)."""
    from fxtp.kernels.local_ops import vocab_parallel_embedding
    torch.manual_seed(0)
    full = torch.randn(VOCAB, DIM, dtype=torch.float64)
    grad_out = torch.randn(*TOKENS.shape, DIM, dtype=torch.float64)
    compiled = torch.compile(vocab_parallel_embedding, backend="eager", fullgraph=True)
    rows = VOCAB // 4
    for rank in range(4):
        results = []
        for lookup in (vocab_parallel_embedding, compiled):
            shard = full[rank * rows:(rank + 1) * rows].clone().requires_grad_()
            out = lookup(shard, TOKENS, rank * rows, 3)
            out.backward(grad_out)
            results.append((out.detach(), shard.grad))
        (out, grad), (got_out, got_grad) = results
        torch.testing.assert_close(got_out, out, rtol=0, atol=0)
        torch.testing.assert_close(got_grad, grad, rtol=0, atol=0)
