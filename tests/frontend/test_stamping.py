"""Blocks traced once and stamped (:mod:`fxtp.frontend.stamping`): the program is the one tracing
every block gives (each module's code, collectives forward and backward, numerics), and
a block that differs in shape, plan or a value its forward reads gets its own trace."""
import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import fxtp
from benchmarks.passes_scale import FORMS, ArgsLlama
from fxtp.examples.llama import (FeedForward, Llama, LlamaConfig, TransformerBlock,
                                 llama_sp_plan, llama_tp_plan)
from fxtp.passes.graph import STAMPED
from tests.helpers.models import Layers
from tests.helpers.parity import check_parity
from tests.helpers.torch_versions import fake_collectives_move_values

LAYERS = 4
TOKENS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))


def llama():
    return Llama(LlamaConfig(n_layers=LAYERS, n_heads=8, n_kv_heads=8))


def llama_calling_blocks(form):
    """:func:`llama` whose root calls its blocks in calling ``form`` (a key of ``FORMS``)."""
    return lambda: ArgsLlama(LlamaConfig(n_layers=LAYERS, n_heads=8, n_kv_heads=8), form)


def llama_with_an_odd_middle_block():
    """Layer 2 has grouped-query attention (4 KV heads), the others do not: its k and v
    projections are half as wide."""
    model = llama()
    model.layers[2] = TransformerBlock(LlamaConfig(n_heads=8, n_kv_heads=4))
    return model


class ScaledBlock(TransformerBlock):
    """Reads ``self.layer_idx`` in forward: blocks equal in shape, not in program."""

    def __init__(self, cfg, layer_idx):
        super().__init__(cfg)
        self.layer_idx = layer_idx

    def forward(self, x, freqs):
        return super().forward(x, freqs) * (1.0 + 0.5 * self.layer_idx)


def llama_reading_layer_idx():
    model = llama()
    cfg = LlamaConfig(n_heads=8, n_kv_heads=8)
    model.layers = nn.ModuleList(ScaledBlock(cfg, i) for i in range(LAYERS))
    return model


class Stash(nn.Module):
    """A block keeping a value on ``self`` that its parent reads after the loop."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x):
        self.seen = x.sum(-1)
        return self.proj(x).relu()


class StashingStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Stash() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x + self.layers[1].seen.unsqueeze(-1)


class Projection(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x):
        return self.proj(x).relu()


class WeightReadingStack(nn.Module):
    """Casts each block's input to its projection's dtype, reading the weight outside the
    block's call (as PEFT's LoRA layers read their adapters' weights)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Projection() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x.to(layer.proj.weight.dtype))
        return x


