"""Parameters frozen when ``parallelize`` runs may train later (gradual unfreezing, a
warm-up with frozen norms): the program syncs their partial gradients then, and issues no
collective for them while they stay frozen."""
import torch

import fxtp
from fxtp.examples.llama import Llama, LlamaConfig, llama_sp_plan
from tests.helpers.parity import tolerance

TOKENS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
LAYERS = 2


def norm_weights(model):
    """The sequence-parallel norms' weights: replicated, with a partial gradient on each
    rank (each holds a part of the sequence)."""
    return [p for name, p in model.named_parameters() if "norm" in name]


def backward_counts(gm):
    loss = gm(TOKENS).sum()
    with fxtp.count_collectives() as counts:
        loss.backward()
    return dict(counts.counts)


def frozen_then_trained(rank, world):
    torch.manual_seed(0)
    model = Llama(LlamaConfig(n_layers=LAYERS, n_heads=4, n_kv_heads=4)).double()
    trainable = fxtp.parallelize(model, llama_sp_plan(), example_inputs=(TOKENS,))
    for p in norm_weights(model):
        p.requires_grad_(False)
    gm = fxtp.parallelize(model, llama_sp_plan(), example_inputs=(TOKENS,))
    counts = {"trainable": backward_counts(trainable), "frozen": backward_counts(gm)}
    for m in (model, gm):
        for p in norm_weights(m):
            p.requires_grad_(True)
        m.zero_grad()
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        if step == 0:
            counts["unfrozen"] = backward_counts(gm)
        else:
            gm(TOKENS).sum().backward()
        model(TOKENS).sum().backward()
        for name, p in gm.named_parameters():
            torch.testing.assert_close(p.grad.full_tensor(), model.get_parameter(name).grad,
                                       **tolerance(torch.float64, steps=step),
                                       msg=lambda m: f"step {step} grad of {name}: {m}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    return counts


def test_a_parameter_frozen_when_parallelized_trains_later_as_on_one_device(ranks):
    counts = ranks.run(frozen_then_trained)[0]
    norms = 2 * LAYERS + 1
    sequence_parallel = {k: n for k, n in counts["trainable"].items() if k != "all_reduce"}
    # trainable: the norm weights' partial gradients, in a bucket per block and one for the
    # final norm; frozen: none of them; unfrozen: each norm weight's own sync (the buckets
    # were made for the ones trainable when traced)
    assert counts["trainable"] == {**sequence_parallel, "all_reduce": LAYERS + 1}
    assert counts["frozen"] == sequence_parallel
    assert counts["unfrozen"] == {**sequence_parallel, "all_reduce": norms}
