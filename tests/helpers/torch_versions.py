"""What the tests know of the torch versions fxtp supports (``setup.cfg``: 2.11 and later;
CI runs the suite on 2.13 and a subset on 2.11, ``.ci/run``)."""
import pytest
import torch

TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])

fake_collectives_move_values = pytest.mark.skipif(
    TORCH < (2, 13),
    reason="torch < 2.13's fake process group returns uninitialized memory from functional "
           "collectives (seen on 2.11), so numbers computed on it mean nothing")
"""Marks a test that compares numbers computed on a fake process group."""
