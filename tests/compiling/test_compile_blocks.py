"""Regional compilation (:func:`fxtp.compile`, :func:`fxtp.compile_blocks`): each distinct
block is traced and compiled once and its code reused for every equal block; the result
computes what the eager program does."""
import warnings

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch._dynamo.utils import compilation_time_metrics, counters

import fxtp
from fxtp.examples.gpt_fast import generate
from fxtp.examples.llama import Llama, LlamaConfig, llama_sp_plan
from fxtp.passes.complex_pairs import Unpaired, pair_complex
from fxtp.passes.errors import InputError
from fxtp.passes.graph import attr
from fxtp.passes.stateless import stateless
from tests.frontend.test_stamping import LAYERS, TOKENS, llama, llama_with_an_odd_middle_block
from tests.helpers import transformer_models as tm
from tests.helpers.compiled import check_compiled
from tests.serving.test_serving import NEW, parallelize_for_serving, prompt, serving_model


def parallel(make_model):
    torch.manual_seed(0)
    return fxtp.parallelize(make_model(), llama_sp_plan(), example_inputs=(TOKENS,))


def compiled_graphs(gm, backend) -> int:
    """Graphs dynamo compiled for a training step of ``gm`` with its blocks compiled."""
    torch._dynamo.reset()
    counters.clear()
    fxtp.compile_blocks(gm, backend=backend)
    gm(TOKENS).square().mean().backward()
    return counters["stats"]["unique_graphs"]


def test_equal_blocks_are_compiled_once(fake_group):
    fake_group(2)
    gm = parallel(llama)
    assert compiled_graphs(gm, "eager") == 1
    assert all(type(block) is type(gm.layers[0]) for block in gm.layers)


def test_a_different_block_is_compiled_on_its_own(fake_group):
    fake_group(2)
    gm = parallel(llama_with_an_odd_middle_block)
    assert compiled_graphs(gm, "eager") == 2
    assert type(gm.layers[2]) is not type(gm.layers[0])
    assert type(gm.layers[3]) is type(gm.layers[0])


def test_blocks_compiled_compute_what_the_eager_program_does(fake_group):
    fake_group(2)
    eager, compiled = parallel(llama_with_an_odd_middle_block), \
        parallel(llama_with_an_odd_middle_block)
    fxtp.compile_blocks(compiled, backend="aot_eager")
    outs = []
    for gm in (eager, compiled):
        out = gm(TOKENS)
        out.square().mean().backward()
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1])
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"grad of {name}: {m}")


def step_with_regions(gm) -> tuple[int, int, list, torch.Tensor]:
    """A training step of ``fxtp.compile(gm)`` (aot_eager): the block regions dynamo
    traced, the regions it stamped from a trace, the subgraphs the top graph calls, and
    the output."""
    torch._dynamo.reset()
    compilation_time_metrics.clear()
    graphs = []

    def capture(graph, inputs):
        graphs.append(graph)
        return torch._dynamo.lookup_backend("aot_eager")(graph, inputs)
    out = fxtp.compile(gm, backend=capture, fullgraph=True)(TOKENS)
    out.square().mean().backward()
    assert len(graphs) == 1
    calls = [n.args[1] for n in graphs[0].graph.nodes
             if n.target is torch.ops.higher_order.invoke_subgraph]
    return (len(compilation_time_metrics.get("invoke_subgraph_trace", [])),
            len(compilation_time_metrics.get("invoke_subgraph_reuse_stamp_out", [])),
            calls, out)


def assert_eager_step_matches(eager, gm, out):
    """``eager``'s training step gives ``gm``'s output ``out`` and gradients."""
    expected = eager(TOKENS)
    expected.square().mean().backward()
    torch.testing.assert_close(out, expected)
    for (name, p), q in zip(eager.named_parameters(), gm.parameters()):
        assert type(q.grad) is type(p.grad), name
        torch.testing.assert_close(q.grad, p.grad, msg=lambda m: f"grad of {name}: {m}")


def test_equal_blocks_are_traced_once_and_run_as_one_region(fake_group):
    fake_group(2)
    traced, stamped, calls, _ = step_with_regions(parallel(llama))
    assert (traced, stamped) == (1, 3)
    assert calls == ["subgraph_0"] * 4


def test_a_different_block_gets_a_region_of_its_own_and_numbers_hold(fake_group):
    fake_group(2)
    gm = parallel(llama_with_an_odd_middle_block)
    traced, stamped, _, out = step_with_regions(gm)
    assert (traced, stamped) == (2, 2)
    assert_eager_step_matches(parallel(llama_with_an_odd_middle_block), gm, out)


def test_checkpointed_blocks_are_regions_too(fake_group):
    """A checkpointed region inside a block is passed the submodules it calls: the copy
    holds their copies and takes their tensors."""
    fake_group(2)

    def checkpointed():
        torch.manual_seed(0)
        return fxtp.parallelize(llama(), llama_sp_plan(), example_inputs=(TOKENS,),
                                checkpoint=["layers.*"])
    gm = checkpointed()
    traced, stamped, _, out = step_with_regions(gm)
    assert (traced, stamped) == (1, 3)
    assert_eager_step_matches(checkpointed(), gm, out)


def regions(gm):
    return fxtp.compile(gm, backend="aot_eager", fullgraph=True)


