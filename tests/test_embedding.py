"""Embeddings: ColwiseParallel shards the embedding dim, RowwiseParallel the vocabulary
(masked local lookup, then all-reduce or reduce-scatter per ``output_layouts``)."""
import pytest
import torch
import torch.nn as nn

import fxtp
from fxtp import Replicate, Shard
from tests.parity import check_parity

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
         "proj": fxtp.PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())},
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
