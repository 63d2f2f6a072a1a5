"""Parallel styles written by other projects (subclasses of torch's ``ParallelStyle`` that
act through ``distribute_module``, as torchtitan's ``NoParallel`` and grouped-experts
``TensorParallel`` do) are read from what they do to a meta copy of the module: the
placements of its parameters and the layouts its hooks declare and redistribute to. A
style that computes, reorders a parameter or communicates on its own is refused, naming
the module."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single
from torch.distributed.tensor import (DTensor, Partial, Replicate, Shard, distribute_module,
                                      distribute_tensor)
from torch.distributed.tensor.parallel import ParallelStyle

import fxtp
from fxtp.plans.resolution import resolve_plan
from tests.helpers.parity import check_parity, example

DTYPES = pytest.mark.parametrize("dtype", [torch.float64, torch.float32],
                                 ids=["fp64", "fp32"])
B, T, D, H, E, TOP_K, L = 2, 8, 16, 32, 4, 2, 2


class ReplicatedCompute(ParallelStyle):
    """torchtitan's ``NoParallel``, as projects copy it: the module's parameters replicated
    DTensors, its input declared ``input_layout`` and redistributed to Replicate, its
    output redistributed to ``output_layout``."""

    def __init__(self, *, input_layout=None, output_layout=None, use_local_output=True):
        super().__init__()
        self.input_layout = input_layout or Replicate()
        self.output_layout = output_layout or Replicate()
        self.use_local_output = use_local_output

    def _prepare_input(self, module, inputs, mesh):
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (self.input_layout,), run_check=False)
        if x.placements != (Replicate(),):
            x = x.redistribute(placements=(Replicate(),))
        return (x, *inputs[1:])

    def _prepare_output(self, module, outputs, mesh):
        if outputs.placements != (self.output_layout,):
            outputs = outputs.redistribute(placements=(self.output_layout,))
        return outputs.to_local() if self.use_local_output else outputs

    def _apply(self, module, mesh):
        return distribute_module(module, mesh, None, self._prepare_input,
                                 self._prepare_output)


class ExpertsTensorParallel(ParallelStyle):
    """torchtitan's grouped-experts ``TensorParallel``: every expert's input projections
    split on the hidden dim and its output projection on its input dim; the routed input is
    declared replicated (its gradient a partial sum). It has no output hook: the experts'
    partial sums are reduced where the plan's enclosing MoE module says."""

    def _partition(self, name, module, mesh):
        for param, dim in (("w1", 1), ("w2", 2), ("w3", 1)):
            module.register_parameter(param, nn.Parameter(
                distribute_tensor(getattr(module, param), mesh, [Shard(dim)])))

    def _prepare_input(self, module, inputs, mesh):
        routed, counts = inputs
        routed = DTensor.from_local(routed, mesh, (Replicate(),)).to_local(
            grad_placements=(Partial(),))
        return routed, counts

    def _apply(self, module, mesh):
        return distribute_module(module, mesh, self._partition, self._prepare_input)


class GroupedExperts(nn.Module):
    """Experts stacked in 3-D parameters, as torchtitan's MoE holds them; every token goes
    through every expert, weighted by its routing probability (dense, for exact parity)."""

    def __init__(self):
        super().__init__()
        self.w1, self.w3 = (nn.Parameter(torch.randn(E, H, D) / D ** 0.5) for _ in range(2))
        self.w2 = nn.Parameter(torch.randn(E, D, H) / H ** 0.5)

    def forward(self, x, probs):
        # torchtitan's experts compute on their local shards under DTensor TP
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w
                      for w in (self.w1, self.w2, self.w3))
        h = F.silu(torch.einsum("btd,ehd->bteh", x, w1)) * torch.einsum("btd,ehd->bteh", x, w3)
        return torch.einsum("bteh,edh->bted", h, w2).mul(probs.unsqueeze(-1)).sum(2)


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.experts = GroupedExperts()

    def forward(self, x):
        return x + self.experts(x, torch.softmax(self.router(x), dim=-1))


TORCHTITAN_MOE_PLAN = {"router": ReplicatedCompute(), "experts": ExpertsTensorParallel()}


def moe_parity(rank, world, dtype):
    return check_parity(rank, world, MoE, TORCHTITAN_MOE_PLAN, [example(B, T, D)],
                        dtype=dtype, strict=True)


