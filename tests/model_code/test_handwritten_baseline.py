"""The hand-written Megatron layers the benchmarks measure fxtp against
(:mod:`benchmarks.handwritten`) compute what the single-device model computes: a baseline
that skipped work would flatter itself. fp64, the loss and every gradient (each rank's
slice of the full gradient)."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

ROWS = ("wq", "wk", "wv", "w1", "w3", "output", "tok_embeddings")  # cut by output row
COLUMNS = ("wo", "w2")  # cut by input column


def slice_of(name, full, rank, world):
    owner = name.split(".")[-2]
    dim = 0 if owner in ROWS else 1 if owner in COLUMNS else None
    return full if dim is None else full.chunk(world, dim)[rank]


def baseline_matches_single_device(rank, world, recipe):
    from benchmarks import handwritten
    from fxtp.examples.llama import Llama, LlamaConfig
    torch.manual_seed(0)
    cfg = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=128,
                      multiple_of=32, max_seq_len=16)
    single = Llama(cfg).double()
    tokens, targets = torch.randint(0, 128, (2, 2, 16)).unbind(0)
    mine = getattr(handwritten, recipe)(copy.deepcopy(single), rank, world,
                                        dist.group.WORLD.group_name)
    expected = F.cross_entropy(single(tokens).flatten(0, 1), targets.flatten())
    loss = F.cross_entropy(mine(tokens).flatten(0, 1), targets.flatten())
    expected.backward()
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    full, checked = dict(single.named_parameters()), []
    for name, p in mine.named_parameters():
        torch.testing.assert_close(p.grad, slice_of(name, full[name].grad, rank, world),
                                   rtol=1e-10, atol=1e-12, msg=name)
        checked.append(name)
    return sorted(checked) == sorted(full)


@pytest.mark.parametrize("recipe", ["handwritten_tp", "handwritten_sp"])
def test_handwritten_recipe_matches_single_device(ranks, recipe):
    assert ranks.run(baseline_matches_single_device, recipe) == [True] * ranks.world
