"""The module tree survives parallelize: blocks are submodules at their FQNs that run their
part of the program and hold their own parameters, so hooks and ``checkpoint_wrapper``
apply per block as on the original model (shapes and equalities on a fake group)."""
import copy

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing, checkpoint_wrapper)

import fxtp
from fxtp.examples.llama import TransformerBlock
from fxtp.passes.modules import generate_code
from tests.helpers import transformer_models as tm

TOKENS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))


def parallel_llama():
    torch.manual_seed(0)
    model = tm.Llama(tm.LlamaConfig(n_layers=2))
    return model, fxtp.parallelize(model, tm.llama_sp_plan(), example_inputs=(TOKENS,))


def test_blocks_are_submodules_holding_their_own_parameters(fake_group):
    fake_group(2)
    model, gm = parallel_llama()
    assert isinstance(gm.layers, nn.ModuleList) and len(gm.layers) == 2
    block = gm.layers[1]
    assert isinstance(block, fx.GraphModule) and type(block).__name__ == \
        type(model.layers[1]).__name__
    assert [n for n, _ in block.named_parameters()] == \
        [n for n, _ in model.layers[1].named_parameters()]
    assert list(gm.state_dict()) == list(model.state_dict())
    assert isinstance(gm.layers[0].attention.wq, fx.GraphModule)  # planned: its own module
    assert gm.fxtp.inlined == ()


def test_forward_hooks_on_a_block_see_its_sequence_shard(fake_group):
    fake_group(2)
    _, gm = parallel_llama()
    seen = []
    gm.layers[0].register_forward_hook(lambda m, args, out: seen.append(
        (tuple(args[0].shape), tuple(out.shape))))
    gm(TOKENS)
    assert seen == [((2, 8, 32), (2, 8, 32))]  # (B, T / world, D): sequence parallel


def test_checkpoint_wrapper_per_block_computes_the_same(fake_group):
    """``apply_activation_checkpointing`` picking the blocks by class, as torchtune and
    FSDP's tutorials write it: outputs and gradients as without it."""
    fake_group(2)
    _, plain = parallel_llama()
    _, wrapped = parallel_llama()
    apply_activation_checkpointing(
        wrapped, checkpoint_wrapper_fn=checkpoint_wrapper,
        check_fn=lambda m: isinstance(m, TransformerBlock))
    assert [type(m).__name__ for m in wrapped.layers] == ["CheckpointWrapper"] * 2
    outs = [m(TOKENS) for m in (plain, wrapped)]
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    for out in outs:
        out.square().mean().backward()
    grads = [{n.replace("_checkpoint_wrapped_module.", ""): p.grad.to_local()
              for n, p in m.named_parameters()} for m in (plain, wrapped)]
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=0)


def test_outlined_modules_pass_isinstance_for_their_model_classes(fake_group):
    """Code that picks modules by class (wrap policies, ``check_fn`` s, init functions
    run by ``apply``) finds every outlined module as it finds the original, reading the
    original's plain attributes (global sizes, as under DTensor's TP) and absent
    tensors."""
    fake_group(2)
    model, gm = parallel_llama()
    outlined = [n for n, m in gm.named_modules() if n and isinstance(m, fx.GraphModule)]
    assert "layers.1" in outlined and "layers.1.attention.wq" in outlined
    for name in outlined:
        assert isinstance(gm.get_submodule(name), type(model.get_submodule(name))), name
    wq = gm.layers[1].attention.wq
    assert (wq.in_features, wq.out_features, wq.bias) == (32, 32, None)
    assert wq.weight.shape == (32, 32) and wq.weight.to_local().shape == (16, 32)


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.scale = 2.0

    def forward(self, x):
        return self.proj(x) * self.scale

    def describe(self):
        return "the original's method"

    @property
    def width(self):
        return self.proj.in_features

    def extra_repr(self):
        return f"scale={self.scale}"

    def __init_subclass__(cls, **kwargs):  # as Hugging Face's layers wrap their forward
        raise AssertionError(f"{cls} subclasses Scaled")


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.scaled = Scaled()
        self.seq = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.seq(self.scaled(x)))


