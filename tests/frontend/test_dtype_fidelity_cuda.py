"""CUDA autocast casts other ops than the CPU's (softmax, norms and ``exp`` run in fp32):
each construct of :mod:`tests.frontend.test_dtype_fidelity` keeps single-device CUDA autocast's
output and gradient dtypes (rank 0 of a fake group of 2: dtypes only, no values)."""
from __future__ import annotations

import pytest
import torch

import fxtp
from tests.frontend.test_dtype_fidelity import CONSTRUCTS, DIM, Construct

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def dtypes(module, x):
    out = module(x)
    out.float().sum().backward()
    grads = {n.replace("_orig_mod.", ""): (p.grad.dtype if p.grad is not None else None)
             for n, p in module.named_parameters()}
    return out.dtype, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", CONSTRUCTS)
def test_cuda_autocast_keeps_single_device_dtypes(fake_group, name, dtype):
    fake_group(2)
    body, plan = CONSTRUCTS[name]
    torch.manual_seed(0)
    model = Construct(body, autocast=True).to("cuda", dtype)
    x = torch.randn(2, 4, DIM, device="cuda", dtype=dtype)
    gm = fxtp.parallelize(model, plan, example_inputs=(x,), strict=True)
    assert dtypes(gm, x) == dtypes(model, x)
