"""Regional compilation (:func:`fxtp.compile_blocks`): each distinct block is compiled
once and its code reused for every equal block; the result computes what the eager
program does."""
import torch
from torch._dynamo.utils import counters

import fxtp
from fxtp.llama import llama_sp_plan
from tests.test_stamping import TOKENS, llama, llama_with_an_odd_middle_block


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