def test_a_stateless_copy_holds_no_tensors_and_computes_what_its_block_does(fake_group):
    fake_group(2)
    gm = fxtp.parallelize(llama(), llama_sp_plan(), example_inputs=(TOKENS,),
                          checkpoint=["layers.*"])
    block = gm.layers[1]
    expected = gm(TOKENS)
    copy, names = stateless(block)
    assert not list(copy.parameters()) and not list(copy.buffers())
    assert set(names) == {name for name, _ in block.named_parameters()}
    block.forward = lambda *args: copy(*(attr(block, n).to_local() for n in names), *args)
    torch.testing.assert_close(gm(TOKENS), expected)


def test_a_block_holding_a_plain_module_is_compiled_inline_with_a_warning(fake_group):
    fake_group(2)
    gm = parallel(llama)

    class Plain(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args):
            return self.inner(*args)
    gm.layers[2].feed_forward = Plain(gm.layers[2].feed_forward)
    with pytest.warns(UserWarning, match=r"layers\.2 \(feed_forward: it is a Plain"):
        fxtp.compile(gm, backend="aot_eager")


def test_serving_with_regions_writes_the_caches_as_eager_does(fake_group):
    """Prefill and decode (a dynamic sequence dim) under no_grad, each block writing its KV
    cache in place inside its region."""
    fake_group(2)
    eager = parallelize_for_serving(serving_model())
    gm = parallelize_for_serving(serving_model())
    with torch.no_grad():
        tokens = generate(regions(gm), prompt(), NEW)
        assert torch.equal(tokens, generate(eager, prompt(), NEW))
    for (name, b), c in zip(eager.named_buffers(), gm.buffers()):
        assert torch.equal(b, c), name


def rotate(x, freqs):
    """Meta's rotary embedding: pairs as complex numbers times a complex table (here kept
    in complex64 and converted)."""
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    table = freqs[:x.shape[1]].unsqueeze(0).unsqueeze(2).to(torch.complex128)
    return torch.view_as_real(pairs * table).flatten(3)


def test_complex_values_as_real_pairs_compute_what_complex_ones_do():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 3, 8, dtype=torch.float64, generator=g)
    freqs = torch.polar(torch.ones(10, 4), torch.randn(10, 4, generator=g))
    gm = make_fx(rotate, tracing_mode="fake")(x, freqs)
    assert pair_complex(gm)
    assert not any(n.target in (torch.ops.aten.view_as_complex.default,
                                torch.ops.aten.view_as_real.default) for n in gm.graph.nodes)
    paired, plain = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = gm(paired, torch.view_as_real(freqs)), rotate(plain, freqs)
    torch.testing.assert_close(out, expected, rtol=1e-13, atol=1e-13)
    weights = torch.randn(out.shape, dtype=torch.float64, generator=g)
    (out * weights).sum().backward()
    (expected * weights).sum().backward()
    torch.testing.assert_close(paired.grad, plain.grad, rtol=1e-13, atol=1e-13)


def test_an_op_with_no_pair_form_is_refused_before_anything_changes():
    def exp_of(x, freqs):
        return torch.view_as_real(torch.exp(freqs)) * x
    freqs = torch.polar(torch.ones(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64))
    gm = make_fx(exp_of, tracing_mode="fake")(torch.ones(4, 2, dtype=torch.float64), freqs)
    code = gm.code
    with pytest.raises(Unpaired, match="exp"):
        pair_complex(gm)
    assert gm.code == code


def test_blocks_computing_with_complex_numbers_are_regions_too(fake_group):
    """Complex rotary tables cross the region's boundary and compute inside as real pairs
    (torch's region cannot differentiate through complex tensors)."""
    fake_group(2)

    def complex_rope():
        torch.manual_seed(0)
        return fxtp.parallelize(Llama(LlamaConfig(n_layers=LAYERS, n_heads=8, n_kv_heads=8,
                                                  rope="complex")),
                                llama_sp_plan(), example_inputs=(TOKENS,))
    gm = complex_rope()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fxtp.compile")
        traced, stamped, _, out = step_with_regions(gm)
    assert (traced, stamped) == (1, 3)
    # the rotation runs in fp32 either way, as complex64 or as pairs: they round apart
    eager = complex_rope()
    expected = eager(TOKENS)
    expected.square().mean().backward()
    torch.testing.assert_close(out, expected)
    for (name, p), q in zip(eager.named_parameters(), gm.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6 * p.grad.abs().max(),
                                   msg=lambda m: f"grad of {name}: {m}")


def test_the_eager_backend_is_refused(fake_group):
    fake_group(2)
    with pytest.raises(InputError, match="aot_eager"):
        fxtp.compile(parallel(llama), backend="eager")


def train_with_regions(rank, world):
    return check_compiled(rank, world, lambda: tm.Llama(tm.LlamaConfig(n_layers=2)),
                          tm.llama_sp_plan(), [TOKENS],
                          compiler=lambda gm: fxtp.compile(gm, fullgraph=True))


def test_regions_train_like_eager_on_two_ranks(ranks2):
    """Outputs, gradients and parameters after AdamW steps, with real collectives and
    inductor (which, reusing buffers across regions, got the gradients wrong: fxtp.compile
    turns that off)."""
    ranks2.run(train_with_regions)
