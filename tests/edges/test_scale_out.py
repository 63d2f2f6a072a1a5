"""Beyond one node: fxtp's result inside the data-parallel machinery, on a ("dp", "tp")
mesh of 4 gloo ranks (2 x 2). FSDP2 ``fully_shard`` per block and on the root, and DDP,
train as the single-device model trained on the global batch (forward, every gradient,
3 AdamW steps, fp64); clipping gives the single-device norm; DCP checkpoints saved at
(dp 2, tp 2) load at (1, 4), (4, 1) and into the single-device model, bit-exact."""
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

import fxtp
from fxtp.examples.llama import TransformerBlock
from tests.helpers import models
from tests.helpers import transformer_models as tm
from tests.helpers.parity import LR, TIGHT, tolerance
from tests.helpers.parity import full

L = 2
TOKENS = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))


def llama(seed=0, rope="real"):
    torch.manual_seed(seed)
    return tm.Llama(tm.LlamaConfig(n_layers=L, n_heads=4, n_kv_heads=2, rope=rope))


def build(dp: int, tp: int, wrap: str, mp=None, seed=0, dtype=torch.float64, rope="real",
          loss_parallel=False, dtensor_logits=False):
    """This rank's model on a (dp, tp) mesh and its slice of the global batch;
    ``dtensor_logits``: the head hands its logits on as a DTensor (torchtitan's
    ``use_local_output=False``)."""
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    tokens = TOKENS.chunk(dp)[mesh["dp"].get_local_rank()]
    plan = tm.llama_sp_plan(loss_parallel)
    if dtensor_logits:
        plan["output"] = fxtp.ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                              use_local_output=False)
    gm = fxtp.parallelize(llama(seed, rope).to(dtype), plan, mesh["tp"],
                          example_inputs=(tokens,),
                          param_dtype=None if mp is None else mp.param_dtype)
    if wrap == "fsdp":
        kwargs = {} if mp is None else {"mp_policy": mp}
        # blocks picked by class, as torchtune's and Lightning's wrap policies pick them
        blocks = [m for m in gm.modules() if isinstance(m, TransformerBlock)]
        assert len(blocks) == L
        for block in blocks:
            fully_shard(block, mesh=mesh["dp"], **kwargs)
        fully_shard(gm, mesh=mesh["dp"], **kwargs)
    elif wrap == "ddp":
        from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform
        from torch.nn.parallel import DistributedDataParallel
        _pre_dp_module_transform(gm)  # torch's TP + DDP recipe: DDP takes local tensors
        gm = DistributedDataParallel(gm, process_group=mesh["dp"].get_group())
    return gm, tokens, mesh


class _CountAllGathers:
    """FSDP2's parameter all-gathers (``dist.all_gather_single``) on the dp group."""

    def __init__(self, group):
        self.group, self.count = group, 0

    def __enter__(self):
        self.original = dist.all_gather_single

        def counted(*args, **kwargs):
            if kwargs.get("group", args[2] if len(args) > 2 else None) is self.group:
                self.count += 1
            return self.original(*args, **kwargs)
        dist.all_gather_single = counted
        return self

    def __exit__(self, *exc):
        dist.all_gather_single = self.original