@DTYPES
def test_torchtitans_moe_styles_are_read_and_match_single_device(ranks, dtype):
    fwd, bwd = ranks.run(moe_parity, dtype)[0]
    assert fwd == {"all_reduce": 1}  # the experts' partial sums
    # the gradients of the routed input and of the routing probabilities: each is a sum of
    # the experts' hidden slices, partial on every rank
    assert bwd == {"all_reduce": 2}


class TokenChoiceRouter(nn.Module):
    """torchtitan's top-k token-choice router: sigmoid scores, top k experts per token,
    and how many tokens each expert gets."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)

    def forward(self, x):
        scores = torch.sigmoid(self.gate(x))
        top_scores, experts = torch.topk(scores, k=TOP_K, dim=1)
        counts = torch.histc(experts.view(-1).float(), bins=E, min=0, max=E)
        return top_scores, experts, counts


class GroupedMatmulExperts(GroupedExperts):
    """torchtitan's ``GroupedExperts``: the routed tokens, sorted by expert, through
    ``torch._grouped_mm`` with offsets from the counts."""

    def forward(self, x, counts):
        offsets = torch.cumsum(counts, dim=0).to(torch.int32)
        h = F.silu(torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=offsets))
        h = h * torch._grouped_mm(x, self.w3.transpose(-2, -1), offs=offsets)
        return torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offsets)


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(D, H, bias=False), nn.Linear(D, H, bias=False)
        self.w2 = nn.Linear(H, D, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TokenChoiceMoE(nn.Module):
    """torchtitan's MoE layer: tokens sorted by their experts, gathered, through the grouped
    experts, and scattered back onto the shared expert's output; scaled by their scores
    before the experts or after (torchtitan's ``score_before_experts``)."""

    def __init__(self, score_before_experts: bool):
        super().__init__()
        self.router, self.experts = TokenChoiceRouter(), GroupedMatmulExperts()
        self.shared_experts = FeedForward()
        self.score_before_experts = score_before_experts

    def forward(self, x):
        batch, seq, dim = x.shape
        x = x.view(-1, dim)
        top_scores, experts, counts = self.router(x)
        order = torch.argsort(experts.view(-1), stable=True)
        token = order // TOP_K
        scores = top_scores.view(-1)[order].reshape(-1, 1)
        if self.score_before_experts:
            routed = self.experts(x[token] * scores, counts)
        else:
            routed = self.experts(x[token], counts) * scores
        out = self.shared_experts(x)
        out = out.scatter_add(0, token.reshape(-1, 1).expand(-1, dim), routed)
        return out.view(batch, seq, dim)


class MoEBlock(nn.Module):
    def __init__(self, score_before_experts: bool):
        super().__init__()
        self.moe_norm, self.moe = nn.RMSNorm(D), TokenChoiceMoE(score_before_experts)

    def forward(self, x):
        return x + self.moe(self.moe_norm(x))


class MoEStack(nn.Module):
    def __init__(self, score_before_experts: bool):
        super().__init__()
        self.layers = nn.ModuleList(MoEBlock(score_before_experts) for _ in range(L))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def torchtitan_moe_plan(sequence_parallel: bool):
    """torchtitan's TP plan for its MoE layers (``apply_moe_ep_tp`` without expert
    parallelism), in torch's and torchtitan's own styles."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInputOutput,
                                                   RowwiseParallel, SequenceParallel)
    activations = Shard(1) if sequence_parallel else Replicate()
    plan = {"layers.*.moe": PrepareModuleInputOutput(
                input_layouts=(activations,), desired_input_layouts=(Replicate(),),
                use_local_input=True, output_layouts=(Partial(),),
                desired_output_layouts=(activations,)),
            "layers.*.moe.router.gate": ReplicatedCompute(),
            "layers.*.moe.shared_experts.w1": ColwiseParallel(),
            "layers.*.moe.shared_experts.w3": ColwiseParallel(),
            "layers.*.moe.shared_experts.w2": RowwiseParallel(output_layouts=Partial()),
            "layers.*.moe.experts": ExpertsTensorParallel()}
    if sequence_parallel:
        plan["layers.*.moe_norm"] = SequenceParallel()
    return plan


def token_choice_parity(rank, world, sequence_parallel, score_before_experts):
    return check_parity(rank, world, lambda: MoEStack(score_before_experts),
                        torchtitan_moe_plan(sequence_parallel), [example(B, T, D)],
                        dtype=torch.bfloat16,  # torch._grouped_mm's only dtype on CPU
                        strict=True)  # strict: no fallback


@pytest.mark.parametrize("score_before_experts", [True, False], ids=["score_first",
                                                                     "score_last"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_torchtitans_token_choice_moe_under_its_own_plan(ranks, sequence_parallel,
                                                         score_before_experts):
    """Sorting, gathering and scattering the routed tokens, grouped matmuls, and the plan's
    own styles: single device's numbers. Per layer, forward: the MoE's output reduced once
    (the routed and the shared experts' partial sums scattered together). Backward: where
    the experts read the gathered tokens themselves, their partial gradient is summed on
    the MoE's input with the shared experts' (one reduction; DTensor's TP reduces each
    apart), and the scores' gradient (partial: the experts' output is) once; where they
    read the tokens scaled by their scores, the product's gradient is reduced on its own,
    as in DTensor, and the shared experts' input gradient too. With SP, each block's norm
    weight as well (bucketed), and the replicated input's gradient is gathered from its
    sequence shards."""
    fwd, bwd = ranks.run(token_choice_parity, sequence_parallel, score_before_experts)[0]
    if not sequence_parallel:
        assert (fwd, bwd) == ({"all_reduce": L}, {"all_reduce": 2 * L})
    else:
        assert (fwd, bwd) == ({"all_gather": L, "reduce_scatter": L},
                              {"all_gather": L + 1, "all_reduce": 3 * L})


def test_a_replicated_compute_style_reads_as_its_layouts(fake_group):
    """Declared Shard(1) and redistributed to Replicate on entry; the output (replicated, as
    the input it was computed from) redistributed to Shard(1) on exit."""
    fake_group(4)
    style = ReplicatedCompute(input_layout=Shard(1), output_layout=Shard(1))
    sharding = resolve_plan(MoE(), {"router": style}, mesh_of=_mesh)["router"]
    assert sharding.params == {"weight": Replicate()}
    assert sharding.input_layouts == (Shard(1),)
    assert sharding.desired_inputs == (Replicate(),)
    assert sharding.desired_outputs == (Shard(1),)
    assert "ReplicatedCompute" in repr(sharding.style)


def test_a_layout_only_declared_moves_nothing(fake_group):
    """torchtitan's NoParallel as planned for Qwen3's q/k norms: it declares the (head-
    sharded) input Replicate and redistributes nothing, so DTensor computes on the local
    heads; fxtp keeps the placement it knows instead of gathering the heads."""
    fake_group(4)
    sharding = resolve_plan(MoE(), {"router": ReplicatedCompute()}, mesh_of=_mesh)["router"]
    assert sharding.input_layouts == (Replicate(),)
    assert sharding.desired_inputs == (None,)
    assert sharding.desired_outputs == (None,)


def test_a_distribute_module_colwise_reads_as_fxtps_colwise(fake_group):
    """The DTensor tutorial's hand-written colwise style splits the parameters as fxtp's
    ColwiseParallel(output_layouts=Replicate()) does and gathers the output; its input, only
    declared Replicate, keeps the placement it arrives with."""
    fake_group(4)

    class TutorialColwise(ParallelStyle):
        def _apply(self, module, mesh):
            def partition(name, m, mesh):
                for n, p in list(m.named_parameters(recurse=False)):
                    m.register_parameter(n, nn.Parameter(distribute_tensor(p, mesh,
                                                                           [Shard(0)])))

            def inputs(m, args, mesh):  # by keyword, as some projects write it
                return (DTensor.from_local(local_tensor=args[0], device_mesh=mesh,
                                           placements=(Replicate(),)),)

            def outputs(m, out, mesh):
                return out.redistribute(placements=(Replicate(),)).to_local()
            return distribute_module(module, mesh, partition, inputs, outputs)

    model = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D))
    read = resolve_plan(model, {"0": TutorialColwise()}, mesh_of=_mesh)["0"]
    ours = resolve_plan(model, {"0": fxtp.ColwiseParallel(output_layouts=Replicate())})["0"]
    assert (read.params, read.input_layouts, read.desired_outputs) == \
        (ours.params, ours.input_layouts, ours.desired_outputs)
    assert read.desired_inputs == (None,)


def test_a_style_handing_on_a_dtensor_at_the_end_makes_the_result_return_one(fake_group):
    """NoParallel(use_local_output=False) on the model's last module: its output comes back
    as torch's style hands it on, a replicated DTensor holding what the model computes."""
    fake_group(2)
    model = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D))
    x = torch.randn(B, D)
    gathered = fxtp.ColwiseParallel(output_layouts=Replicate())
    gm = fxtp.parallelize(model, {"0": gathered, "2": ReplicatedCompute(use_local_output=False)},
                          example_inputs=(x,), strict=True)
    out = gm(x)
    assert isinstance(out, DTensor) and out.placements == (Replicate(),)
    assert gm.fxtp.dtensor_outputs == (0,)
    local = fxtp.parallelize(model, {"0": gathered, "2": ReplicatedCompute()},
                             example_inputs=(x,), strict=True)(x)
    assert type(local) is torch.Tensor and local.shape == out.shape


