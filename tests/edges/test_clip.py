"""Gradient clipping: fxtp.clip_grad_norm_ computes the norm of the single-device gradients
(sharded partial norms reduced in one collective, replicated gradients counted once) and
clips like torch.nn.utils.clip_grad_norm_ on the single-device model. Loss scaling: an
overflow in one rank's shard skips the step on every rank."""
import copy
import math

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import fxtp
from fxtp.frontend.names import model_fqn
from tests.helpers import transformer_models as tm
from tests.helpers.parity import TIGHT, local_of, local_part

TOKENS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
SUBJECTS = {  # GPT-2: tied embedding, rowwise biases and LayerNorms replicated
    "llama": (lambda: tm.Llama(tm.LlamaConfig(n_heads=8, n_kv_heads=4)), tm.llama_sp_plan()),
    "gpt2": (tm.GPT2, tm.gpt2_sp_plan()),
}


def clip(rank, world, name, norm_type, ratio, clip_grad_norm_=fxtp.clip_grad_norm_,
         wrap_blocks=False):
    make, plan = SUBJECTS[name]
    torch.manual_seed(0)
    model = make().double()
    ref = copy.deepcopy(model)
    gm = fxtp.parallelize(model, plan, example_inputs=(TOKENS,))
    if wrap_blocks:  # their parameters' names gain the wrappers' segments
        gm.layers.register_module("0", checkpoint_wrapper(gm.layers[0]))
        gm.layers.register_module("1", torch.compile(gm.layers[1], backend="eager"))
    gm(TOKENS).square().mean().backward()
    ref(TOKENS).square().mean().backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()], norm_type)
    max_norm = ratio * norm.item()
    with fxtp.count_collectives() as counted:
        total = clip_grad_norm_(gm, max_norm, norm_type)
    ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
    torch.testing.assert_close(total, ref_total, rtol=1e-12, atol=0)
    for n, p in gm.named_parameters():
        n = model_fqn(n)
        expected = local_part(ref.get_parameter(n).grad, gm.fxtp.param_placements[n], rank, world)
        torch.testing.assert_close(local_of(p.grad), expected, **TIGHT, msg=lambda m: f"{n}: {m}")
    return dict(counted.counts), total.item(), norm.item()


NORMS = [(name, norm) for name in ("llama", "gpt2") for norm in (2.0, 1.0, math.inf)
         if name == "llama" or norm == 2.0]  # every norm on Llama; GPT-2 (tied) in l2


@pytest.mark.parametrize("name,norm_type", NORMS,
                         ids=[f"{n}-l{'inf' if t == math.inf else int(t)}" for n, t in NORMS])
def test_clip_grad_norm_matches_torch_on_the_single_device_model(ranks, name, norm_type):
    for counts, total, norm in ranks.run(clip, name, norm_type, 0.3):
        assert counts == {"all_reduce": 1}
        assert total == pytest.approx(norm, rel=1e-12)


def test_gradients_under_max_norm_are_left_as_they_are(ranks):
    for counts, total, norm in ranks.run(clip, "gpt2", 2.0, 10.0):
        assert counts == {"all_reduce": 1} and total == pytest.approx(norm, rel=1e-12)


def torch_clip(gm, max_norm, norm_type):
    return torch.nn.utils.clip_grad_norm_(gm.parameters(), max_norm, norm_type).full_tensor()


@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "inf"])
def test_torch_clip_grad_norm_on_the_result_is_the_single_device_norm(ranks, norm_type):
    """Parameters are DTensors: torch's own clipping reduces the sharded norms."""
    for _, total, norm in ranks.run(clip, "llama", norm_type, 0.3, torch_clip):
        assert total == pytest.approx(norm, rel=1e-12)


def test_clip_grad_norm_of_blocks_compiled_or_checkpointed_in_place(ranks2):
    """The wrappers' segments in parameter names do not hide which gradients are sharded."""
    for counts, total, norm in ranks2.run(clip, "llama", 2.0, 0.3, fxtp.clip_grad_norm_, True):
        assert counts == {"all_reduce": 1} and total == pytest.approx(norm, rel=1e-12)


def overflow_on_one_rank(rank, world, dtensor_params, scaler):
    """One element of rank 1's shard of a gradient overflows: does each rank step, and what
    scale does it go on with?"""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    make, plan = SUBJECTS["llama"]
    torch.manual_seed(0)
    gm = fxtp.parallelize(make(), plan, example_inputs=(TOKENS,), dtensor_params=dtensor_params)
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-2)
    scaler = (ShardedGradScaler if scaler == "sharded" else torch.amp.GradScaler)(
        "cpu", init_scale=2.0 ** 8)
    scaler.scale(gm(TOKENS).square().mean()).backward()
    weight = gm.get_parameter("layers.0.attention.wq.weight")
    if rank == 1:
        local_of(weight.grad)[0, 0] = math.inf
    before = local_of(weight).detach().clone()
    scaler.step(opt)
    scaler.update()
    return not torch.equal(local_of(weight).detach(), before), scaler.get_scale()


@pytest.mark.parametrize("dtensor_params,scaler", [(True, "torch"), (False, "sharded")],
                         ids=["dtensor-params-GradScaler", "local-params-ShardedGradScaler"])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(ranks2, dtensor_params, scaler):
    """fxtp's DTensor parameters: torch's ``GradScaler`` finds the overflow on every rank.
    Plain local parameters (``dtensor_params=False``): torch's ``ShardedGradScaler`` over the
    TP group does; a plain ``GradScaler`` would see only its own shard, and rank 0 would
    step while rank 1 skips (asserted below)."""
    assert ranks2.run(overflow_on_one_rank, dtensor_params, scaler) == [(False, 128.0)] * 2


def test_a_plain_grad_scaler_on_local_parameters_sees_only_its_shard(ranks2):
    assert ranks2.run(overflow_on_one_rank, False, "torch") == [(True, 256.0), (False, 128.0)]
