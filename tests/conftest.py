import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.harness import RankPool  # noqa: E402

_pools: dict[int, RankPool] = {}


@pytest.fixture(scope="session")
def pools():
    yield _pools
    for pool in _pools.values():
        pool.close()


@pytest.fixture(params=[2, 4], ids=lambda w: f"world{w}")
def ranks(request, pools):
    """A gloo process group of the parametrized world size: ``ranks.run(fn, *args)``."""
    world = request.param
    if world not in pools:
        pools[world] = RankPool(world)
    return pools[world]