def _mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    return DeviceMesh.from_group(dist.group.WORLD, "cpu")


class Masking(ReplicatedCompute):
    """A hook that computes on the input (as a vocab-parallel embedding's mask does)."""

    def _prepare_input(self, module, inputs, mesh):
        return (inputs[0] * 2,)


class Transposing(ParallelStyle):
    """A partition function that transposes a square weight before splitting it."""

    def _apply(self, module, mesh):
        def partition(name, m, mesh):
            if isinstance(m, nn.Linear):
                m.weight = nn.Parameter(distribute_tensor(m.weight.detach().t(), mesh, [Shard(0)]))
        return distribute_module(module, mesh, partition)


class AllToAll(ReplicatedCompute):
    """Expert parallelism's token exchange: a collective outside any redistribution."""

    def _prepare_input(self, module, inputs, mesh):
        return (all_to_all_single(inputs[0], None, None, mesh.get_group()),)


@pytest.mark.parametrize("style, says", [
    (Masking(), "its input hook runs aten.mul"),
    (Transposing(), "its partition function runs aten.t"),
    (AllToAll(), "its input hook runs _c10d_functional.all_to_all_single"),
], ids=["computes", "reorders", "communicates"])
def test_a_style_that_does_more_than_lay_out_is_refused_naming_the_module(fake_group, style,
                                                                          says):
    fake_group(4)
    model = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D))
    with pytest.raises(fxtp.PlanError, match=rf"on module '0' \(Linear\): {says}"):
        fxtp.parallelize(model, {"0": style}, example_inputs=(torch.randn(B, D),))


