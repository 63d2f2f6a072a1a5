"""What parallelize promises beyond numerics: meshes, shapes at larger world sizes,
parameter memory, FQNs, and the user's model left alone."""
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fxtp
from fxtp.passes.modules import inline_program
from tests.helpers import models
from tests.helpers.parity import check_parity, example, local_of

B, T = 2, 8


def with_device_mesh(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    return check_parity(rank, world, models.Attention, models.ATTENTION_PLAN,
                        [example(B, T, models.DIM)], dtype=torch.float64, mesh=mesh)


def with_subgroup(rank, world):
    group = dist.new_group([0, 1])
    if rank > 1:
        return None
    return check_parity(rank, 2, models.MLP, models.MLP_PLAN, [example(B, T, models.DIM)],
                        dtype=torch.float64, steps=1, mesh=group)


def test_mesh_may_be_a_1d_device_mesh(ranks):
    assert ranks.run(with_device_mesh)[0][0] == {"all_reduce": 1}


def test_mesh_may_be_a_process_group_smaller_than_the_world(ranks):
    results = ranks.run(with_subgroup)
    assert results[0][0] == {"all_reduce": 1} and results[1][0] == {"all_reduce": 1}


def test_world_size_8_local_shapes_and_parameter_memory(fake_group):
    """Shapes only (a fake process group moves no data): 8 ranks, 8 heads of width 8."""
    world, dim = 8, 64
    fake_group(world, rank=3)
    model = models.Stack(n_layers=2, dim=dim)
    for layer in model.layers:
        layer.attention.n_heads = 8
    snapshot = copy.deepcopy(model.state_dict())
    gm = fxtp.parallelize(model, models.STACK_PLAN, example_inputs=(torch.randn(B, T, dim),))
    local = {n: local_of(p) for n, p in gm.named_parameters()}
    assert list(local) == [n for n, _ in model.named_parameters()]
    assert local["layers.0.attention.wq.weight"].shape == (dim // world, dim)
    assert local["layers.0.attention.wo.weight"].shape == (dim, dim // world)
    assert local["layers.1.feed_forward.net1.bias"].shape == (4 * dim // world,)
    assert local["layers.1.feed_forward.net2.bias"].shape == (dim,)
    views = [n for n in inline_program(gm).nodes if n.target in (torch.ops.aten.view.default,
                                                       torch.ops.aten.reshape.default)]
    assert [list(n.args[1]) for n in views[:4]] == [
        [B, T, 1, dim // 8], [B, T, 1, -1], [B, T, 1, dim // 8], [B, T, dim // world]]
    sharded = sum(p.numel() for n, p in model.named_parameters()
                  if not isinstance(gm.fxtp.param_placements[n], fxtp.Replicate))
    replicated = sum(p.numel() for n, p in model.named_parameters()) - sharded
    held = sum(local_of(t).numel() for t in gm.state_dict().values())
    assert held == sharded // world + replicated
    assert gm(torch.randn(B, T, dim)).shape == (B, T, dim)
    for name, t in model.state_dict().items():
        assert torch.equal(t, snapshot[name])


def test_a_single_style_applies_to_the_root(fake_group):
    fake_group(2)
    gm = fxtp.parallelize(nn.Linear(4, 6), fxtp.ColwiseParallel(),
                          example_inputs=(torch.randn(3, 4),))
    assert gm.weight.to_local().shape == (3, 4) and gm.weight.shape == (6, 4)
    assert gm.fxtp.output_placements == (fxtp.Shard(1),)