def train(rank, world, wrap):
    gm, tokens, mesh = build(2, 2, wrap)
    ref = llama().double()
    opt = torch.optim.AdamW(gm.parameters(), lr=LR, foreach=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    gathers = []
    for step in range(3):
        with _CountAllGathers(mesh["dp"].get_group()) as counted:
            out = gm(tokens)
        gathers.append(counted.count)
        ref_out = ref(TOKENS)
        torch.testing.assert_close(out, ref_out.chunk(2)[mesh["dp"].get_local_rank()], **TIGHT)
        out.square().mean().backward()
        ref_out.square().mean().backward()  # the mean over the global batch
        inner = gm.module if wrap == "ddp" else gm
        for name, p in inner.named_parameters():
            torch.testing.assert_close(full(p.grad), ref.get_parameter(name).grad, **TIGHT,
                                       msg=lambda m: f"step {step} grad of {name}: {m}")
        if step == 2 and wrap == "fsdp":  # torch's own clipping sees the 2-D DTensors
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            torch_norm = torch.nn.utils.clip_grad_norm_(inner.parameters(), 1e9)
            torch.testing.assert_close(full(torch_norm), ref_norm, **TIGHT)
            torch.testing.assert_close(fxtp.clip_grad_norm_(inner, 0.5), ref_norm, **TIGHT)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    inner = gm.module if wrap == "ddp" else gm
    for name, p in inner.named_parameters():
        torch.testing.assert_close(full(p.detach()), ref.get_parameter(name).detach(),
                                   **tolerance(torch.float64, steps=3),
                                   msg=lambda m: f"{name} after 3 AdamW steps: {m}")
    gm.eval(), ref.eval()  # the eval program, traced now, reads the trained shards
    with torch.no_grad():
        torch.testing.assert_close(gm(tokens), ref(TOKENS).chunk(2)[mesh["dp"].get_local_rank()],
                                   **tolerance(torch.float64, steps=3))
    return gathers


def test_fsdp2_per_block_on_a_2x2_mesh_trains_as_single_device(ranks4):
    """``fully_shard`` on each of ``gm.layers`` and on the root: dp all-gathers once per
    block and once for the root per forward."""
    for gathers in ranks4.run(train, "fsdp"):
        assert gathers == [L + 1] * 3


def test_ddp_on_a_2x2_mesh_trains_as_single_device(ranks4):
    ranks4.run(train, "ddp")


def accumulate(rank, world, wrap):
    """Two micro-batches per step, the data-parallel sync skipped on the first (FSDP2's
    ``set_requires_gradient_sync``, DDP's ``no_sync``): the gradients are those of the
    single-device model on both global batches."""
    import contextlib
    gm, tokens, mesh = build(2, 2, wrap)
    inner = gm.module if wrap == "ddp" else gm
    ref = llama().double()
    opt = torch.optim.AdamW(gm.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for step in range(2):
        second = torch.randint(0, 64, TOKENS.shape,
                               generator=torch.Generator().manual_seed(5 + step))
        for i, batch in enumerate((TOKENS, second)):
            if wrap == "fsdp":
                gm.set_requires_gradient_sync(i == 1)
            with gm.no_sync() if wrap == "ddp" and i == 0 else contextlib.nullcontext():
                mine = batch.chunk(2)[mesh["dp"].get_local_rank()]
                (gm(mine).square().mean() / 2).backward()
        ((ref(TOKENS).square().mean() + ref(second).square().mean()) / 2).backward()
        for name, p in inner.named_parameters():
            torch.testing.assert_close(full(p.grad), ref.get_parameter(name).grad, **TIGHT,
                                       msg=lambda m: f"step {step} grad of {name}: {m}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()


@pytest.mark.parametrize("wrap", ["fsdp", "ddp"])
def test_gradient_accumulation_without_dp_sync_trains_as_single_device(ranks4, wrap):
    ranks4.run(accumulate, wrap)


def loss_parallel(rank, world, torchs=False):
    """fxtp.cross_entropy on the local logits, or (``torchs``) torch's ``loss_parallel()``
    on the DTensor logits the head hands on, as torchtitan's loop takes its loss."""
    from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel
    gm, tokens, mesh = build(2, 2, "fsdp", loss_parallel=True, dtensor_logits=torchs)
    ref = llama().double()
    opt = torch.optim.AdamW(gm.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    targets = TOKENS.roll(-1, 1)
    mine = targets.chunk(2)[mesh["dp"].get_local_rank()]
    for step in range(3):
        logits = gm(tokens)  # this rank's classes of its dp rank's tokens
        ref_all = ref(TOKENS)
        ref_logits = ref_all.chunk(2)[mesh["dp"].get_local_rank()]
        assert isinstance(logits, DTensor) == torchs
        torch.testing.assert_close(full(logits) if torchs else logits,
                                   ref_logits if torchs else
                                   ref_logits.chunk(2, -1)[mesh["tp"].get_local_rank()], **TIGHT)
        if torchs:
            with torch_loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1), mine.flatten())
                loss.backward()
            loss = loss.full_tensor()
        else:
            loss = fxtp.cross_entropy(logits.flatten(0, 1), mine.flatten(), group=mesh["tp"])
            loss.backward()
        torch.testing.assert_close(loss, F.cross_entropy(ref_logits.flatten(0, 1), mine.flatten()),
                                   **TIGHT)
        F.cross_entropy(ref_all.flatten(0, 1), targets.flatten()).backward()
        for name, p in gm.named_parameters():
            torch.testing.assert_close(full(p.grad), ref.get_parameter(name).grad, **TIGHT,
                                       msg=lambda m: f"step {step} grad of {name}: {m}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for name, p in gm.named_parameters():
        torch.testing.assert_close(full(p.detach()), ref.get_parameter(name).detach(),
                                   **tolerance(torch.float64, steps=3))


@pytest.mark.parametrize("torchs", [False, True], ids=["fxtp_cross_entropy",
                                                     "torch_loss_parallel"])
def test_loss_parallel_under_fsdp2_per_block_trains_as_single_device(ranks4, torchs):
    """torchtitan's default loss: the head's logits stay sharded by class on "tp" and the
    loss is taken there, by ``fxtp.cross_entropy`` on the local logits or, as torchtitan's
    loop does, by torch's ``loss_parallel()`` on the DTensor the head hands on; each dp
    rank's mean loss, averaged by FSDP's gradient reduction, trains as the single-device
    mean over the global batch."""
    ranks4.run(loss_parallel, torchs)


def save_2d(rank, world, path):
    gm, _, _ = build(2, 2, "fsdp")
    sd = get_model_state_dict(gm)
    dcp.save(sd, checkpoint_id=path)
    return {k: full(v) for k, v in sd.items()}


def load_at(rank, world, dp, tp, path):
    gm, _, _ = build(dp, tp, "fsdp" if dp > 1 else "tp", seed=1)  # other weights
    sd = get_model_state_dict(gm)
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(gm, sd)
    return {k: full(v) for k, v in get_model_state_dict(gm).items()}


def test_dcp_saved_at_dp2_tp2_loads_at_tp4_dp4_and_single_device(ranks4, tmp_path):
    path = str(tmp_path / "dp2tp2")
    saved = ranks4.run(save_2d, path)[0]
    assert set(saved) == set(llama().state_dict())
    for dp, tp in [(1, 4), (4, 1)]:
        for loaded in ranks4.run(load_at, dp, tp, path):
            assert list(loaded) == list(saved)
            assert all(torch.equal(loaded[k], saved[k]) for k in saved), (dp, tp)
    model = llama(seed=2).double()
    sd = model.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(sd, checkpoint_id=path)
    assert all(torch.equal(sd[k], saved[k]) for k in saved)


FUSED_X = torch.randn(4, 8, models.DIM, generator=torch.Generator().manual_seed(0),
                      dtype=torch.float64)


def fused(seed):
    torch.manual_seed(seed)
    return models.FusedStack(2).double()


def fused_2d(dp, tp, seed, placement_fn=None):
    """The fused stack (q / k / v and gate / up in one weight each: ``_StridedShard`` on
    "tp") on a (dp, tp) mesh, ``fully_shard`` per block and on the root where dp > 1."""
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    x = FUSED_X.chunk(dp)[mesh["dp"].get_local_rank()]
    gm = fxtp.parallelize(fused(seed), models.FUSED_PLAN, mesh["tp"], example_inputs=(x,))
    if dp > 1:
        for block in gm.layers:
            fully_shard(block, mesh=mesh["dp"], shard_placement_fn=placement_fn)
        fully_shard(gm, mesh=mesh["dp"], shard_placement_fn=placement_fn)
    return gm, x, mesh


def fused_round_trip(rank, world, path, placement_fn):
    gm, x, mesh = fused_2d(2, 2, seed=0, placement_fn=placement_fn)
    ref = fused(0)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=LR) for m in (gm, ref))
    for _ in range(2):  # FSDP2 keeps this rank's rows of its TP shard of each fused weight
        gm(x).square().mean().backward()
        ref(FUSED_X).square().mean().backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    trained = ref.state_dict()
    if placement_fn is not None:  # cut along dim 1, FSDP2's own views of 2-D weights hold
        state = get_optimizer_state_dict(gm, opt, options=StateDictOptions(
            full_state_dict=True))["state"]
        ref_state = get_optimizer_state_dict(ref, ref_opt)["state"]
        for name, p in gm.named_parameters():
            if p.ndim == 2:
                torch.testing.assert_close(p.full_tensor(), trained[name],
                                           **tolerance(torch.float64, steps=2))
                for moment in ("exp_avg", "exp_avg_sq"):
                    torch.testing.assert_close(state[name][moment], ref_state[name][moment],
                                               **tolerance(torch.float64, steps=2))
    for got in (fxtp.full_state_dict(gm),
                get_model_state_dict(gm, options=StateDictOptions(full_state_dict=True))):
        for key, value in trained.items():
            torch.testing.assert_close(got[key], value, **tolerance(torch.float64, steps=2),
                                       msg=lambda m: f"{key}: {m}")
    dcp.save(gm.state_dict(), checkpoint_id=path)
    saved = fxtp.full_state_dict(gm)
    for dp, tp in [(2, 2), (1, 4)]:  # into fresh modules, FSDP2's and TP's alone
        fresh, _, _ = fused_2d(dp, tp, seed=1, placement_fn=placement_fn)
        sd = fresh.state_dict()
        dcp.load(sd, checkpoint_id=path)
        fresh.load_state_dict(sd)
        loaded = fxtp.full_state_dict(fresh)
        assert all(torch.equal(loaded[k], saved[k]) for k in saved), (dp, tp)
    fresh, x, _ = fused_2d(2, 2, seed=1, placement_fn=placement_fn)
    fxtp.load_full_state_dict(fresh, saved)
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), gm(x), rtol=0, atol=0)
    return saved


