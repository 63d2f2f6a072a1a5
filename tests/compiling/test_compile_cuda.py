"""The compiled paths on a CUDA device, bf16 end to end (model, inputs, gradients, AdamW):
NCCL with one rank against the same module eager, and a fake process group of 4 ranks
(shapes and dtypes only: a fake group moves no data). Skipped without CUDA."""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

import fxtp
from tests.compiling.test_compile import CASES
from tests.helpers.compiled import check_compiled
from tests.helpers.parity import local_of, local_part

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
BACKENDS = pytest.mark.parametrize("backend", ["inductor", "fxtp"])


@pytest.fixture
def nccl_group(tmp_path):
    """NCCL with world size 1 in this process."""
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def nccl_training(case, backend, device="cuda"):
    make, plan, inputs, *placements = CASES[case]
    return check_compiled(0, 1, make, plan, inputs, backend=backend, dtype=torch.bfloat16,
                          device=device, input_placements=placements[0] if placements else None)


@BACKENDS
@pytest.mark.parametrize("case", CASES)
def test_bf16_training_on_nccl_matches_eager(nccl_group, case, backend):
    counts = nccl_training(case, backend)
    if backend == "inductor":
        assert counts["compiled"] == counts["eager"]


def fake_training(case, backend, device="cuda", world=4, steps=2):
    """Compile and take AdamW steps as rank 0 of ``world``; check every shape and dtype."""
    make, plan, inputs, *placements = CASES[case]
    torch.manual_seed(0)
    model = make().to(device=device, dtype=torch.bfloat16)
    xs = [x.to(device=device, dtype=torch.bfloat16 if x.is_floating_point() else x.dtype)
          for x in inputs]
    gm = fxtp.parallelize(model, plan, example_inputs=xs)
    compiled = torch.compile(gm, backend=backend, fullgraph=True)
    opt = torch.optim.AdamW(gm.parameters())
    local = [local_part(x, p, 0, world)
             for x, p in zip(xs, placements[0] if placements else [None] * len(xs))]
    for _ in range(steps):
        out = compiled(*local)
        out.float().sum().backward()
        opt.step()
        opt.zero_grad()
    expected = local_part(model(*xs), gm.fxtp.output_placements[0], 0, world)
    assert (out.shape, out.dtype, out.device.type) == (expected.shape, torch.bfloat16, device)
    for name, p in gm.named_parameters():
        full, placement = model.get_parameter(name), gm.fxtp.param_placements[name]
        shard = full.chunk(world, placement.dim)[0] if isinstance(placement, Shard) else full
        p = local_of(p)
        assert (p.shape, p.dtype, p.device.type) == (shard.shape, torch.bfloat16, device), name


@BACKENDS
@pytest.mark.parametrize("case", CASES)
def test_bf16_training_compiles_for_4_ranks_on_a_fake_group(fake_group, case, backend):
    fake_group(4)
    fake_training(case, backend)


def test_compiling_each_block_on_its_own_matches_the_eager_blocks(fake_group):
    """Regional compilation, as torchtitan does it: each of ``gm.layers`` compiled on its
    own (fullgraph, inductor) computes the eager blocks' output and every gradient (fp32,
    rank 0 of a fake group of 4, whose all-reduces leave the local sums: the same function
    either way)."""
    from tests.helpers import models
    fake_group(4)
    torch.manual_seed(0)
    model = models.Stack(n_layers=2).cuda()
    x = torch.randn(models.BATCH, models.SEQ, models.DIM, device="cuda")
    eager = fxtp.parallelize(model, models.STACK_PLAN, example_inputs=(x,), strict=True)
    regional = fxtp.parallelize(model, models.STACK_PLAN, example_inputs=(x,), strict=True)
    for i, block in list(regional.layers.named_children()):
        regional.layers.register_module(i, torch.compile(block, fullgraph=True))
    outs = [m(x) for m in (eager, regional)]
    torch.testing.assert_close(outs[1], outs[0])
    for out in outs:
        out.square().sum().backward()
    for p, q in zip(eager.parameters(), regional.parameters(), strict=True):
        torch.testing.assert_close(local_of(q.grad), local_of(p.grad))
    assert all(type(m).__name__ == "OptimizedModule" for m in regional.layers)


def test_cuda_graphs_decode_reads_the_parameters_in_place(nccl_group):
    """``mode="reduce-overhead"``: the plain reads are static inputs of the CUDA graph, so
    an in-place update of a DTensor parameter (an optimizer step, a load) shows in the next
    replay; one compile across decode positions."""
    from fxtp.examples.gpt_fast import ServeConfig, Transformer, tp_plan
    cfg = ServeConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden=128,
                      max_seq_len=32)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Transformer(cfg).to(torch.bfloat16)
    model.setup_caches(1)
    prompt = torch.randint(0, 64, (1, 8), device="cuda")
    seq = torch.export.Dim("seq", min=1, max=cfg.max_seq_len)
    gm = fxtp.parallelize(model, tp_plan(), example_inputs=(prompt, torch.arange(8)),
                          dynamic_shapes=({1: seq}, {0: seq}))
    torch._dynamo.utils.counters.clear()
    step = torch.compile(gm, fullgraph=True, mode="reduce-overhead")
    token = prompt[:, :1]
    with torch.no_grad():
        for position in range(8, 12):
            step(token, torch.tensor([position], device="cuda"))
        before = step(token, torch.tensor([12], device="cuda")).clone()
        gm.output.weight.mul_(2.0)
        after = step(token, torch.tensor([13], device="cuda"))
        eager = gm(token, torch.tensor([13], device="cuda"))
    torch.testing.assert_close(after, eager)
    assert not torch.equal(before, after)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
