"""Bad input: one test each, naming what the error must say (the FQN, op, input or rank
involved, and the fix)."""
import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.export import Dim

import fxtp
from tests.helpers import models

B, D = 2, models.DIM


def test_parallelize_without_a_process_group_says_how_to_start_one():
    with pytest.raises(fxtp.PlanError, match="init_process_group"):
        fxtp.parallelize(models.MLP(), models.MLP_PLAN, example_inputs=(torch.randn(2, 16),))


def test_parallelize_without_example_inputs_says_what_to_pass(fake_group):
    fake_group(2)
    with pytest.raises(fxtp.InputError, match=r"parallelize\(MLP\) traces the model on "
                                              r"example inputs: pass example_inputs="):
        fxtp.parallelize(models.MLP(), models.MLP_PLAN)


def test_inputs_by_keyword_alone_are_enough(fake_group):
    """A Hugging Face model is called by keyword: ``example_kwargs`` alone traces it."""
    fake_group(2)
    x = torch.randn(B, D)
    gm = fxtp.parallelize(models.MLP(), models.MLP_PLAN, example_kwargs={"x": x})
    assert gm(x=x).shape == (B, D)


def test_a_2d_mesh_is_rejected_with_the_slice_to_pass(fake_group):
    fake_group(4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(fxtp.PlanError, match=r'2-D DeviceMesh.*mesh\["tp"\]'):
        fxtp.parallelize(models.MLP(), models.MLP_PLAN, mesh,
                         example_inputs=(torch.randn(B, models.DIM),))


def test_a_sharded_dim_smaller_than_the_world_size_is_a_clear_error(fake_group):
    """Sizes that do not divide by the world size are dealt unevenly
    (``tests/passes/test_uneven.py``); fewer elements than ranks cannot be."""
    fake_group(4)
    with pytest.raises(fxtp.PlanError, match=r"parameter 'net1\.weight' \(ColwiseParallel\) "
                                             r"is sharded on dim 0 of size 2, which is smaller "
                                             r"than the world size 4; choose sizes"):
        fxtp.parallelize(models.MLP(dim=4, hidden=2), models.MLP_PLAN,
                         example_inputs=(torch.randn(2, 4),))


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(D, D)

    def forward(self, x):
        if x.sum() > 0:  # a Python branch on a tensor's value
            return self.net1(x)
        return x


def trace_error(model, plan, match):
    with pytest.raises(fxtp.TraceError, match=match):
        fxtp.parallelize(model, plan, example_inputs=(torch.randn(B, D),))


def test_a_model_that_cannot_be_traced_gives_the_trace_error_and_a_hint(fake_group):
    fake_group(2)
    trace_error(DataDependent(), {"net1": fxtp.ColwiseParallel()},
                r"(?s)could not trace DataDependent.*data-dependent.*Hint:.*torch\.where")


def test_a_model_already_divided_for_dtensor_names_the_module_and_global_sizes(fake_group):
    """A recipe written for DTensor divides head counts by the TP degree before
    ``parallelize_module`` (torchtune's ``prepare_mha_for_tp``); fxtp traces the model on
    one device, where those views fail: the error names the innermost module running
    and says to pass the model as built."""
    from fxtp.examples.llama import Llama, LlamaConfig, llama_tp_plan
    fake_group(2)
    model = Llama(LlamaConfig(n_layers=2))
    for block in model.layers:
        block.attention.n_heads //= 2
        block.attention.n_kv_heads //= 2
    with pytest.raises(fxtp.TraceError, match=r"(?s)in module 'layers\.0\.attention' "
                       r"\(LlamaAttention\).*Hint:.*global sizes.*prepare_mha_for_tp"):
        fxtp.parallelize(model, llama_tp_plan(), example_inputs=(
            torch.randint(0, 64, (2, 16)),))


class AssertsOnAValue(nn.Module):
    """Asserts on a tensor's value, as torchtune's ``KVCache.update`` does."""

    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(D, D)

    def forward(self, x):
        assert (x.abs().max() + 1) < 100
        return self.net1(x)


def test_an_assert_on_a_tensors_value_is_named_with_what_to_do(fake_group):
    fake_group(2)
    trace_error(AssertsOnAValue(), {"net1": fxtp.ColwiseParallel()},
                r"(?s)Hint: an assert on a tensor's value \(assert \(x\.abs\(\)\.max\(\) \+ 1\)"
                r" < 100, \S+test_bad_input\.py:\d+\).*torch\._check")


def test_dynamic_shapes_not_matching_the_inputs_say_how_they_must_be_written(fake_group):
    fake_group(2)
    with pytest.raises(fxtp.TraceError, match=r"(?s)Hint: dynamic_shapes must follow "
                       r"example_inputs and example_kwargs.*by forward's argument names"):
        fxtp.parallelize(models.MLP(), models.MLP_PLAN, example_inputs=(torch.randn(B, D),),
                         dynamic_shapes=({0: Dim("b")}, None))


class ClipsInForward(nn.Module):
    """Clips its weight through ``.data`` while training, as Gemma-3n's AltUp does."""

    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(D, D)

    def forward(self, x):
        if self.training:
            self.net1.weight.data.clamp_(-1, 1)
        return self.net1(x)


class ExpertLoop(nn.Module):
    """Loops over the experts its tokens are routed to, as many mixtures of experts do."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, 4)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(4))

    def forward(self, x):
        chosen = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for expert in torch.nonzero(torch.bincount(chosen, minlength=4)):
            out = out + self.experts[expert](x) * (chosen == expert).unsqueeze(-1)
        return out


def test_a_write_through_data_in_forward_is_named_with_what_to_do(fake_group):
    fake_group(2)
    trace_error(ClipsInForward(), {"net1": fxtp.ColwiseParallel()},
                r"(?s)Hint: module '<root>' changes a tensor in place through its \.data in "
                r"forward.*after optimizer\.step\(\)")


def test_a_loop_over_routed_experts_is_named_with_what_to_do(fake_group):
    fake_group(2)
    trace_error(ExpertLoop(), {"experts.*": fxtp.ColwiseParallel()},
                r"(?s)Hint: data-dependent.*looping over the experts.*"
                r"set_experts_implementation")


class LayerDrop(nn.Module):
    """Skips each layer with probability ``layerdrop`` while training, as Hugging Face's
    audio encoders do (Wav2Vec2's default is 0.1)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        self.layerdrop = 0.1

    def forward(self, x):
        for layer in self.layers:
            if self.training and self.layerdrop > 0 and torch.rand([]) < self.layerdrop:
                continue
            x = layer(x)
        return x


def test_layer_drop_is_named_with_what_to_do(fake_group):
    fake_group(2)
    trace_error(LayerDrop(), {"layers.*": fxtp.ColwiseParallel()},
                r"(?s)Hint: the model skips layers at random while training "
                r"\(LayerDrop: layerdrop = 0\.1\).*Set it to 0\.0 before parallelize")
    configured = LayerDrop()
    configured.config = {"layerdrop": 0.1}  # a config held as a dict is no object to read
    trace_error(configured, {"layers.*": fxtp.ColwiseParallel()}, r"LayerDrop: layerdrop = 0\.1")
    model = LayerDrop()
    model.layerdrop = 0.0  # as the hint says
    fxtp.parallelize(model, {"layers.*": fxtp.ColwiseParallel()},
                     example_inputs=(torch.randn(B, D),))


def test_inputs_of_another_shape_than_traced_name_the_input_and_dynamic_shapes(fake_group):
    fake_group(2)
    gm = fxtp.parallelize(models.MLP(), models.MLP_PLAN, example_inputs=(torch.randn(B, D),))
    with pytest.raises(fxtp.InputError, match=r"input 'x' has shape \(3, 16\); the graph was "
                                              r"traced for \(2, 16\).*dynamic_shapes"):
        gm(torch.randn(3, D))
    dynamic = fxtp.parallelize(models.MLP(), models.MLP_PLAN, example_inputs=(torch.randn(B, D),),
                               dynamic_shapes={"x": {0: Dim("batch")}})
    with pytest.raises(fxtp.InputError, match=r"shape \(3, 8\).*traced for \(\*, 16\)"):
        dynamic(torch.randn(3, 8))


def test_a_cast_to_another_dtype_than_traced_is_refused_before_it_changes_anything(
        fake_group):
    fake_group(2)
    gm = fxtp.parallelize(models.MLP(), models.MLP_PLAN, example_inputs=(torch.randn(B, D),))
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(),
                 lambda m: copy.deepcopy(m).double()):
        with pytest.raises(fxtp.InputError, match=r"traced this module's program for "
                                                  r"torch.float32 .*param_dtype="):
            cast(gm)
    assert {p.dtype for p in gm.parameters()} == {torch.float32}
    gm.to("cpu").float()  # no change of dtype: fine
    mixed = fxtp.parallelize(models.MLP(), models.MLP_PLAN, example_inputs=(torch.randn(B, D),),
                             param_dtype=torch.bfloat16)
    mixed.to(torch.bfloat16)  # what it was traced for
    assert {p.dtype for p in mixed.parameters()} == {torch.bfloat16}


def test_a_sharded_root_input_must_be_this_ranks_shard(fake_group):
    fake_group(2)
    plan = {"": fxtp.PrepareModuleInput(input_layouts=fxtp.Shard(1),
                                        desired_input_layouts=fxtp.Replicate()),
            **models.MLP_PLAN}
    gm = fxtp.parallelize(models.MLP(), plan, example_inputs=(torch.randn(B, 8, D),))
    with pytest.raises(fxtp.InputError, match=r"shape \(2, 8, 16\); the graph was traced for "
                                              r"\(2, 4, 16\) \(this rank's S\(1\) shard of "
                                              r"\(2, 8, 16\)"):
        gm(torch.randn(B, 8, D))  # the full input instead of the shard


class BranchOnLength(nn.Module):
    """Computes one way for sequences longer than 4 and another for shorter ones."""

    def __init__(self):
        super().__init__()
        self.mlp = models.MLP()

    def forward(self, x):
        y = self.mlp(x)
        return y * 2 if x.shape[1] > 4 else y * 3


@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "sequence-sharded"])
def test_sizes_that_break_what_the_trace_assumed_are_an_error(fake_group, sharded):
    """With a dim declared ``Dim.DYNAMIC``, export takes the model's branch on its size and
    guards it (``x.size()[1] >= 5``) instead of failing; the program only computes that
    branch, so a call with a shorter sequence is an error, not the other branch's numbers
    silently wrong. A sequence-sharded root input is judged by its global length."""
    fake_group(2)
    plan = {"mlp.net1": fxtp.ColwiseParallel(), "mlp.net2": fxtp.RowwiseParallel()}
    if sharded:
        plan[""] = fxtp.PrepareModuleInput(input_layouts=fxtp.Shard(1),
                                           desired_input_layouts=fxtp.Replicate())
    gm = fxtp.parallelize(BranchOnLength(), plan, example_inputs=(torch.randn(B, 8, D),),
                          dynamic_shapes=({1: Dim.DYNAMIC},))
    shard = 2 if sharded else 1
    assert gm(torch.randn(B, 6 // shard, D)).shape[1] == 6  # all-gathered, when sharded
    with pytest.raises(fxtp.InputError, match=r"break what tracing found the model's program "
                                              r"to assume of their sizes \(x\.size\(\)\[1\] "
                                              r">= 5; a branch"):
        gm(torch.randn(B, 4 // shard, D))


class SwappingCache(nn.Module):
    """litgpt's ``KVCache``: forward moves the cache to the activations' dtype by giving
    the buffer a new tensor (a no-op when the dtypes agree), then writes into it."""

    def __init__(self, dtype):
        super().__init__()
        self.mlp = models.MLP().double()
        self.register_buffer("k", torch.zeros(B, 8, D, dtype=dtype))

    def forward(self, x):
        self.k = self.k.to(x.dtype)
        self.k[:, :x.shape[1]] = x
        return self.mlp(self.k)


def test_a_buffer_given_a_new_tensor_in_forward_is_named_with_what_to_do(fake_group):
    """The traced program would keep reading the buffer it holds: the next call would not
    see what this one wrote. Created in the dtype forward computes in, it is written in
    place and the model parallelizes."""
    fake_group(2)
    plan = {"mlp.net1": fxtp.ColwiseParallel(), "mlp.net2": fxtp.RowwiseParallel()}
    x = torch.randn(B, 8, D, dtype=torch.float64)
    with pytest.raises(fxtp.TraceError, match=r"module '' \(SwappingCache\) gives its buffer "
                                              r"'k' a new tensor in forward.*Write into the "
                                              r"buffer in place"):
        fxtp.parallelize(SwappingCache(torch.float32), plan, example_inputs=(x,))
    model = SwappingCache(torch.float64)
    gm = fxtp.parallelize(model, plan, example_inputs=(x,))
    assert gm(x).shape == (B, 8, D) and model.k.dtype == torch.float64


class Counting(nn.Module):
    """Keeps a step count in a plain attribute that forward reads and advances."""

    def __init__(self):
        super().__init__()
        self.mlp, self.step = models.MLP(), 0

    def forward(self, x):
        self.step += 1
        return self.mlp(x) * self.step


def test_an_attribute_forward_changes_is_named_in_a_warning(fake_group):
    """The program computes with the value traced (``step == 1``) on every call; a later
    call reading it would not see the change, which the warning says."""
    fake_group(2)
    plan = {"mlp.net1": fxtp.ColwiseParallel(), "mlp.net2": fxtp.RowwiseParallel()}
    model = Counting()
    with pytest.warns(UserWarning, match=r"module '' \(Counting\) sets its attribute 'step' "
                                         r"in forward \(0 -> 1\); fxtp's program computes "
                                         r"with the value it had when traced"):
        fxtp.parallelize(model, plan, example_inputs=(torch.randn(B, D),))
    assert model.step == 0  # the user's model as it was


def test_inputs_of_another_dtype_than_traced_are_an_error(fake_group):
    fake_group(2)
    gm = fxtp.parallelize(models.MLP().double(), models.MLP_PLAN,
                          example_inputs=(torch.randn(B, D, dtype=torch.float64),))
    with pytest.raises(fxtp.InputError, match=r"input 'x' has dtype torch\.float32; the graph "
                                              r"was traced for torch\.float64\. Cast it"):
        gm(torch.randn(B, D))


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(D, D)

    def forward(self, x, scale, mask=None):
        y = self.net1(x) * scale
        return y if mask is None else y * mask


def test_non_tensor_inputs_are_constants_of_the_graph(fake_group):
    """Export bakes a float argument into the graph: another value would be ignored."""
    fake_group(2)
    gm = fxtp.parallelize(Scaled(), {"net1": fxtp.ColwiseParallel()},
                          example_inputs=(torch.randn(B, D), 0.5), example_kwargs={"mask": None})
    assert gm(torch.randn(B, D), 0.5, mask=None).shape == (B, D // 2)
    with pytest.raises(fxtp.InputError, match=r"input 'scale' was traced as the constant 0\.5 "
                                              r".*got 0\.7\. Pass it as a tensor"):
        gm(torch.randn(B, D), 0.7, mask=None)
    with pytest.raises(fxtp.InputError, match=r"input 'x' must be a tensor.*got \[1\.0, 2\.0\]"):
        gm([1.0, 2.0], 0.5, mask=None)
    with pytest.raises(fxtp.InputError, match=r"input 'mask' was traced as the constant None"):
        gm(torch.randn(B, D), 0.5, mask=torch.ones(B, D // 2))


def test_arguments_the_trace_did_not_see_are_taken_at_their_default_and_else_named(
        fake_group):
    """Training loops pass a model's optional arguments by name, often at their defaults
    (``attention_mask=None``): those are the program traced and are taken; one given
    another value, or a traced one left out, is an error naming it and how to trace a
    program that takes it. ``copy.deepcopy(gm)`` checks alike."""
    fake_group(2)
    x = torch.randn(B, D)
    gm = fxtp.parallelize(Scaled(), {"net1": fxtp.ColwiseParallel()},
                          example_inputs=(x, 0.5))
    for module in (gm, copy.deepcopy(gm)):
        assert module(x, 0.5, mask=None).shape == module(x, scale=0.5).shape == (B, D // 2)
        with pytest.raises(fxtp.InputError, match=r"input 'mask' was not given when "
                                                  r"parallelize traced the model.*takes x, "
                                                  r"scale\); pass mask in parallelize's "
                                                  r"example_kwargs.*default \(None\)"):
            module(x, 0.5, mask=torch.ones(B, D // 2))
        with pytest.raises(fxtp.InputError, match=r"input 'scale' is missing.*pass "
                                                  r"scale=0\.5 as when traced"):
            module(x)


def test_parallelizing_a_parallelized_module_is_an_error(fake_group):
    fake_group(2)
    gm = fxtp.parallelize(models.MLP(), models.MLP_PLAN, example_inputs=(torch.randn(B, D),))
    with pytest.raises(fxtp.PlanError, match=r"already the result of fxtp\.parallelize \(it "
                                             r"holds rank 0's shards\).*original single-device"):
        fxtp.parallelize(gm, models.MLP_PLAN, example_inputs=(torch.randn(B, D),))


def parallelize_differently(rank, world, what):
    plan, x = dict(models.MLP_PLAN), torch.randn(B, D)
    if rank == 1 and what == "plan":
        plan["net2"] = fxtp.RowwiseParallel(output_layouts=fxtp.Shard(0))
    if rank == 1 and what == "inputs":
        x = torch.randn(B + 2, D)
    with pytest.raises(fxtp.PlanError) as error:
        fxtp.parallelize(models.MLP(), plan, example_inputs=(x,))
    return str(error.value)


@pytest.mark.parametrize("what, differs", [("plan", "the plan"),
                                           ("inputs", "the traced graph")])
def test_ranks_that_parallelize_differently_all_fail_instead_of_hanging(ranks, what, differs):
    messages = ranks.run(parallelize_differently, what)
    for message in messages:  # every rank raised, and says which ranks differ in what
        assert f"{differs} on ranks [1] differ from rank 0's" in message
        assert "Every rank must pass the same model" in message
    assert len(set(messages)) == 1
