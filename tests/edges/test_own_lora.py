"""LoRA layers that hold their own weight beside the adapter (torchtune's ``LoRALinear`` and
``DoRALinear``, written here as torchtune writes them), planned colwise or rowwise as the
linear layers they replace: the adapter's up projection follows a colwise layer's output
features, its down projection a rowwise layer's input features, the r-wide side stays
whole, so the adapters add no collective. DTensor's styles refuse such modules (they take
``nn.Linear`` alone). Parity in fp64 with the single-device model, base weights frozen,
strict (no fallback), at world 2 and 4.

Collectives: forward, Megatron's (a rowwise layer's adapter adds its partial sum to the
base's before the one all-reduce); DoRA adds one per rowwise layer, of ``out_features``
values: its weight norm over the sharded input features, summed, never gathered.
Backward, Megatron's activation all-reduces (the adapter's partial input gradient joins
the base's) and one bucket per block: the replicated adapter factors' gradients (each
colwise layer's ``lora_a``, each rowwise layer's ``lora_b``, ``R x D`` each; and DoRA's
rowwise magnitudes), partial sums of r-wide activations reduced as weights, not as
``B x T x R`` activations."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxtp.examples.llama import Llama, LlamaConfig, llama_tp_plan
from tests.helpers.parity import check_parity

L, R, B, T = 2, 4, 2, 16
D = LlamaConfig().dim
TOKENS = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(0))
ACTIVATION = B * T * D * 8  # bytes of one all-reduced hidden state in fp64


class LoRALinear(nn.Module):
    """torchtune's: ``F.linear`` on its own frozen weight plus ``alpha / rank`` times the
    adapter's ``lora_b(lora_a(x))``."""

    def __init__(self, linear: nn.Linear, rank=R, alpha=8.0):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().clone(), requires_grad=False)
        self.bias = None if linear.bias is None else \
            nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.rank, self.alpha = rank, alpha
        self.lora_a = nn.Linear(linear.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, linear.out_features, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.1)  # torchtune's zeros: no gradient to check

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) + \
            (self.alpha / self.rank) * self.lora_b(self.lora_a(x))


class DoRALinear(LoRALinear):
    """torchtune's: the adapted weight's rows scaled to a learned ``magnitude`` by their
    norm over the input features."""

    def __init__(self, linear: nn.Linear, rank=R, alpha=8.0):
        super().__init__(linear, rank, alpha)
        self.magnitude = nn.Parameter(linear.weight.detach().norm(dim=1) * 1.1)

    def forward(self, x):
        lora_out = (self.alpha / self.rank) * self.lora_b(self.lora_a(x))
        base_out = F.linear(x, self.weight)
        adapted = self.weight + (self.alpha / self.rank) * self.lora_b.weight @ self.lora_a.weight
        scale = (self.magnitude / torch.linalg.norm(adapted, dim=1).detach()).view(1, -1)
        out = (scale - 1) * base_out + scale * lora_out
        return out if self.bias is None else out + self.bias


def adapted_llama(kind):
    """fxtp's Llama with ``kind`` layers in place of the colwise ``wq`` / ``wv`` and the
    rowwise ``wo`` / ``w2``."""
    model = Llama(LlamaConfig(n_layers=L, n_heads=8, n_kv_heads=4))
    for block in model.layers:
        for owner, name in ((block.attention, "wq"), (block.attention, "wv"),
                            (block.attention, "wo"), (block.feed_forward, "w2")):
            setattr(owner, name, kind(getattr(owner, name)))
    return model


def parity(rank, world, kind):
    return check_parity(rank, world, lambda: adapted_llama(kind), llama_tp_plan(), [TOKENS],
                        dtype=torch.float64, strict=True, input_grads=False, with_bytes=True)


@pytest.mark.parametrize("kind", [LoRALinear, DoRALinear], ids=["lora", "dora"])
def test_lora_layers_holding_their_weight_train_as_on_one_device(ranks, kind):
    fwd, bwd, fwd_bytes, bwd_bytes = ranks.run(parity, kind)[0]
    norms = 2 * L if kind is DoRALinear else 0  # wo's and w2's, D values each
    assert fwd == {"all_reduce": 2 * L + 1 + norms, "all_gather": 1}
    assert fwd_bytes["all_reduce"] == (2 * L + 1) * ACTIVATION + norms * D * 8
    assert bwd == {"all_reduce": 2 * L + 1 + L}
    assert bwd_bytes["all_reduce"] == (2 * L + 1) * ACTIVATION + L * 4 * R * D * 8 + \
        norms * D * 8