class NormsAndActivations(nn.Module):
    """Blocks holding no tensors (activations) between norms."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.LayerNorm(32), nn.GELU(), nn.LayerNorm(32), nn.GELU()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class AutocastSecond(nn.Module):
    """The second block runs under autocast (bf16), the others in fp32: the same code,
    given the same arguments, traces differently."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Projection() for _ in range(4))

    def forward(self, x):
        x = self.layers[0](x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x = self.layers[1](x)
        for layer in self.layers[2:]:
            x = layer(x.float())
        return x


class SlottedScale(nn.Module):
    """Keeps its factor in a ``__slots__`` slot."""
    __slots__ = ("factor",)

    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


class SlottedBlock(Projection):
    def __init__(self, factor):
        super().__init__()
        self.scale = SlottedScale(factor)

    def forward(self, x):
        return self.scale(super().forward(x))


class SlottedStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(SlottedBlock(1.0 + i) for i in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class SlidingWindowBlock(nn.Module):
    """Builds its attention-like mask in forward, writing ``0.0`` into each row's window in
    a loop, as litgpt writes its sliding-window mask: export lifts every ``0.0`` as a
    constant of the block (``lifted_tensor_*``)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        t = x.shape[1]
        mask = torch.full((t, t), float("-inf"))
        for i in range(t):
            mask[i, max(0, i - 2):i + 1] = 0.0
        return x + self.down(self.up(x).relu()) * mask.exp().sum(-1, keepdim=True)


def sliding_window_stack():
    return Layers(SlidingWindowBlock, 3)


WINDOW_PLAN = {"layers.*.up": fxtp.ColwiseParallel(), "layers.*.down": fxtp.RowwiseParallel()}
WINDOW_INPUT = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))


def programs(gm: fx.GraphModule) -> dict[str, list[str]]:
    """Each graph module's program, nodes named by position (a copy's node names follow
    the nodes around it)."""
    def program(graph):
        names = {n: f"v{i}" for i, n in enumerate(graph.nodes)}
        return [f"{names[n]} = {n.op} {'' if n.op == 'placeholder' else n.target} "
                f"{fx.node.map_arg((n.args, n.kwargs), names.__getitem__)}"
                for n in graph.nodes]
    return {name: program(m.graph) for name, m in gm.named_modules()
            if isinstance(m, fx.GraphModule)}


def collectives(gm, inputs, kwargs=None):
    with fxtp.count_collectives() as fwd:
        out = gm(*inputs, **(kwargs or {}))
    out = out if isinstance(out, torch.Tensor) else out[0]  # a Hugging Face model's output
    with fxtp.count_collectives() as bwd:
        out.float().square().sum().backward()
    return dict(fwd.counts), dict(bwd.counts)


def stamped_and_traced(make_model, plan, world, inputs=(TOKENS,), **kwargs):
    torch.manual_seed(0)
    model = make_model()
    return [fxtp.parallelize(model, plan, example_inputs=inputs, stamp_blocks=stamp,
                             **kwargs) for stamp in (True, False)]


@pytest.mark.parametrize("plan, world", [(llama_tp_plan(), 2), (llama_sp_plan(), 2),
                                         (llama_sp_plan(), 4), (llama_sp_plan(), 8)],
                         ids=["tp-world2", "tp+sp-world2", "tp+sp-world4", "tp+sp-world8"])
def test_identical_blocks_are_traced_once_into_the_traced_program(fake_group, plan, world):
    fake_group(world)
    stamped, traced = stamped_and_traced(llama, plan, world)
    assert stamped.meta[STAMPED] == {f"layers.{i}": "layers.0" for i in range(1, LAYERS)}
    assert traced.meta[STAMPED] == {}
    assert programs(stamped) == programs(traced)
    assert list(stamped.state_dict()) == list(traced.state_dict())
    counts = collectives(stamped, (TOKENS,))
    assert counts == collectives(traced, (TOKENS,))
    if len(plan) == len(llama_sp_plan()):
        # per layer: 2 gathers in, 2 scatters out, one bucket of norm-weight gradients;
        # the embedding's scatter, the head's gathers and the final norm's bucket
        assert counts == ({"all_gather": 2 * LAYERS + 2, "reduce_scatter": 2 * LAYERS + 1},
                          {"all_gather": 2 * LAYERS + 1, "reduce_scatter": 2 * LAYERS + 1,
                           "all_reduce": LAYERS + 1})
    else:  # per layer 2 all-reduces each way; the embedding's, the head's
        assert counts == ({"all_reduce": 2 * LAYERS + 1, "all_gather": 1},
                          {"all_reduce": 2 * LAYERS + 1})
    assert stamped.fxtp.fallbacks == []


@pytest.mark.parametrize("form", FORMS)
def test_blocks_are_traced_once_whatever_the_root_calls_them_with(fake_group, form):
    """A block's argument is an argument wherever it comes from: a root buffer or
    parameter as it is (which the reference read as another module's state, so every
    block was traced), a slice of one, a tensor the root computed; by position, by
    keyword or in a tuple."""
    fake_group(4)
    stamped, traced = stamped_and_traced(llama_calling_blocks(form), llama_sp_plan(), 4)
    assert stamped.meta[STAMPED] == {f"layers.{i}": "layers.0" for i in range(1, LAYERS)}
    assert programs(stamped) == programs(traced)
    assert collectives(stamped, (TOKENS,)) == collectives(traced, (TOKENS,))
    assert stamped.fxtp.fallbacks == []


@pytest.mark.parametrize("form", FORMS)
def test_blocks_are_placed_once_whatever_the_root_calls_them_with(fake_group, form):
    """The stamps stay one node each through the passes: every block runs a copy of the
    first one's module."""
    fake_group(4)
    torch.manual_seed(0)
    gm = fxtp.parallelize(llama_calling_blocks(form)(), llama_sp_plan(),
                          example_inputs=(TOKENS,))
    assert all(block.graph is gm.layers[0].graph for block in gm.layers)


def test_blocks_reading_the_length_the_trace_took_from_the_models_input_are_stamped(
        fake_group):
    """gpt-fast's blocks read ``x.shape`` under a dynamic length, which the trace takes
    once from the model's tokens: each copy takes it from its own argument."""
    from fxtp.examples.gpt_fast import ServeConfig, Transformer, tp_plan
    fake_group(4)
    prompt, seq = torch.randint(0, 64, (2, 8)), torch.export.Dim("seq", min=1, max=32)

    def serving_model():
        model = Transformer(ServeConfig(n_layers=3, max_seq_len=32))
        model.setup_caches(2)
        return model
    stamped, traced = stamped_and_traced(serving_model, tp_plan(), 4,
                                         (prompt, torch.arange(8)),
                                         dynamic_shapes=({1: seq}, {0: seq}), strict=True)
    assert stamped.meta[STAMPED] == {"layers.1": "layers.0", "layers.2": "layers.0"}
    for tokens, positions in [(prompt, torch.arange(8)), (prompt[:, :1], torch.tensor([8]))]:
        with fxtp.count_collectives() as counts:
            out = stamped(tokens, positions)
        with fxtp.count_collectives() as expected:
            assert torch.equal(out, traced(tokens, positions))
        assert counts.counts == expected.counts == {"all_reduce": 6}


@pytest.mark.parametrize("world", [2, 4])
def test_a_block_of_another_shape_gets_its_own_trace(fake_group, world):
    fake_group(world)
    stamped, traced = stamped_and_traced(llama_with_an_odd_middle_block, llama_tp_plan(),
                                         world)
    assert stamped.meta[STAMPED] == {"layers.1": "layers.0", "layers.3": "layers.0"}
    assert programs(stamped) == programs(traced)
    assert collectives(stamped, (TOKENS,)) == collectives(traced, (TOKENS,))
    wk = dict(stamped.named_parameters())
    assert wk["layers.2.attention.wk.weight"].shape[0] == \
        wk["layers.1.attention.wk.weight"].shape[0] // 2


def test_a_block_planned_differently_gets_its_own_trace(fake_group):
    """Layer 1's feed-forward is left replicated: one all-reduce fewer each way."""
    fake_group(2)
    plan = {k.replace("*", str(i)): v for i in range(LAYERS) for k, v in
            llama_tp_plan().items() if "*" in k and not (i == 1 and "feed_forward" in k)}
    plan.update({k: v for k, v in llama_tp_plan().items() if "*" not in k})
    stamped, traced = stamped_and_traced(llama, plan, 2)
    assert stamped.meta[STAMPED] == {"layers.2": "layers.0", "layers.3": "layers.0"}
    assert programs(stamped) == programs(traced)
    counts = collectives(stamped, (TOKENS,))
    assert counts == collectives(traced, (TOKENS,))
    assert counts == ({"all_reduce": 2 * LAYERS, "all_gather": 1},
                      {"all_reduce": 2 * LAYERS})


def test_blocks_differing_in_an_attribute_their_forward_reads_are_each_traced(fake_group):
    fake_group(2)
    stamped, traced = stamped_and_traced(llama_reading_layer_idx, llama_tp_plan(), 2)
    assert stamped.meta[STAMPED] == {}
    assert programs(stamped) == programs(traced)


def test_an_attribute_no_forward_reads_does_not_prevent_stamping(fake_group):
    fake_group(2)

    def model():
        m = llama()
        for i, layer in enumerate(m.layers):
            layer.layer_idx = i  # set, never read
        return m
    stamped, traced = stamped_and_traced(model, llama_tp_plan(), 2)
    assert stamped.meta[STAMPED] == {f"layers.{i}": "layers.0" for i in range(1, LAYERS)}
    assert programs(stamped) == programs(traced)


class Gelu(nn.Module):
    """A function as a module, as the ``kernels`` package wraps one for each module of a
    class it decorates (``_kernel_funcs``, outside ``_modules``)."""

    def __init__(self, approximate="none"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x):
        return nn.functional.gelu(x, approximate=self.approximate)


class HelpedFeedForward(FeedForward):
    def forward(self, x):
        return self.w2(self._helpers["act"](self.w1(x)) * self.w3(x))


def llama_with_helpers(approximations):
    """:func:`llama` whose blocks' feed-forwards each hold their own :class:`Gelu` in a dict
    their forward reads it from."""
    model = llama()
    for layer, approximate in zip(model.layers, approximations):
        layer.feed_forward.__class__ = HelpedFeedForward
        layer.feed_forward._helpers = {"act": Gelu(approximate)}
    return model


def test_blocks_each_holding_their_own_stateless_helper_module_are_stamped(fake_group):
    fake_group(2)
    stamped, traced = stamped_and_traced(lambda: llama_with_helpers(["none"] * LAYERS),
                                         llama_tp_plan(), 2)
    assert stamped.meta[STAMPED] == {f"layers.{i}": "layers.0" for i in range(1, LAYERS)}
    assert programs(stamped) == programs(traced)


def test_blocks_whose_helper_modules_differ_in_a_value_are_each_traced(fake_group):
    fake_group(2)
    stamped, traced = stamped_and_traced(
        lambda: llama_with_helpers(["none", "tanh"] * (LAYERS // 2)), llama_tp_plan(), 2)
    assert stamped.meta[STAMPED] == {"layers.2": "layers.0", "layers.3": "layers.1"}
    assert programs(stamped) == programs(traced)


@fake_collectives_move_values
def test_stamped_blocks_share_their_reference_program_and_hold_their_own_tensors(
        fake_group):
    """Each stamped block is a copy of its reference's module (one class, one graph, one
    generated code) holding its own shards; hooks and the report are its own."""
    fake_group(2)
    stamped, traced = stamped_and_traced(llama, llama_sp_plan(), 2)
    first = stamped.layers[0]
    for block in list(stamped.layers)[1:]:
        assert type(block) is type(first) and block.graph is first.graph
        assert type(block.attention) is type(first.attention)
        assert block.attention.wq.weight is not first.attention.wq.weight
        assert block.attention.wq.weight.placements == first.attention.wq.weight.placements
    assert fxtp.explain(stamped).summary == fxtp.explain(traced).summary
    traced.load_state_dict(stamped.state_dict())
    torch.testing.assert_close(stamped(TOKENS), traced(TOKENS))
    called = []
    stamped.layers[2].register_forward_hook(lambda *_: called.append(2))
    stamped(TOKENS)
    assert called == [2]


def mpt():
    """Each block returns its attention weights beside its output; the model drops them."""
    import transformers as T
    return T.MptForCausalLM(T.MptConfig(vocab_size=64, d_model=32, n_layers=LAYERS, n_heads=4,
                                        max_seq_len=64, expansion_ratio=2)).double()


def bart_encoder():
    """Post-norm blocks: a block's input goes straight into its column-wise q, k and v
    projections, so the gradient sync of that input is made before the block's call."""
    import transformers as T
    return T.BartModel(T.BartConfig(
        vocab_size=64, d_model=32, encoder_layers=LAYERS, decoder_layers=1,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0)).get_encoder().double()


def t5():
    """Blocks of blocks: the first block makes the relative position bias the others take,
    so the blocks differ, while their layers (``block.*.layer.*``) are stamped."""
    import transformers as T
    return T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        dropout_rate=0.0)).double()


@pytest.mark.parametrize("make_model, copies, kwargs", [
    (mpt, {"transformer.blocks.1": "transformer.blocks.0"}, {"use_cache": False}),
    (bart_encoder, {"layers.1": "layers.0"}, {}),
    (t5, {"encoder.block.1.layer.1": "encoder.block.0.layer.1"},
     {"decoder_input_ids": TOKENS, "use_cache": False})],
    ids=["outputs-dropped", "input-gradient-synced-first", "blocks-of-blocks"])
def test_hugging_face_blocks_are_stamped_under_their_derived_plan(fake_group, make_model,
                                                                  copies, kwargs):
    """Stamped blocks are copies of their reference's module, not its nodes copied in
    full, with the programs and collectives of every block traced: with an output the
    caller drops, with the gradient sync of its input made before its call (each block
    gets its own), and with a stamped layer of a block that is not."""
    pytest.importorskip("transformers", reason="pip install -e '.[test]'")
    fake_group(2)
    torch.manual_seed(0)
    model = make_model()
    plan = fxtp.derive_plan(model, example_inputs=(TOKENS,), example_kwargs=kwargs,
                            world_size=2)
    stamped, traced = [fxtp.parallelize(model, plan, example_inputs=(TOKENS,),
                                        example_kwargs=kwargs, strict=True, stamp_blocks=stamp)
                       for stamp in (True, False)]
    for copy, reference in copies.items():
        assert stamped.get_submodule(copy).graph is stamped.get_submodule(reference).graph
    modules = lambda gm: {k: v for k, v in programs(gm).items() if k}  # noqa: E731
    assert modules(stamped) == modules(traced)  # the root may order its syncs otherwise
    assert collectives(stamped, (TOKENS,), kwargs) == collectives(traced, (TOKENS,), kwargs)


def litgpt():
    """Blocks held in ``nn.ModuleDict`` s whose caller adds the residuals: the planned
    attention's row-wise output is all-reduced by the caller, after each block's call."""
    from tests.helpers.ports import PORTS
    return PORTS["litgpt"][0]()


def hf_gpt2():
    """Under sequence parallelism its embeddings' dropout is a module of the plan, whose
    output the first block reads; the block's part of the graph begins earlier (with the
    tensors it reads), so the block is made a module first."""
    pytest.importorskip("transformers", reason="pip install -e '.[test]'")
    from tests.model_code.test_huggingface import gpt2
    return gpt2().double()


def hf_bert():
    """Post-norm blocks inside an encoder module: the gradient sync of the first block's
    input is made by the encoder's caller, which hands the encoder the synced value too."""
    pytest.importorskip("transformers", reason="pip install -e '.[test]'")
    from tests.model_code.test_huggingface import bert
    return bert().double()


def bert_plan():
    from tests.model_code.test_huggingface import BERT_PLAN
    return BERT_PLAN


def gpt2_sp_plan():
    from tests.styles.test_sequence_parallel import HF_GPT2_SP_PLAN
    return HF_GPT2_SP_PLAN


def litgpt_plan():
    from tests.helpers.ports import PORTS
    return PORTS["litgpt"][1]


@pytest.mark.parametrize("make_model, plan, copies, kwargs", [
    (litgpt, litgpt_plan, {"blocks.1.attn": "blocks.0.attn", "blocks.1.mlp": "blocks.0.mlp"},
     {}),
    (hf_gpt2, gpt2_sp_plan, {"transformer.h.1": "transformer.h.0"},
     {"example_kwargs": {"use_cache": False}}),
    (hf_bert, bert_plan, {"bert.encoder.layer.1": "bert.encoder.layer.0"}, {})],
    ids=["output-reduced-by-the-caller", "input-from-a-module-made-later",
         "input-synced-by-the-callers-caller"])
def test_blocks_are_stamped_whatever_their_caller_makes_of_their_values(
        fake_group, make_model, plan, copies, kwargs):
    """A stamped block's call is followed by a copy of the collectives its reference's
    caller made of the reference's outputs (litgpt's attention output all-reduced before
    the residual add), is preceded by a copy of those made of its reference's inputs
    wherever they were made (BERT's input gradient sync, made above the encoder), and
    reads its input whichever module the plan makes first: the programs and collectives
    of every block traced, with no fallback."""
    fake_group(2)
    stamped, traced = stamped_and_traced(make_model, plan(), 2, strict=True, **kwargs)
    for copy, reference in copies.items():
        assert stamped.get_submodule(copy).graph is stamped.get_submodule(reference).graph
    blocks = tuple(f"{fqn}." for fqn in (*copies, *copies.values()))
    of_blocks = lambda gm: {k: v for k, v in programs(gm).items()  # noqa: E731
                            if f"{k}.".startswith(blocks)}
    assert of_blocks(stamped) == of_blocks(traced)
    call = kwargs.get("example_kwargs", {})
    assert collectives(stamped, (TOKENS,), call) == collectives(traced, (TOKENS,), call)
    first = lambda out: out if isinstance(out, torch.Tensor) else out[0]  # noqa: E731
    torch.testing.assert_close(first(stamped(TOKENS, **call)), first(traced(TOKENS, **call)))
    assert stamped.fxtp.fallbacks == []


def test_a_block_whose_input_arrives_placed_otherwise_is_copied_in_full(fake_group):
    """Without the embedding's sequence sharding, layer 0 takes its input replicated and
    gives it sequence-sharded, so the later layers, whose input arrives sharded, cannot
    run layer 0's program: each gets a copy of its nodes, placed anew."""
    fake_group(2)
    plan = {k: v for k, v in llama_sp_plan().items() if k != "tok_embeddings"}
    stamped, traced = stamped_and_traced(llama, plan, 2)
    assert len(stamped.meta[STAMPED]) == LAYERS - 1
    assert stamped.layers[1].graph is not stamped.layers[0].graph
    assert programs(stamped) == programs(traced)
    assert collectives(stamped, (TOKENS,)) == collectives(traced, (TOKENS,))


def test_a_trace_restarted_inside_a_checkpointed_block_leaves_no_region_behind(fake_group):
    """Layer 1 reads its own ``layer_idx``: its tensors, held back for a stamp, are needed,
    and the trace starts over from inside its checkpointed call. The next trace (of a
    model with no checkpointing) must not find itself inside that region."""
    fake_group(2)
    stamped = fxtp.parallelize(llama_reading_layer_idx(), llama_tp_plan(),
                               example_inputs=(TOKENS,), checkpoint=["layers.*"])
    assert stamped.meta[STAMPED] == {}
    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    gm = fxtp.parallelize(net, {"0": fxtp.ColwiseParallel()}, example_inputs=(torch.randn(2, 8),))
    assert not [name for name, _ in gm.named_modules() if "checkpoint" in name]
    assert "run_checkpointed" not in gm.code


def gemma2():
    """Hugging Face's Gemma-2: sliding-window and global attention layers alternate (each
    reads its own ``sliding_window``), and each MLP holds its own ``functools.partial``
    activation."""
    from tests.helpers.corpus import _hf
    return _hf("Gemma2Config", "Gemma2ForCausalLM", attn_implementation="eager",
               sliding_window=8, query_pre_attn_scalar=4, pad_token_id=0,
               num_hidden_layers=LAYERS, use_cache=False)


def test_alternating_layers_each_stamp_their_own_kind(fake_group):
    fake_group(2)
    stamped, traced = stamped_and_traced(gemma2, "auto", 2, inputs=(TOKENS,))
    assert stamped.meta[STAMPED] == {"model.layers.2": "model.layers.0",
                                     "model.layers.3": "model.layers.1"}
    layers = stamped.model.layers  # each kind runs its reference's module copy
    assert layers[2].graph is layers[0].graph and layers[3].graph is layers[1].graph
    assert layers[1].graph is not layers[0].graph
    assert programs(stamped) == programs(traced)
    assert stamped.fxtp.fallbacks == []
    torch.testing.assert_close(stamped(TOKENS).logits, traced(TOKENS).logits)


def test_hugging_face_blocks_nested_in_an_outlined_model_run_their_reference_copy(
        fake_group):
    """``model.layers.N`` sit in ``model``, itself outlined: the stamped layers are still
    copies of layer 0's module, and the program is the fully traced one."""
    fake_group(2)
    from tests.helpers.corpus import _hf
    stamped, traced = stamped_and_traced(
        lambda: _hf("Qwen2Config", "Qwen2ForCausalLM", num_hidden_layers=LAYERS,
                    use_cache=False), "auto", 2)
    assert len(stamped.meta[STAMPED]) == LAYERS - 1
    layers = stamped.model.layers
    assert all(layers[i].graph is layers[0].graph for i in range(1, LAYERS))
    assert programs(stamped) == programs(traced)
    assert stamped.fxtp.fallbacks == []
    torch.testing.assert_close(stamped(TOKENS).logits, traced(TOKENS).logits)


def stamped_projections(make_model) -> dict:
    """The blocks stamped in a stack of :class:`Projection` s (colwise at world 2), once
    its program is checked to be the fully traced one."""
    plan = {"layers.*.proj": fxtp.ColwiseParallel()}
    stamped, traced = stamped_and_traced(make_model, plan, 2, inputs=(torch.randn(2, 8, 32),))
    assert programs(stamped) == programs(traced)
    return stamped.meta[STAMPED]


def test_a_block_called_under_autocast_is_not_stamped_from_one_called_without(fake_group):
    fake_group(2)
    assert stamped_projections(AutocastSecond) == {"layers.3": "layers.2"}


def test_blocks_differing_in_a_slot_their_forward_reads_are_each_traced(fake_group):
    """Each block's factor sits in a ``__slots__`` slot, outside ``__dict__``."""
    fake_group(2)
    assert stamped_projections(SlottedStack) == {}


def test_a_block_whose_values_escape_is_traced_in_full(fake_group):
    """``self.seen``, read by the parent, is not among the block's outputs: stamping
    would lose it, so every block is traced."""
    fake_group(2)
    assert stamped_projections(StashingStack) == {}


def test_a_blocks_tensor_read_outside_its_call_is_there_to_read(fake_group):
    """Reading a held-back block's weight restarts the trace with that kind's tensors
    (it raised AttributeError): the blocks are still stamped, into the traced program (the
    first from the second: the first's input, the model's, needs no gradient)."""
    fake_group(2)
    assert stamped_projections(WeightReadingStack) == {"layers.2": "layers.1"}


def test_a_block_holding_no_tensors_is_stamped_too(fake_group):
    """Its call needed a module to call, which only blocks holding tensors had (found by
    the property test)."""
    fake_group(2)
    stamped, traced = stamped_and_traced(NormsAndActivations, {}, 2,
                                         inputs=(torch.randn(2, 8, 32),))
    assert stamped.meta[STAMPED] == {"layers.3": "layers.1"}  # the first norm's input
    assert programs(stamped) == programs(traced)                # needs no gradient


def test_checkpointed_blocks_are_stamped_with_a_region_each(fake_group):
    fake_group(2)
    stamped, traced = stamped_and_traced(llama, llama_sp_plan(), 2,
                                         checkpoint=["layers.*"])
    assert len(stamped.meta[STAMPED]) == LAYERS - 1
    assert programs(stamped) == programs(traced)
    assert collectives(stamped, (TOKENS,)) == collectives(traced, (TOKENS,))


def sliding_window_parity(rank, world):
    programs = []
    counts = check_parity(rank, world, sliding_window_stack, WINDOW_PLAN, [WINDOW_INPUT],
                          dtype=torch.float64, strict=True, post=programs.append)
    return counts, programs[0].meta[STAMPED]


def test_blocks_making_constants_in_forward_are_stamped_and_train_like_single_device(ranks):
    """A stamp's copy reads its reference's constants (the same values: the blocks are
    equivalent); before, it looked them up under its own name and the trace failed with a
    ``KeyError``. Layer 0 reads the model's input and is traced in full."""
    counts, stamped = ranks.run(sliding_window_parity)[0]
    assert stamped == {"layers.2": "layers.1"}
    assert counts == ({"all_reduce": 3}, {"all_reduce": 3})


def odd_block_parity(rank, world, dtype):
    programs = []
    counts = check_parity(rank, world, llama_with_an_odd_middle_block, llama_sp_plan(),
                          [TOKENS], dtype=dtype, input_grads=False, post=programs.append)
    return counts, programs[0].meta[STAMPED]


def test_stamped_blocks_train_like_single_device(ranks):
    """Forward, every gradient and 3 AdamW steps (fp64) on the model with an odd middle
    block, stamped, against the single-device model."""
    (fwd, bwd), stamped = ranks.run(odd_block_parity, torch.float64)[0]
    assert stamped == {"layers.1": "layers.0", "layers.3": "layers.0"}
    assert fwd == {"all_gather": 2 * LAYERS + 2, "reduce_scatter": 2 * LAYERS + 1}
    assert bwd == {"all_gather": 2 * LAYERS + 1, "reduce_scatter": 2 * LAYERS + 1,
                   "all_reduce": LAYERS + 1}


def root_arguments_parity(rank, world, form, stamp):
    programs = []
    counts = check_parity(rank, world, llama_calling_blocks(form), llama_sp_plan(), [TOKENS],
                          dtype=torch.float64, input_grads=False, stamp_blocks=stamp,
                          post=programs.append)
    return counts, programs[0].meta[STAMPED]


@pytest.mark.parametrize("form, stamp", [("buffers", True), ("parameter", True),
                                         ("parameter", False), ("computed", True)],
                         ids=["buffers", "parameter", "parameter-every-block-traced",
                              "computed"])
def test_blocks_given_root_tensors_as_they_are_train_like_single_device(ranks, form, stamp):
    """Forward, every gradient (the root parameter's summed over the blocks) and 3 AdamW
    steps (fp64), against the single-device model."""
    (fwd, bwd), stamped = ranks.run(root_arguments_parity, form, stamp)[0]
    assert stamped == ({f"layers.{i}": "layers.0" for i in range(1, LAYERS)} if stamp else {})
    assert fwd == {"all_gather": 2 * LAYERS + 2, "reduce_scatter": 2 * LAYERS + 1}
    # per layer one bucket of norm-weight gradients; the final norm's weight and the root
    # parameter (each block computes a partial gradient of it from its sequence shard):
    # one bucket in the root
    assert bwd == {"all_gather": 2 * LAYERS + 1, "reduce_scatter": 2 * LAYERS + 1,
                   "all_reduce": LAYERS + 1}