@pytest.mark.parametrize("placement_fn", [None, fxtp.fsdp_shard_placement],
                         ids=["fsdp_default", "fxtp_shard_placement"])
def test_fused_weights_under_fsdp2_checkpoint_and_load_whole(ranks4, tmp_path, placement_fn):
    """FSDP2 cuts the TP shard of a fused weight (``_StridedShard``) along the same dim by
    default and describes the result with a placement that scrambles its rows (its own
    ``full_tensor`` is wrong, DCP refuses overlapping chunks): fxtp's state-dict hooks and
    ``fxtp.state_dict`` go by what FSDP2 holds. After 2 AdamW steps the full state is the
    single-device model's (``fxtp.full_state_dict``, torch's ``get_model_state_dict``);
    ``dcp.save(gm.state_dict())`` loads into fresh modules at (2, 2) and (1, 4) and into
    the single-device model bit-exact; ``fxtp.load_full_state_dict`` restores the same
    outputs. With ``fxtp.fsdp_shard_placement`` FSDP2 cuts 2-D fused weights along dim 1,
    and its own views (``full_tensor``, the optimizer's full state) are right too."""
    path = str(tmp_path / "fused")
    saved = ranks4.run(fused_round_trip, path, placement_fn)[0]
    model = fused(2)
    sd = model.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(sd, checkpoint_id=path)
    assert all(torch.equal(sd[k], saved[k]) for k in saved)


