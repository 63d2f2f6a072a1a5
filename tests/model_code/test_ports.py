"""Models written as litgpt, mistral-inference, OLMo-1 and minGPT write them
(:mod:`tests.helpers.ports`), under the plans their authors would write: parity with the single-
device model in fp64 (forward, every gradient, 3 AdamW steps), strict (no fallback), and
Megatron's collectives: one all-reduce per attention and per MLP, each way."""
import pytest
import torch

from tests.helpers.parity import check_parity
from tests.helpers.ports import L, PORTS, VOCAB

MEGATRON = ({"all_reduce": 2 * L}, {"all_reduce": 2 * L})


def port(rank, world, name):
    make, plan = PORTS[name]
    shape = (12,) if name == "mistral_inference" else (2, 12)  # packed tokens: no batch
    ids = torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(0))
    return check_parity(rank, world, make, plan, [ids], dtype=torch.float64, strict=True,
                        input_grads=False)


@pytest.mark.parametrize("name", list(PORTS))
def test_ported_models_at_two_ranks(ranks2, name):
    """litgpt's interleaved query groups shard by group (the view's leading dim); OLMo-1's
    and minGPT's fused projections are laid out in blocks (each rank holds its rows of q,
    k and v); mistral-inference's ``repeat_interleave`` repeats each rank's KV head into
    its query heads."""
    assert ranks2.run(port, name)[0] == MEGATRON


def test_mingpt_at_four_ranks(ranks4):
    assert ranks4.run(port, "mingpt")[0] == MEGATRON


def test_mistral_inference_with_fewer_kv_heads_than_ranks(ranks4):
    """2 KV heads on 4 ranks: each pair of ranks computes its KV head from whole ``wk`` and
    ``wv``, whose gradients are then partial (each rank's query heads' share): one more
    backward all-reduce per layer."""
    assert ranks4.run(port, "mistral_inference")[0] == ({"all_reduce": 2 * L},
                                                        {"all_reduce": 3 * L})


def test_olmo_with_fewer_kv_heads_than_ranks_computes_its_fused_projection_by_parts(ranks4):
    """OLMo-1's fused ``att_proj`` with 2 KV heads on 4 ranks: q, k and v are computed
    from row slices of the whole weight (q's sharded, k's and v's each held by the pair of
    ranks whose query heads read it), with no gather; backward gathers the q slice's
    gradient and sums the k and v slices' (one all-reduce and one all-gather more per
    layer)."""
    assert ranks4.run(port, "olmo")[0] == ({"all_reduce": 2 * L},
                                           {"all_reduce": 3 * L, "all_gather": L})
