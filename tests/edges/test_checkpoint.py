"""Checkpoints: fxtp.state_dict gives DTensors that torch.distributed.checkpoint saves at
one world size and loads at another, or into the single-device model (and back);
fxtp.full_state_dict / load_full_state_dict do the same with plain tensors. Every round
trip is bit-exact. The subjects hold every kind of placement: Shard(0), Shard(1),
Replicate, _StridedShard (fused projections), a tied weight, and UnitShard (a vocabulary of
67 and 6 heads, dealt unevenly)."""
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import fxtp
from tests.helpers import models
from tests.helpers import transformer_models as tm
from tests.helpers.corpus import gpt2_tp_plan
from tests.helpers.harness import pool_of
from tests.helpers.parity import local_of, local_part

TOKENS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
SUBJECTS = {
    "gpt2": (tm.GPT2, tm.gpt2_sp_plan(), TOKENS),
    "fused": (lambda: models.FusedStack(2), models.FUSED_PLAN, torch.randn(2, 8, models.DIM)),
    "uneven": (lambda: tm.GPT2(tm.GPT2Config(vocab_size=67, n_head=6, n_embd=48)),
               gpt2_tp_plan(), TOKENS),
}


def build(name, seed):
    make, plan, x = SUBJECTS[name]
    torch.manual_seed(seed)
    return fxtp.parallelize(make(), plan, example_inputs=(x,))


def plain(name, seed):
    torch.manual_seed(seed)
    return SUBJECTS[name][0]()


def save(rank, world, name, path, api="fxtp"):
    gm = build(name, seed=0)
    sd = fxtp.state_dict(gm) if api == "fxtp" else gm.state_dict()
    placements = {k: v.placements[0] for k, v in sd.items()}
    dcp.save(sd, checkpoint_id=path)
    return fxtp.full_state_dict(gm), placements


def load(rank, world, name, path, api="fxtp"):
    gm = build(name, seed=1)  # other weights, overwritten by the load
    if api == "fxtp":
        sd = fxtp.state_dict(gm)
        dcp.load(sd, checkpoint_id=path)
        fxtp.load_state_dict(gm, sd)
    else:  # the parameters are DTensors: torch's own state-dict API sees the global model
        sd = get_model_state_dict(gm)
        dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(gm, sd)
    return fxtp.full_state_dict(gm)


def assert_equal(a: dict, b: dict):
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def load_plain(name, path):
    """DCP without a process group loads into a plain state dict in place."""
    model = plain(name, seed=2)
    sd = model.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(sd, checkpoint_id=path)
    return model


# fxtp.state_dict and torch's state-dict API share the DTensor layouts: each subject once
API_SUBJECTS = [("gpt2", "fxtp"), ("fused", "torch"), ("uneven", "torch")]


@pytest.mark.parametrize("name,api", API_SUBJECTS, ids=[f"{n}-{a}" for n, a in API_SUBJECTS])
def test_dcp_saves_at_world_2_and_loads_at_world_4_and_into_the_plain_model(pools, tmp_path,
                                                                              name, api):
    """``api="torch"``: ``dcp.save(gm.state_dict())``, then ``get_model_state_dict`` /
    ``set_model_state_dict`` around ``dcp.load``: no shard is lost."""
    path = str(tmp_path / "world2")
    (full, placements), _ = pool_of(pools, 2).run(save, name, path, api)
    if name == "fused":  # handed to DCP re-laid as plain shards
        assert placements["layers.0.attention.qkv.weight"] == Shard(0)
    elif name == "uneven":  # 67 rows: DTensor's uneven Shard, as torch.chunk deals them
        assert placements["wte.weight"] == Shard(0)
    else:
        assert placements["lm_head.weight"] == Shard(0)
        assert placements["h.0.ln_1.weight"].is_replicate()
    for loaded in pool_of(pools, 4).run(load, name, path, api):
        assert_equal(loaded, full)
    assert_equal(load_plain(name, path).state_dict(), full)


@pytest.mark.parametrize("name", list(SUBJECTS))
def test_a_plain_models_dcp_checkpoint_loads_into_the_parallel_module(ranks, tmp_path, name):
    model = plain(name, seed=3)
    path = str(tmp_path / "plain")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(model.state_dict(), checkpoint_id=path)
    for loaded in ranks.run(load, name, path):
        assert_equal(loaded, model.state_dict())


def full_round_trip(rank, world, name, other):
    gm = build(name, seed=0)
    full = fxtp.full_state_dict(gm)
    model = plain(name, seed=4)
    model.load_state_dict(full)
    assert_equal(model.state_dict(), full)
    fxtp.load_full_state_dict(gm, other)
    tensors = {**dict(gm.named_parameters()), **dict(gm.named_buffers())}
    for key, t in tensors.items():  # each rank kept its own part
        placement = gm.fxtp.param_placements.get(key)
        assert torch.equal(local_of(t), local_part(other[key], placement, rank, world)), key
    return fxtp.full_state_dict(gm)


@pytest.mark.parametrize("name", list(SUBJECTS))
def test_full_state_dicts_round_trip_through_the_plain_model(ranks, name):
    other = plain(name, seed=5).state_dict()
    for full in ranks.run(full_round_trip, name, other):
        assert_equal(full, other)


def wrapped_round_trip(rank, world, other):
    torch.manual_seed(0)
    model = tm.Llama(tm.LlamaConfig(n_layers=2))
    gm = fxtp.parallelize(model, tm.llama_sp_plan(), example_inputs=(TOKENS,))
    before = fxtp.full_state_dict(gm)
    gm.layers.register_module("0", checkpoint_wrapper(gm.layers[0]))
    gm.layers.register_module("1", torch.compile(gm.layers[1], backend="eager"))
    assert list(fxtp.state_dict(gm)) == list(model.state_dict())
    assert_equal(fxtp.full_state_dict(gm), before)
    fxtp.load_full_state_dict(gm, other)
    return fxtp.full_state_dict(gm)


def test_checkpoints_of_blocks_compiled_or_checkpointed_in_place_keep_the_models_keys(ranks2):
    """torch.compile and checkpoint_wrapper add ``_orig_mod`` / ``_checkpoint_wrapped_module``
    to the blocks' parameter names; fxtp's state dicts still use the model's keys, save and
    load every shard."""
    torch.manual_seed(5)
    other = tm.Llama(tm.LlamaConfig(n_layers=2)).state_dict()
    for full in ranks2.run(wrapped_round_trip, other):
        assert_equal(full, other)


def strided_layout(rank, world):
    gm = build("fused", seed=0)
    key = "layers.0.attention.qkv.weight"
    assert isinstance(gm.fxtp.param_placements[key], _StridedShard)
    sd = fxtp.state_dict(gm)
    assert isinstance(sd[key], DTensor) and sd[key].placements == (Shard(0),)
    held = local_of(gm.get_parameter("layers.0.attention.wo.weight"))
    assert sd["layers.0.attention.wo.weight"].to_local().data_ptr() == \
        held.data_ptr()  # shared, loads in place
    with pytest.raises(fxtp.PlanError, match=r"missing \['norm\.bias'\]"):
        fxtp.load_state_dict(gm, {k: v for k, v in sd.items() if k != "norm.bias"})
    with pytest.raises(fxtp.PlanError, match=r"state_dict\['norm\.bias'\] is a Tensor, not "
                                             r"a DTensor; use fxtp\.load_full_state_dict"):
        fxtp.load_state_dict(gm, {**sd, "norm.bias": torch.zeros(models.DIM)})


def test_state_dict_shares_memory_except_strided_shards_and_checks_keys(ranks4):
    ranks4.run(strided_layout)
