"""The runnable scripts of the README and of docs/ (each a ```python block starting
``# save as NAME``) run exactly as written, under torchrun with 2 ranks (4 for the
scaling-out recipe); every such script is one a test here runs."""
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SCRIPTS = {"quickstart.py", "derive.py", "plans.py", "scale_out.py", "serve.py"}  # tests run


def saved_scripts() -> dict[str, list[str]]:
    """Each ``# save as NAME`` script of the README and docs/: name -> its texts."""
    found: dict[str, list[str]] = {}
    for page in PAGES:
        for m in re.finditer(r"```python\n(# save as (\S+?)[,;:\s].*?)```", page.read_text(),
                             re.S):
            found.setdefault(m.group(2), []).append(m.group(1))
    return found


EXIT_ABORT = "terminate called without an active exception"


def torchrun(script: Path, ranks: int, logs: Path, **env) -> subprocess.CompletedProcess:
    """``script`` under torchrun with ``ranks`` ranks, each rank's stdout and stderr in files
    under ``logs``. A run is retried once if its only fault is torch's gloo teardown abort at
    interpreter exit (``EXIT_ABORT`` after the script's last line): in torch 2.13 a functional
    collective keeps the process group alive past ``destroy_process_group``, so its threads
    are torn down during finalization, which aborts now and then on a loaded machine."""
    def once(attempt):
        return subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
             "--standalone", "--log-dir", str(logs / str(attempt)), "--redirects", "3",
             str(script)], cwd=script.parent, capture_output=True, text=True, timeout=600,
            env=dict(os.environ, OMP_NUM_THREADS="1", **env))
    run = once(0)
    aborted = [f.read_text().rstrip().endswith(EXIT_ABORT) for f in logs.rglob("stderr.log")]
    if run.returncode != 0 and any(aborted):
        warnings.warn(f"{script.name}: a rank aborted at exit ({EXIT_ABORT!r}); run again")
        run = once(1)
    return run


def run_readme_script(tmp_path, name: str, ranks: int = 2, **env):
    """The ``# save as <name>`` script of the README or docs/, run under torchrun: each
    rank's stdout and stderr (one file each per rank, so their prints cannot interleave). A
    failed run reports every rank's logs, so that a crash says which rank died where."""
    [code] = saved_scripts()[name]
    script = tmp_path / name
    script.write_text(code.replace('tempfile.gettempdir() + "/fxtp_scale_out"',
                                   repr(str(tmp_path / "checkpoint"))))
    logs = tmp_path / "logs"
    run = torchrun(script, ranks, logs, **env)
    last = max(logs.iterdir(), key=lambda d: d.name)
    out, err = ({int(f.parent.name): f.read_text() for f in last.rglob(stream)}
                for stream in ("stdout.log", "stderr.log"))
    shown = "".join(f"\n--- rank {r} stdout ---\n{out.get(r, '')[-1500:]}"
                    f"\n--- rank {r} stderr ---\n{err.get(r, '')[-3000:]}" for r in range(ranks))
    assert run.returncode == 0, run.stderr[-2000:] + shown
    assert sorted(out) == list(range(ranks)), shown
    return out, err


def test_every_saved_script_is_one_a_test_runs_and_appears_once():
    found = saved_scripts()
    assert set(found) == SCRIPTS
    assert all(len(texts) == 1 for texts in found.values())
    # a "# save as" line outside a ```python block opening with it would escape the tests
    lines = [line for page in PAGES for line in page.read_text().splitlines()
             if line.lstrip().startswith("# save as")]
    assert len(lines) == len(SCRIPTS), lines


def test_quick_start_runs_as_written(tmp_path):
    out, _ = run_readme_script(tmp_path, "quickstart.py")
    lines = [next(line.split() for line in out[r].splitlines() if line.startswith(f"{r} "))
             for r in (0, 1)]
    assert lines[0][1] == lines[1][1]  # the same loss on both ranks
    assert all(line[2:] == ["(32,", "16)"] for line in lines)
    assert "fxtp_kernels_collectives_all_reduce" in out[0]


def test_deriving_a_plan_runs_as_written(tmp_path):
    out, _ = run_readme_script(tmp_path, "derive.py")
    assert ["layers.*.feed_forward.w2", "RowwiseParallel()"] in \
        [line.split() for line in out[0].splitlines()]
    assert " 0 fallbacks" in out[0]
    losses = [[float(line.split()[-1]) for line in out[rank].splitlines() if " loss " in line]
              for rank in (0, 1)]
    assert losses[0] == losses[1] and len(losses[0]) == 3 and losses[0][-1] < losses[0][0]


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
    out, _ = run_readme_script(tmp_path, "scale_out.py", ranks=4, TORCHDYNAMO_DISABLE="1")
    assert re.search(r"^loss [\d.]+ norm [\d.]+$", out[0], re.M), out[0]


def test_explain_output_shown_is_the_quick_starts(fake_group):
    """The `print(fxtp.explain(gm))` output docs/inspecting.md shows is what the README's
    quick-start MLP gives."""
    import torch

    import fxtp
    readme = (ROOT / "README.md").read_text()
    quick_start = re.search(r"# save as quickstart\.py.*?```", readme, re.S).group(0)
    imports = re.search(r"^import torch.*$", quick_start, re.M).group(0)
    mlp = re.search(r"^class MLP.*?return .*?$", quick_start, re.S | re.M).group(0)
    namespace = {}
    exec(imports + "\n" + mlp, namespace)
    inspecting = (ROOT / "docs" / "inspecting.md").read_text()
    shown = re.search(r"print\(fxtp\.explain\(gm\)\)\n```\n\n```text\n(.*?)```", inspecting,
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


ABORTS_ONCE = """import os, sys
from pathlib import Path
print("done", os.environ["RANK"], flush=True)
marker = Path(__file__).with_name("aborted" + os.environ["RANK"])
if os.environ["RANK"] == "1" and not marker.exists():
    marker.touch()
    sys.stderr.write({message!r} + "\\n"); sys.stderr.flush()
    os.abort()
"""


def test_only_the_gloo_exit_abort_is_run_again(tmp_path):
    script = tmp_path / "exit_abort.py"
    script.write_text(ABORTS_ONCE.format(message=EXIT_ABORT))
    with pytest.warns(UserWarning, match="aborted at exit"):
        assert torchrun(script, 2, tmp_path / "logs").returncode == 0
    other = tmp_path / "other" / "other_abort.py"
    other.parent.mkdir()
    other.write_text(ABORTS_ONCE.format(message="Segmentation fault"))
    assert torchrun(other, 2, other.parent / "logs").returncode != 0


def test_the_torch_floor_subset_the_readme_names_is_the_one_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    run = set(re.findall(r"tests/\w+/(test_\w+)\.py", ci[ci.index("torch==2.11"):]))
    readme = (ROOT / "README.md").read_text()
    policy = readme[readme.index("## Torch versions"):readme.index("## Documents")]
    docs = (ROOT / "docs" / "torch-versions.md").read_text()
    docs = docs[:docs.index("## What 2.11 does differently")]
    assert run and set(re.findall(r"`(test_\w+)`", policy)) == run
    assert set(re.findall(r"`(test_\w+)`", docs)) == run
