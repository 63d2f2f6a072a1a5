"""Loss parallel: cross-entropy on class-sharded logits, without gathering them.

``fxtp.cross_entropy`` against ``F.cross_entropy`` on the full logits for every option
(value and the gradient of this rank's logits, 3 all-reduces forward, none backward); the
same computation chosen inside a traced model whose LM head leaves the logits sharded;
and the gathered-logits path, which keeps the ordinary op."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fxtp
from fxtp import Replicate, Shard
from fxtp.kernels.cross_entropy import loss_parallel_cross_entropy
from tests.helpers import transformer_models as tm
from tests.helpers.parity import LR, TIGHT, check_parity, local_of, local_part, tolerance

C = 16  # classes: 8 or 4 per rank


def _rand(*shape, seed, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _replicated(t):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    return DTensor.from_local(t, mesh, (Replicate(),), run_check=False)


def _indices(*shape, seed, ignore=()):
    t = torch.randint(0, C, shape, generator=torch.Generator().manual_seed(seed))
    for i in ignore:
        t.view(-1)[i] = -100
    return t


# name: (logits shape, class dim, target, F.cross_entropy keyword arguments)
CASES = {
    "mean": ((6, C), -1, "index", {}),
    "sum": ((6, C), -1, "index", {"reduction": "sum"}),
    "none": ((6, C), -1, "index", {"reduction": "none"}),
    "ignore_index": ((6, C), -1, "ignored", {}),
    "ignore_index_in_range": ((6, C), -1, "index", {"ignore_index": 3}),
    "all_ignored_sum": ((2, C), -1, "all_ignored", {"reduction": "sum"}),
    "weight": ((6, C), -1, "ignored", {"weight": True}),
    "weight_sum": ((6, C), -1, "ignored", {"weight": True, "reduction": "sum"}),
    "smoothing": ((6, C), -1, "ignored", {"label_smoothing": 0.1}),
    "smoothing_none": ((6, C), -1, "ignored", {"label_smoothing": 0.2, "reduction": "none"}),
    "smoothing_weight": ((6, C), -1, "ignored", {"label_smoothing": 0.3, "weight": True}),
    "smoothing_weight_none": ((6, C), -1, "ignored",
                              {"label_smoothing": 0.3, "weight": True, "reduction": "none"}),
    "probabilities": ((6, C), -1, "probs", {}),
    "probabilities_none": ((6, C), -1, "probs", {"reduction": "none"}),
    "probabilities_smoothing_weight": ((6, C), -1, "probs",
                                       {"label_smoothing": 0.2, "weight": True,
                                        "reduction": "sum"}),
    "one_token": ((C,), -1, "index", {}),
    "one_token_probabilities": ((C,), 0, "probs", {"label_smoothing": 0.1}),
    "spatial_class_dim_1": ((3, C, 5), 1, "ignored", {"label_smoothing": 0.1, "weight": True}),
    "spatial_none": ((3, C, 5), 1, "index", {"reduction": "none"}),
    "batch_time_classes": ((3, 4, C), -1, "ignored", {"label_smoothing": 0.1}),
    "batch_time_probabilities": ((3, 4, C), 2, "probs", {"reduction": "none"}),
}


def _case(name, dtype):
    """Full logits, full target, F's keyword arguments (weight as a tensor)."""
    shape, class_dim, kind, kwargs = CASES[name]
    logits = _rand(*shape, seed=1).to(dtype) * 3
    tokens = shape[:class_dim % len(shape)] + shape[class_dim % len(shape) + 1:]
    if kind == "probs":
        target = _rand(*shape, seed=2).softmax(class_dim).to(dtype)
    else:
        n = torch.Size(tokens).numel()
        ignore = {"index": (), "ignored": (0, n // 2), "all_ignored": range(n)}[kind]
        target = _indices(*tokens, seed=2, ignore=ignore)
    kwargs = dict(kwargs)
    if kwargs.get("weight"):
        kwargs["weight"] = _rand(C, seed=3).abs().to(dtype)
    return logits, class_dim, target, kwargs


def loss_vs_full(rank, world, name, dtype):
    """fxtp.cross_entropy on this rank's classes vs F.cross_entropy on the full logits
    (bf16: of the fp32 upcast); returns the collective counts."""
    full, class_dim, target, kwargs = _case(name, dtype)
    ref_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
    full_ref = full.to(ref_dtype, copy=True).requires_grad_()
    moved = full_ref.movedim(class_dim, 1) if full.dim() > 1 else full_ref
    ref_target = target.to(ref_dtype) if target.is_floating_point() else target
    if target.is_floating_point() and full.dim() > 1:
        ref_target = ref_target.movedim(class_dim, 1)
    ref_kwargs = {k: v.to(ref_dtype) if k == "weight" else v for k, v in kwargs.items()}
    ref = F.cross_entropy(moved, ref_target, **ref_kwargs)
    upstream = _rand(*ref.shape, seed=4).to(dtype).to(ref_dtype)  # exact in the dtype
    (ref * upstream).sum().backward()

    logits = full.chunk(world, class_dim)[rank].clone().requires_grad_()
    local_target = target.chunk(world, class_dim)[rank] if target.is_floating_point() else target
    with fxtp.count_collectives() as fwd:
        loss = fxtp.cross_entropy(logits, local_target, class_dim=class_dim, **kwargs)
    with fxtp.count_collectives() as bwd:
        (loss * upstream.to(loss.dtype)).sum().backward()
    assert loss.dtype == dtype and logits.grad.dtype == dtype
    expected_grad = full_ref.grad.chunk(world, class_dim)[rank]
    if dtype == torch.bfloat16:  # computed in fp32, rounded once to bf16
        close = dict(rtol=2 ** -8, atol=1e-6)
    else:
        close = TIGHT if dtype == torch.float64 else {}
    torch.testing.assert_close(loss.to(ref_dtype), ref.detach(), **close)
    torch.testing.assert_close(logits.grad.to(ref_dtype), expected_grad, **close)
    return dict(fwd.counts), dict(bwd.counts)


DTYPES = [torch.float64, torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_f_cross_entropy_on_full_logits(ranks, name, dtype):
    fwd, bwd = ranks.run(loss_vs_full, name, dtype)[0]
    assert fwd == {"all_reduce": 3}
    assert bwd == {}


def traced_vs_eager(rank, world):
    """Each case's loss and logits gradient, traced by dynamo, against eager."""
    group = dist.group.WORLD.group_name
    for name in CASES:
        full, class_dim, target, kwargs = _case(name, torch.float64)
        if target.is_floating_point():
            target = target.chunk(world, class_dim)[rank]
        args = (kwargs.get("weight"), kwargs.get("reduction", "mean"),
                kwargs.get("ignore_index", -100), kwargs.get("label_smoothing", 0.0),
                class_dim % full.dim(), rank, world, group)

        def loss_of(logits, target):
            return loss_parallel_cross_entropy(logits, target, *args)
        results = []
        torch.compiler.reset()  # a program per case: the cases are more than dynamo's limit
        for fn in (loss_of, torch.compile(loss_of, backend="eager", fullgraph=True,
                                          dynamic=False)):
            logits = full.chunk(world, class_dim)[rank].clone().requires_grad_()
            loss = fn(logits, target)
            (loss * _rand(*loss.shape, seed=4)).sum().backward()
            results.append((loss.detach(), logits.grad))
        (loss, grad), (got, got_grad) = results
        torch.testing.assert_close(got, loss, **TIGHT, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(got_grad, grad, **TIGHT, msg=lambda m: f"{name}: {m}")


def test_traced_by_dynamo_it_computes_what_it_does_eagerly(ranks2):
    """torch 2.11's dynamo gave a zero gradient when the loss was returned as the tensor it
    computed (an output that is also an intermediate); the compile tests caught it."""
    ranks2.run(traced_vs_eager)


def probability_target_grad(rank, world):
    full = _rand(6, C, seed=1)
    target = _rand(6, C, seed=2).softmax(-1).requires_grad_()
    ref = F.cross_entropy(full, target, label_smoothing=0.2)
    ref.backward()
    local = target.detach().chunk(world, 1)[rank].clone().requires_grad_()
    fxtp.cross_entropy(full.chunk(world, 1)[rank], local, label_smoothing=0.2).backward()
    torch.testing.assert_close(local.grad, target.grad.chunk(world, 1)[rank], **TIGHT)


def test_probability_targets_get_their_gradient(ranks):
    ranks.run(probability_target_grad)


def group_and_mesh(rank, world):
    full, target = _rand(6, C, seed=1), _indices(6, seed=2)
    local = full.chunk(world, 1)[rank]
    expected = F.cross_entropy(full, target)
    for group in (None, dist.group.WORLD, init_device_mesh("cpu", (world,))):
        torch.testing.assert_close(fxtp.cross_entropy(local, target, group=group), expected,
                                   **TIGHT)


def test_group_may_be_a_process_group_or_a_1d_device_mesh(ranks):
    ranks.run(group_and_mesh)


@pytest.mark.parametrize("call,message", [
    (lambda: fxtp.cross_entropy(_rand(3, 8, 5, seed=0), _indices(3, 5, seed=0)),
     r"shape without class dim 2, \(3, 8\).*pass class_dim=1"),
    (lambda: fxtp.cross_entropy(_rand(6, 8, seed=0), _indices(6, seed=0),
                                weight=torch.ones(8, dtype=torch.float64)),
     r"weight must hold all 16 classes.*full tensor"),
    (lambda: fxtp.cross_entropy(_rand(6, 8, seed=0), _rand(6, 16, seed=0)),
     r"probability targets are sharded like the logits.*\(6, 8\)"),
    (lambda: fxtp.cross_entropy(_rand(6, 8, seed=0), _rand(6, 8, seed=0), ignore_index=2),
     "ignore_index is not supported for probability targets"),
    (lambda: fxtp.cross_entropy(_rand(6, 8, seed=0), _indices(6, seed=0), reduction="avg"),
     "reduction must be one of"),
    (lambda: fxtp.cross_entropy(_rand(6, 8, seed=0), torch.tensor([0, 1, 2, 3, 4, 16])),
     r"a target is outside \[0, 16\)"),
    (lambda: fxtp.cross_entropy(_replicated(_rand(6, 16, seed=0)), _indices(6, seed=0)),
     r"DTensor logits sharded by class on a 1-D mesh \(Shard\(1\)\), got \(Replicate\(\),\)"),
], ids=["class_dim", "weight_shape", "probability_shape", "probability_ignore_index",
        "reduction", "target_out_of_bounds", "dtensor_not_sharded_by_class"])
def test_bad_arguments_are_clear_errors(fake_group, call, message):
    fake_group(2)
    with pytest.raises((ValueError, RuntimeError), match=message):
        call()


# --- inside the traced model -------------------------------------------------------------

L = 2
TOKENS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
TARGETS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
TARGETS_IGNORED = TARGETS.masked_fill(torch.arange(32).view(2, 16) % 5 == 0, -100)


class LlamaWithLoss(nn.Module):
    """A Llama whose forward returns the next-token loss, written the usual way."""

    def __init__(self, weight=False, **loss_kwargs):
        super().__init__()
        self.model = tm.Llama(tm.LlamaConfig(n_heads=8, n_kv_heads=4))
        self.loss_kwargs = loss_kwargs
        vocab = self.model.config.vocab_size
        self.register_buffer("class_weight", torch.rand(vocab) + 0.5 if weight else None)

    def forward(self, tokens, targets):
        logits = self.model(tokens)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                               weight=self.class_weight, **self.loss_kwargs)


def llama_plan(output_layouts=Shard(-1)):
    return {"model.tok_embeddings": fxtp.RowwiseParallel(input_layouts=Replicate()),
            **{f"model.{k}": v for k, v in tm.llama_layer_plan().items()},
            "model.output": fxtp.ColwiseParallel(output_layouts=output_layouts)}


LOSSES = {
    "mean": ({}, TARGETS),
    "none": ({"reduction": "none"}, TARGETS),
    "label_smoothing": ({"label_smoothing": 0.1}, TARGETS),
    "ignore_index": ({}, TARGETS_IGNORED),
    "weight_smoothing_ignore_index": ({"weight": True, "label_smoothing": 0.1},
                                      TARGETS_IGNORED),
}


def llama_loss(rank, world, loss, dtype, output_layouts=Shard(-1)):
    kwargs, targets = LOSSES[loss]
    return check_parity(rank, world, lambda: LlamaWithLoss(**kwargs), llama_plan(output_layouts),
                        [TOKENS, targets], dtype=dtype, input_grads=False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_loss_inside_the_graph_never_gathers_the_logits(ranks, dtype):
    """2 all-reduces per layer and the embedding's, plus the loss's 3; backward as without
    the loss: 2 per layer and the final norm feeding the colwise head."""
    fwd, bwd = ranks.run(llama_loss, "mean", dtype)[0]
    assert fwd == {"all_reduce": 2 * L + 1 + 3}
    assert bwd == {"all_reduce": 2 * L + 1}


@pytest.mark.parametrize("loss", [name for name in LOSSES if name != "mean"])
def test_loss_options_inside_the_graph(ranks, loss):
    fwd, bwd = ranks.run(llama_loss, loss, torch.float64)[0]
    assert fwd == {"all_reduce": 2 * L + 1 + 3}
    assert bwd == {"all_reduce": 2 * L + 1}


def test_gathered_logits_keep_the_ordinary_loss(ranks):
    """A head planned with Replicate output gathers the logits; the loss then runs as is."""
    fwd, bwd = ranks.run(llama_loss, "mean", torch.float64, Replicate())[0]
    assert fwd == {"all_reduce": 2 * L + 1, "all_gather": 1}
    assert bwd == {"all_reduce": 2 * L + 1}


def test_the_graph_calls_loss_parallel_only_on_sharded_logits(fake_group):
    fake_group(2)
    model = LlamaWithLoss(label_smoothing=0.1)
    for layouts, expected in ((Shard(-1), loss_parallel_cross_entropy),
                              (Replicate(), torch.ops.aten.cross_entropy_loss.default)):
        gm = fxtp.parallelize(model, llama_plan(layouts), example_inputs=(TOKENS, TARGETS))
        losses = [n for n in gm.graph.nodes if n.target in (
            loss_parallel_cross_entropy, torch.ops.aten.cross_entropy_loss.default)]
        assert [n.target for n in losses] == [expected]
        assert gm.fxtp.output_placements == (Replicate(),)


def loss_outside(rank, world, flatten, plan=None, steps=3):
    """The model returns its class-sharded logits; fxtp.cross_entropy computes the loss."""
    torch.manual_seed(0)
    model = tm.Llama(tm.LlamaConfig(n_heads=8, n_kv_heads=4)).double()
    ref = copy.deepcopy(model)
    plan = plan or {k[len("model."):]: v for k, v in llama_plan().items()}
    gm = fxtp.parallelize(model, plan, example_inputs=(TOKENS,))
    assert gm.fxtp.output_placements == (Shard(2),)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=LR) for m in (gm, ref))
    for step in range(steps):
        logits = gm(TOKENS)
        with fxtp.count_collectives() as fwd:
            if flatten:
                loss = fxtp.cross_entropy(logits.flatten(0, 1), TARGETS_IGNORED.flatten())
            else:
                loss = fxtp.cross_entropy(logits, TARGETS_IGNORED)
        ref_logits = ref(TOKENS)
        ref_loss = F.cross_entropy(ref_logits.view(-1, ref_logits.size(-1)),
                                   TARGETS_IGNORED.view(-1))
        torch.testing.assert_close(loss, ref_loss, **tolerance(torch.float64, steps=0))
        with fxtp.count_collectives() as bwd:
            loss.backward()
        ref_loss.backward()
        for name, p in gm.named_parameters():
            expected = local_part(ref.get_parameter(name).grad, gm.fxtp.param_placements[name],
                                  rank, world)
            torch.testing.assert_close(local_of(p.grad), expected,
                                       **tolerance(torch.float64, expected, step),
                                       msg=lambda m: f"step {step} grad of {name}: {m}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        if step == 0:
            counts = dict(fwd.counts), dict(bwd.counts)
    return counts


@pytest.mark.parametrize("flatten", [True, False], ids=["flattened", "batch_time_classes"])
def test_loss_outside_the_graph_on_sharded_logits(ranks, flatten):
    """The loss's own collectives: 3 forward; backward only the model's (2 per layer and the
    final norm), none of the loss's."""
    fwd, bwd = ranks.run(loss_outside, flatten)[0]
    assert fwd == {"all_reduce": 3}
    assert bwd == {"all_reduce": 2 * L + 1}


def torchtitan_loop(rank, world, steps=3):
    """torchtitan's loop as written: its head planned with torch's own
    ``ColwiseParallel(use_local_output=False)`` returns the logits as a DTensor sharded by
    class, and torch's ``loss_parallel()`` computes the loss on it."""
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel
    torch.manual_seed(0)
    model = tm.Llama(tm.LlamaConfig(n_heads=8, n_kv_heads=4)).double()
    ref = copy.deepcopy(model)
    plan = {**{k[len("model."):]: v for k, v in llama_plan().items()},
            "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    gm = fxtp.parallelize(model, plan, example_inputs=(TOKENS,))
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=LR) for m in (gm, ref))
    for step in range(steps):
        logits = gm(TOKENS)
        assert isinstance(logits, DTensor) and logits.placements == (Shard(2),)
        assert logits.shape == (*TOKENS.shape, model.config.vocab_size)
        ours = fxtp.cross_entropy(logits.flatten(0, 1), TARGETS_IGNORED.flatten())
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), TARGETS_IGNORED.flatten())
            loss.backward()
        torch.testing.assert_close(ours, loss.full_tensor(), **TIGHT)  # takes the DTensor
        ref_logits = ref(TOKENS)
        ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), TARGETS_IGNORED.flatten())
        ref_loss.backward()
        torch.testing.assert_close(loss.full_tensor(), ref_loss,
                                   **tolerance(torch.float64, steps=0))
        for name, p in gm.named_parameters():
            expected = local_part(ref.get_parameter(name).grad, gm.fxtp.param_placements[name],
                                  rank, world)
            torch.testing.assert_close(local_of(p.grad), expected,
                                       **tolerance(torch.float64, expected, step),
                                       msg=lambda m: f"step {step} grad of {name}: {m}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()


def test_a_head_planned_to_hand_on_a_dtensor_feeds_torchs_loss_parallel(ranks):
    ranks.run(torchtitan_loop)


def hf_llama_loss(rank, world):
    from tests.model_code.test_huggingface import LLAMA_PLAN, llama
    plan = {**LLAMA_PLAN, "lm_head": fxtp.ColwiseParallel()}
    return check_parity(rank, world, llama, plan, [TOKENS], dtype=torch.float32,
                        input_grads=False, kwargs={"labels": TARGETS_IGNORED, "use_cache": False},
                        output=lambda out: out.loss)


def test_hugging_face_llama_computes_its_loss_on_sharded_logits(ranks):
    """LlamaForCausalLM(labels=...) upcasts, shifts and flattens inside its loss function;
    the logits it returns stay sharded (fp32 only: Hugging Face computes the loss in fp32)."""
    pytest.importorskip("transformers", reason="pip install -e '.[test]'")
    fwd, bwd = ranks.run(hf_llama_loss)[0]
    assert fwd == {"all_reduce": 2 * L + 1 + 3}
    assert bwd == {"all_reduce": 2 * L + 1}


def token_sharded_loss(rank, world, loss):
    """The final norm sequence-parallel and the head left replicated: the logits arrive
    split by tokens (strided, once flattened), and the loss is taken on them as they are."""
    kwargs, targets = LOSSES[loss]
    plan = {k: v for k, v in llama_plan().items() if k != "model.output"}
    plan["model.norm"] = fxtp.SequenceParallel()
    return check_parity(rank, world, lambda: LlamaWithLoss(**kwargs), plan,
                        [TOKENS, targets], dtype=torch.float64, input_grads=False,
                        strict=True)


@pytest.mark.parametrize("loss", list(LOSSES))
def test_the_mean_of_tokens_split_over_ranks_is_one_all_reduce(ranks, loss):
    """The mean's sum and kept weight, summed by one all-reduce: no gather of the logits
    (nor a fallback); a per-token loss stays split."""
    fwd, bwd = ranks.run(token_sharded_loss, loss)[0]
    assert fwd == {"all_reduce": 2 * L + 1 + (loss != "none")}
    # the final norm's input gradient gathered; its weight's and the head's partial
    # gradients, one bucket
    assert bwd == {"all_reduce": 2 * L + 1, "all_gather": 1}
