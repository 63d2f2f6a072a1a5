"""``python -m fxtp demo`` spawns its own 2 gloo ranks, trains with TP + SP + loss parallel
and agrees with the single-device model at every step."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_demo_trains_in_step_with_the_single_device_model():
    run = subprocess.run([sys.executable, "-m", "fxtp", "demo", "--steps", "4"], cwd=ROOT,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    steps = re.findall(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.e+-]+)$", run.stdout, re.M)
    assert [int(s[0]) for s in steps] == [0, 1, 2, 3]
    assert all(abs(float(a) - float(b)) <= 1e-3 for _, a, b, _ in steps)
    assert float(steps[-1][1]) < float(steps[0][1])  # it learns
    assert "loss curves agree" in run.stdout
    # the Megatron SP schedule of a 2-layer model, and the loss's 3 all-reduces; backward,
    # the norm weights' gradients: one bucket per block and one for the final norm
    assert re.search(r"forward: 5 all_gather .*, 3 all_reduce .*, 5 reduce_scatter", run.stdout)
    assert re.search(r"backward: 5 all_gather .*, 3 all_reduce .*, 5 reduce_scatter", run.stdout)