def mixed_precision(rank, world):
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # torchtitan's rotary embedding computes in fp32 and casts back: bf16-safe
    gm, tokens, mesh = build(2, 2, "fsdp", mp=mp, dtype=torch.float32, rope="complex")
    ref_out = llama(rope="complex")(TOKENS).chunk(2)[mesh["dp"].get_local_rank()]
    opt = torch.optim.AdamW(gm.parameters(), lr=LR)
    for step in range(2):
        out = gm(tokens)
        assert out.dtype == torch.bfloat16
        if step == 0:
            relative = ((out.float() - ref_out).norm() / ref_out.norm()).item()
        out.float().square().mean().backward()
        assert all(torch.isfinite(full(p.grad)).all() for p in gm.parameters())
        opt.step()
        opt.zero_grad()
    dtypes = {full(p).dtype for p in gm.parameters()}
    return relative, dtypes


def test_fsdp2_mixed_precision_bf16_params_fp32_reduce(ranks4):
    """``param_dtype=torch.bfloat16`` traces the model as FSDP will run it; parameters stay
    fp32 (the optimizer's), compute is bf16: the output is the fp32 model's within bf16
    rounding, and training steps run."""
    for relative, dtypes in ranks4.run(mixed_precision):
        assert dtypes == {torch.float32}
        assert relative < 0.05


