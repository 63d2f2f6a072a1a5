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

from tests.helpers.harness import close_pools, pool_of  # noqa: E402

_pools: dict = {}
"""World size -> its :class:`~tests.helpers.harness.RankPool`, one per test process."""


@pytest.fixture(scope="session")
def pools():
    yield _pools
    close_pools(list(_pools.values()))


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


def pytest_addoption(parser):
    parser.addoption("--every-world", action="store_true",
                     help="run every case of a test parametrized over cases and world sizes "
                          "at both world sizes (by default each case runs at one, alternating)")


def _params(item) -> dict:
    spec = getattr(item, "callspec", None)
    return spec.params if spec else {}


def _world_and_dtype(item):
    params = _params(item)
    world = params.get("ranks", params.get("world"))
    dtype = params.get("dtype")
    return world, (str(dtype).removeprefix("torch.") if dtype is not None else None)


def _test(item) -> tuple:
    """The test function ``item`` is a parametrization of."""
    return item.module.__name__, item.originalname


def _case(item) -> tuple:
    """The item's parameters other than its world size and dtype: which case it runs."""
    return tuple(sorted((k, repr(v)) for k, v in _params(item).items()
                        if k not in ("ranks", "world", "dtype")))


def _one_world_per_case(items) -> list:
    """The items a sweep leaves out: where a test runs several cases on gloo ranks at world
    sizes 2 and 4, the k-th case that has both keeps only world size ``(2, 4)[k % 2]``. The
    test runs at both world sizes, each case at one. Tests in one process (a fake group, a
    simulation of ranks) cost little and run every case at both."""
    worlds: dict = {}  # test -> case -> the world sizes it is collected at
    for item in items:
        world, _ = _world_and_dtype(item)
        if world is not None and {"ranks", "pools"} & set(item.fixturenames):
            worlds.setdefault(_test(item), {}).setdefault(_case(item), set()).add(world)
    kept = {}
    for test, cases in worlds.items():
        both = [case for case, sizes in cases.items() if sizes == {2, 4}]
        if len(both) > 1:
            kept.update({(test, case): (2, 4)[k % 2] for k, case in enumerate(both)})
    return [item for item in items
            if kept.get((_test(item), _case(item))) not in (None, _world_and_dtype(item)[0])]


def pytest_collection_modifyitems(config, items):
    """What keeps the suite within its 20 minutes while every test runs at world sizes 2
    and 4:

    * fp64 (tight tolerance) runs at both, fp32 (torch's default tolerance) at 4, where its
      round-off is largest: a test parametrized over both world sizes and both dtypes
      leaves out fp32 at world size 2, which its fp64 run and its fp32 run at 4 cover;
    * a test of several cases (models, options) at both world sizes runs each case at one
      of them, alternating (:func:`_one_world_per_case`); ``--every-world`` runs them all.
    """
    fp32_at_4 = {_test(item) for item in items if _world_and_dtype(item) == (4, "float32")}
    dropped = [item for item in items if _world_and_dtype(item) == (2, "float32") and
               _test(item) in fp32_at_4]
    if not config.getoption("every_world"):
        dropped += _one_world_per_case(items)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        dropped = set(dropped)
        items[:] = [item for item in items if item not in dropped]