def test_a_posing_module_runs_none_of_its_classes_code(fake_group):
    """The original's methods, properties and ``__init_subclass__`` never run on the
    module standing for it (they would read state it does not have); a class whose
    protocol a graph module cannot unset (``nn.Sequential``'s ``__len__``) is not posed
    as, and a module left in its parent's graph only holds its tensors (a plain
    ``nn.Module``, never called). FSDP2's per-instance subclass and a deep copy keep the
    pose."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    fake_group(4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = torch.randn(2, 8)
    gm = fxtp.parallelize(Stack(), {"scaled.proj": fxtp.ColwiseParallel(
        output_layouts=fxtp.Replicate())}, mesh["tp"], example_inputs=(x,), modules=["seq"])
    scaled = gm.scaled
    assert isinstance(scaled, Scaled) and scaled.scale == 2.0
    assert not hasattr(scaled, "describe") and not hasattr(scaled, "width")
    assert "scale=" not in repr(gm)
    assert isinstance(gm.seq, fx.GraphModule) and not isinstance(gm.seq, nn.Sequential)
    assert bool(gm.seq)
    assert type(gm.norm) is nn.Module and not isinstance(gm.norm, nn.LayerNorm)
    assert isinstance(copy.deepcopy(gm).scaled, Scaled)
    fully_shard(scaled, mesh=mesh["dp"])
    assert isinstance(scaled, Scaled) and type(scaled).__name__ == "FSDPScaled"
    assert gm(x).shape == (2, 8)


def test_the_models_data_attributes_come_along_as_copies(fake_group):
    """``gm.config`` reads as ``model.config`` does (global sizes, as under DTensor's TP),
    in a copy: setting it leaves the user's model as it was; one copy for every module that
    shares the config, and ``copy.deepcopy(gm)`` carries its own. An attribute holding a
    tensor is not handed out (its full tensor is not this rank's data)."""
    fake_group(2)
    torch.manual_seed(0)
    model = tm.Llama(tm.LlamaConfig(n_layers=2))
    model.name = "tiny"
    model.head_config = model.config  # shared, as each of a Hugging Face model's layers do
    model.masks = {"causal": torch.ones(2, 2)}
    gm = fxtp.parallelize(model, tm.llama_sp_plan(), example_inputs=(TOKENS,))
    assert gm.config == model.config and gm.config is not model.config
    assert gm.head_config is gm.config and gm.name == "tiny"
    assert not hasattr(gm, "masks")
    gm.config.dim = 1
    assert model.config.dim == 32 and model.head_config is model.config
    copied = copy.deepcopy(gm)
    assert copied.config.dim == 1 and copied.config is not gm.config
    assert copied.head_config is copied.config


class WithDevice(tm.Llama):
    """A model whose class reads its device and dtype from its parameters, as Hugging
    Face's do (``inputs.to(model.device)``)."""

    @property
    def device(self):
        return next(self.parameters()).device

    @property
    def dtype(self):
        return next(self.parameters()).dtype


def test_device_and_dtype_properties_read_the_results_own_parameters(fake_group):
    """The class's own code does not run on the result; where it defines ``device`` and
    ``dtype``, the result reads them from its own parameters (so they follow a move)."""
    fake_group(2)
    torch.manual_seed(0)
    model = WithDevice(tm.LlamaConfig(n_layers=2)).double()
    gm = fxtp.parallelize(model, tm.llama_sp_plan(), example_inputs=(TOKENS,))
    for module in (gm, copy.deepcopy(gm)):
        assert module.device == torch.device("cpu") and module.dtype == torch.float64
    assert not hasattr(gm.layers[0], "device")  # its class defines no such property


def test_the_programs_generated_code_runs_in_one_globals_dict(fake_group):
    """dynamo guards the globals each distinct globals dict lends a compiled call apart:
    every module of the program reads them from one, as a model's code reads its module's."""
    fake_group(2)
    _, gm = parallel_llama()
    forwards = [type(m).forward for m in gm.modules() if isinstance(m, fx.GraphModule)]
    assert len(forwards) > 10
    assert len({id(f.__globals__) for f in forwards}) == 1


def _scaling_by(k):
    def scale(x):  # every function made here has the same qualified name
        return x * k
    return scale


def _calling(fn, children=None):
    graph = fx.Graph()
    y = graph.call_function(fn, (graph.placeholder("x"),))
    root = nn.Module()
    for name, child in (children or {}).items():
        root.add_module(name, child)
        y = graph.call_module(name, (y,))
    graph.output(y)
    return fx.GraphModule(root, graph)


def test_code_naming_another_object_as_the_others_do_keeps_its_own_globals():
    twice, thrice, neg = _calling(_scaling_by(2.0)), _calling(_scaling_by(3.0)), \
        _calling(torch.neg)
    gm = _calling(torch.relu, {"twice": twice, "thrice": thrice, "neg": neg})
    generate_code(gm, None)
    assert type(gm).forward.__globals__ is type(twice).forward.__globals__ is \
        type(neg).forward.__globals__
    assert type(thrice).forward.__globals__ is not type(twice).forward.__globals__
    assert gm(torch.ones(2)).tolist() == [-6.0, -6.0]