def test_hsdp_on_a_2x2x2_fake_mesh_shards_each_block_and_gathers_it_once(fake_group):
    """HSDP x TP at 8 ranks (replicate 2, shard 2, tp 2), shapes and counts only: a block's
    weight is its TP shard sharded again over "shard"; each forward gathers each block and
    the root once on the "shard" group."""
    fake_group(8, rank=5)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    model = llama()
    gm = fxtp.parallelize(model, tm.llama_sp_plan(), mesh["tp"], example_inputs=(TOKENS,))
    for block in gm.layers:
        fully_shard(block, mesh=mesh["replicate", "shard"])
    fully_shard(gm, mesh=mesh["replicate", "shard"])
    wq = gm.layers[0].attention.wq.weight
    full_shape = model.layers[0].attention.wq.weight.shape
    assert wq.shape == full_shape and wq.device_mesh.ndim == 3
    assert wq.to_local().shape == (full_shape[0] // 4, full_shape[1])
    with _CountAllGathers(mesh["shard"].get_group()) as counted:
        out = gm(TOKENS)
    assert out.shape == (*TOKENS.shape, 64) and counted.count == L + 1


def random_norms(module):
    """``init_fn``: the models' own initialization, and norm weights drawn at random (so
    the TP ranks of one FSDP piece must draw alike)."""
    tm.init_weights(module)
    if isinstance(module, tm.RMSNorm):
        torch.nn.init.normal_(module.weight)


def meta_then_fully_shard(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tokens = TOKENS.chunk(2)[mesh["dp"].get_local_rank()]
    with torch.device("meta"):
        model = llama().double()
    gm = fxtp.parallelize(model, tm.llama_sp_plan(), mesh["tp"], example_inputs=(tokens,),
                          device="meta")
    for block in gm.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(gm, mesh=mesh["dp"])
    gm.to_empty(device="cpu")
    fxtp.init_weights(gm, model, init_fn=random_norms)
    assert all(t.is_meta for t in model.state_dict().values())  # the user's model untouched
    held = sum(p.to_local().numel() for p in gm.parameters())
    share = sum(p.numel() // (4 if p.placements[1].is_shard() else 2)
                for p in gm.parameters())
    assert held == share, (held, share)
    norm = gm.layers[0].attention_norm.weight.to_local()  # Shard(0) on dp, Replicate on tp
    pieces = [torch.empty_like(norm) for _ in range(2)]
    dist.all_gather(pieces, norm, group=mesh["tp"].get_group())
    assert torch.equal(pieces[0], pieces[1])
    weights = {k: full(v) for k, v in get_model_state_dict(gm).items()}
    real = llama(seed=1).double()
    real.load_state_dict(weights)
    torch.testing.assert_close(gm(tokens), real(TOKENS).chunk(2)[mesh["dp"].get_local_rank()],
                               **TIGHT)
    return weights


def test_a_meta_model_sharded_by_fsdp2_then_allocated_holds_its_share_only(ranks4):
    """``parallelize(meta_model, ..., device="meta")``, ``fully_shard`` per block and root,
    ``to_empty``, ``fxtp.init_weights``: each rank holds 1/4 of each weight (1/2 of the
    norms, replicated on tp), TP ranks of one piece hold the same values, and the model
    computes as a single-device one holding the gathered weights; every rank agrees on
    them. (The peak memory of this route: tests/edges/test_meta_init.py.)"""
    weights = ranks4.run(meta_then_fully_shard)
    assert all(torch.equal(w[k], weights[0][k]) for w in weights for k in w)
    assert weights[0]["layers.0.attention_norm.weight"].std() > 0.5  # drawn, not ones
