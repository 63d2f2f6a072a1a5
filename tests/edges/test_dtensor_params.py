"""fxtp's parameters are DTensors that its graphs read through ``local_tensor``: forward the
local shard itself, backward a DTensor gradient identical to ``DTensor.to_local``'s (same
placements, global shape, stride and values), whether the local gradient is laid out like
the shard or not, and differentiable again under ``create_graph``."""
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from fxtp.edges.local_reads import local_tensor

USES = {
    "elementwise": lambda w, x: (w * w).sum(),
    "matmul": lambda w, x: (x @ w).sum(),
    "transposed (a gradient strided unlike the shard)": lambda w, x: (w.t() * x).sum(),
}


def _gradient(read, placement, use):
    mesh = init_device_mesh("cpu", (2,))
    local = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    w = torch.nn.Parameter(DTensor.from_local(local, mesh, [placement], run_check=False))
    use(read(w), torch.arange(16.0, dtype=torch.float64).view(4, 4)).backward()
    return w.grad


@pytest.mark.parametrize("placement", [Shard(0), Shard(1), Replicate()], ids=str)
@pytest.mark.parametrize("use", USES, ids=list(USES))
def test_the_gradient_is_the_dtensor_to_local_gives(fake_group, placement, use):
    fake_group(2)
    got = _gradient(local_tensor, placement, USES[use])
    want = _gradient(lambda w: w.to_local(), placement, USES[use])
    assert isinstance(got, DTensor) and got.placements == want.placements
    assert (got.shape, got.stride()) == (want.shape, want.stride())
    assert got.to_local().stride() == want.to_local().stride()
    torch.testing.assert_close(got.to_local(), want.to_local(), rtol=0, atol=0)


def test_the_forward_reads_the_shard_itself_and_the_gradient_differentiates_again(fake_group):
    fake_group(2)
    mesh = init_device_mesh("cpu", (2,))
    w = torch.nn.Parameter(DTensor.from_local(torch.full((2, 3), 3.0), mesh, [Shard(0)]))
    read = local_tensor(w)
    assert read.data_ptr() == w.to_local().data_ptr()
    grad, = torch.autograd.grad((read ** 3).sum(), w, create_graph=True)
    assert grad.requires_grad
    torch.testing.assert_close(grad.to_local(), torch.full((2, 3), 27.0))
    second, = torch.autograd.grad(grad.to_local().sum(), w)
    torch.testing.assert_close(second.to_local(), torch.full((2, 3), 18.0))
