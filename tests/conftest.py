import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# torch.compile: one inductor cache for the test process and every rank process (set before
# they start), so each graph compiles once per machine; later runs load it.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                      str(Path(__file__).resolve().parent.parent / ".pytest_cache" / "inductor"))
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")

from tests.helpers.harness import pool_of  # noqa: E402

_pools: dict = {}
"""World size -> its :class:`~tests.helpers.harness.RankPool`, one per test session."""


@pytest.fixture(scope="session")
def pools():
    yield _pools
    for pool in _pools.values():
        pool.close()


@pytest.fixture(params=[2, 4], ids=lambda w: f"world{w}")
def ranks(request, pools):
    """A gloo process group of the parametrized world size: ``ranks.run(fn, *args)``."""
    return pool_of(pools, request.param)


@pytest.fixture
def ranks2(pools):
    return pool_of(pools, 2)


@pytest.fixture
def ranks4(pools):
    return pool_of(pools, 4)


@pytest.fixture
def fake_group():
    """``fake_group(world)``: a fake process group in this process (shapes only, no data)."""
    import torch.distributed as dist

    from fxtp.kernels.torch_compat import init_fake_process_group
    yield init_fake_process_group
    if dist.is_initialized():
        dist.destroy_process_group()


def _world_and_dtype(item):
    params = getattr(item, "callspec", None)
    params = params.params if params else {}
    world = params.get("ranks", params.get("world"))
    dtype = params.get("dtype")
    return world, (str(dtype).removeprefix("torch.") if dtype is not None else None)


def pytest_collection_modifyitems(config, items):
    """Dtypes across world sizes: fp64 (tight tolerance) runs at world sizes 2 and 4, fp32
    (torch's default tolerance) at 4, where its round-off is largest; a test parametrized
    over both world sizes and both dtypes leaves out fp32 at world 2, which its fp64 run
    and its fp32 run at 4 cover. This keeps the suite within its 20 minutes."""
    fp32_at_4 = {(item.module.__name__, item.originalname) for item in items
                 if _world_and_dtype(item) == (4, "float32")}
    dropped = [item for item in items if _world_and_dtype(item) == (2, "float32") and
               (item.module.__name__, item.originalname) in fp32_at_4]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item not in set(dropped)]