def qwen3_with_norms_planned(rank, world, style):
    from torch.distributed.tensor.parallel import SequenceParallel
    from tests.helpers import corpus
    norms = {"NoParallel": ReplicatedCompute(use_local_output=True),
             "SequenceParallel": SequenceParallel(sequence_dim=2)}[style]
    plan = {**corpus.hf_tp_plan(), "model.layers.*.self_attn.[qk]_norm": norms}
    return check_parity(rank, world, corpus.hf_qwen3, plan, [corpus.TOKENS],
                        dtype=torch.float64, input_grads=False, kwargs={"use_cache": False},
                        output=lambda out: out.logits, strict=True)


@pytest.mark.parametrize("style", ["NoParallel", "SequenceParallel"])
def test_torchtitans_qk_norm_entries_cost_no_collective(ranks2, style):
    """torchtitan plans Qwen3's per-head q/k norms ``NoParallel`` (older releases, and the
    libraries that copy them) or ``SequenceParallel(sequence_dim=2)`` (the head dim of
    (batch, seq, heads, head_dim)). Their inputs are head-sharded by the colwise q/k
    projections: NoParallel declares them Replicate and moves nothing, SequenceParallel
    asks for the head shards they are. Either way the model keeps Megatron's collectives
    (as without the entries) and its numbers."""
    pytest.importorskip("transformers")
    from tests.helpers.corpus import L
    from tests.helpers.corpus import tp_counts
    # Megatron's, and per layer one all-reduce (bucketed) of the q and k norm weights'
    # gradients, which each rank sums over its own heads
    assert ranks2.run(qwen3_with_norms_planned, style)[0] == tp_counts(bwd_all_reduce=3 * L + 1)
