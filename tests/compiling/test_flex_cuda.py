"""flex_attention on CUDA, forward and backward (torch has no CPU backward for it): rank 3 of
a fake process group of 4 computes its heads, whose outputs and weight gradients equal the
single-device model's for those heads (the score function reads the global head index).
A fake group moves no data, so the model returns the head-sharded attention output and the
checks need no collective. Skipped without CUDA."""
import pytest
import torch
import torch.distributed as dist
from fxtp.kernels.torch_compat import init_fake_process_group

import fxtp
from fxtp import Shard
from tests.helpers.models import FlexAttention
from tests.helpers.parity import local_of, local_part

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
WORLD, RANK = 4, 3


class Heads(FlexAttention):
    """The attention output per head, before the output projection."""

    def forward(self, x):
        return self.heads(x)


def test_flex_attention_heads_forward_and_backward_on_cuda():
    torch.cuda.set_device(0)
    init_fake_process_group(WORLD, rank=RANK)
    try:
        torch.manual_seed(0)
        model = Heads(dim=64, n_heads=8).cuda()
        x = torch.randn(2, 128, 64, device="cuda")
        gm = fxtp.parallelize(model, {"w[qkv]": fxtp.ColwiseParallel()}, example_inputs=(x,),
                              strict=True)
        assert gm.fxtp.output_placements == (Shard(1),)
        weight = torch.randn(2, 8, 128, 8, device="cuda")
        out = gm(x)
        (out * local_part(weight, Shard(1), RANK, WORLD)).sum().backward()
        ref = model(x)
        (ref * weight).sum().backward()
        torch.testing.assert_close(out, local_part(ref.detach(), Shard(1), RANK, WORLD))
        for name in ("wq.weight", "wk.weight", "wv.weight"):
            expected = local_part(model.get_parameter(name).grad, Shard(0), RANK, WORLD)
            torch.testing.assert_close(local_of(gm.get_parameter(name).grad), expected)
    finally:
        dist.destroy_process_group()
