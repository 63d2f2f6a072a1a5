"""The module tree survives parallelize: blocks are submodules at their FQNs that run their
part of the program and hold their own parameters, so hooks and ``checkpoint_wrapper``
apply per block as on the original model (shapes and equalities on a fake group)."""
import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing, checkpoint_wrapper)

import fxtp
from tests import transformer_models as tm

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
    """``apply_activation_checkpointing`` on ``gm.layers[i]``: outputs and gradients as
    without it."""
    fake_group(2)
    _, plain = parallel_llama()
    _, wrapped = parallel_llama()
    apply_activation_checkpointing(
        wrapped, checkpoint_wrapper_fn=checkpoint_wrapper,
        check_fn=lambda m: any(m is block for block in wrapped.layers))
    assert type(wrapped.layers[0]).__name__ == "CheckpointWrapper"
    outs = [m(TOKENS) for m in (plain, wrapped)]
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    for out in outs:
        out.square().mean().backward()
    grads = [{n.replace("_checkpoint_wrapped_module.", ""): p.grad.to_local()
              for n, p in m.named_parameters()} for m in (plain, wrapped)]
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=0)
