"""The README's scripts run exactly as written, under torchrun with 2 ranks (4 for the
scaling-out recipe)."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_readme_script(tmp_path, name: str):
    """The README's ``# save as <name>`` script, run under torchrun with 2 ranks: each rank's
    stdout and stderr (one file each per rank, so their prints cannot interleave). A failed run
    reports every rank's logs, so that a crash says which rank died where."""
    readme = (ROOT / "README.md").read_text()
    code = re.search(rf"```python\n(# save as {re.escape(name)}.*?)```", readme, re.S).group(1)
    script = tmp_path / name
    script.write_text(code)
    logs = tmp_path / "logs"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                          "2", "--standalone", "--log-dir", str(logs), "--redirects", "3",
                          str(script)], cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=300)
    out, err = ({int(f.parent.name): f.read_text() for f in logs.rglob(stream)}
                for stream in ("stdout.log", "stderr.log"))
    ranks = "".join(f"\n--- rank {r} stdout ---\n{out.get(r, '')[-1500:]}"
                    f"\n--- rank {r} stderr ---\n{err.get(r, '')[-3000:]}" for r in (0, 1))
    assert run.returncode == 0, run.stderr[-2000:] + ranks
    assert sorted(out) == [0, 1], ranks
    return out, err


def test_quick_start_runs_as_written(tmp_path):
    out, _ = run_readme_script(tmp_path, "quickstart.py")
    lines = [next(line.split() for line in out[r].splitlines() if line.startswith(f"{r} "))
             for r in (0, 1)]
    assert lines[0][1] == lines[1][1]  # the same loss on both ranks
    assert all(line[2:] == ["(32,", "16)"] for line in lines)
    assert "fxtp_passes_collectives_all_reduce" in out[0]


def test_plans_from_other_projects_run_as_written(tmp_path):
    """The "Plans from other projects" script: torch's, torchtitan's, torchtune's and
    Hugging Face's plans, each checked against the single-device model inside it."""
    out, err = run_readme_script(tmp_path, "plans.py")
    assert all("all four plans match the single-device model" in out[r] for r in (0, 1))
    assert all("plan key 'output' matches no module of TunedLlama" in err[r] and
               "its shards come from the layout of parameter 'tok_embeddings.weight'" in err[r]
               for r in (0, 1))


def test_scaling_out_recipe_runs_as_written(tmp_path):
    """The "Scaling out" script under torchrun with 4 ranks: TP x FSDP2 per block, torch's
    clipping and DCP through get/set_model_state_dict. Dynamo is disabled here (the
    regional compiles cost a minute on 2 cores); ``benchmarks/scale_out.py`` compiles."""
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(# save as scale_out\.py.*?)```", readme, re.S).group(1)
    script = tmp_path / "scale_out.py"
    script.write_text(code.replace('tempfile.gettempdir() + "/fxtp_scale_out"',
                                   repr(str(tmp_path / "checkpoint"))))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                          "--standalone", str(script)], cwd=tmp_path,
                         env=dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1"),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"^loss [\d.]+ norm [\d.]+$", run.stdout, re.M), run.stdout


def test_explain_output_shown_is_the_quick_starts(fake_group):
    """The README's `print(fxtp.explain(gm))` output is what the quick start's MLP gives."""
    import torch

    import fxtp
    readme = (ROOT / "README.md").read_text()
    quick_start = re.search(r"# save as quickstart\.py.*?```", readme, re.S).group(0)
    imports = re.search(r"^import torch.*$", quick_start, re.M).group(0)
    mlp = re.search(r"^class MLP.*?return .*?$", quick_start, re.S | re.M).group(0)
    namespace = {}
    exec(imports + "\n" + mlp, namespace)
    shown = re.search(r"print\(fxtp\.explain\(gm\)\)\n```\n\n```text\n(.*?)```", readme,
                      re.S).group(1)
    fake_group(2)
    gm = fxtp.parallelize(namespace["MLP"](), {"net1": fxtp.ColwiseParallel(),
                                               "net2": fxtp.RowwiseParallel()},
                          example_inputs=(torch.randn(4, 16),))
    assert str(fxtp.explain(gm)).rstrip("\n") == shown.rstrip("\n")


def test_serving_script_runs_as_written(tmp_path):
    """The "Serving" script: a Hugging Face Llama generates through fxtp as through its own
    generate(), greedy and sampled, with half the KV cache on each of 2 ranks."""
    out, _ = run_readme_script(tmp_path, "serve.py")
    lines = [next(line for line in out[r].splitlines() if "cache elements" in line)
             for r in (0, 1)]
    assert lines[0].startswith("0 ") and lines[1].startswith("1 ") and \
        lines[0][1:] == lines[1][1:], lines
    assert lines[0].endswith("cache elements per rank: 4096")
