"""Stage dumps: parallelize(..., dump_dir=d) or FXTP_DUMP_DIR=d writes every stage's result
and the report; files the ranks agree on are written once, the others per rank."""
import json
import warnings

import pytest
import torch

import fxtp
from fxtp.inspection.report import Report
from tests.helpers import transformer_models as tm
from tests.helpers.models import UNRULED_PLAN, Unruled

TOKENS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
SHARED = ["01_traced.py", "02_placements.txt", "graph.html", "report.json", "report.txt"]


def llama():
    return tm.Llama(tm.LlamaConfig(n_heads=8, n_kv_heads=4))


def dump(rank, world, directory):
    gm = fxtp.parallelize(llama(), tm.llama_plan(seq_parallel=True), example_inputs=(TOKENS,),
                          dump_dir=directory)
    return fxtp.explain(gm).to_json()


def test_ranks_write_shared_files_once_and_rank_specific_code_per_rank(ranks4, tmp_path):
    reports = ranks4.run(dump, str(tmp_path))
    per_rank = [f"{stage}.rank{r}.py" for stage in ("03_rewritten", "04_localized")
                for r in range(4)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(SHARED + per_rank)
    assert (tmp_path / "report.json").read_text() == reports[0]
    assert Report.from_json(reports[0]).summary.forward.counts == \
        {"all_gather": 2 * 2 + 2, "reduce_scatter": 2 * 2 + 1}
    # the rewritten code differs by the rank its collectives and local ops take
    rewritten = [(tmp_path / f"03_rewritten.rank{r}.py").read_text() for r in range(4)]
    assert len(set(rewritten)) == 4
    for r, code in enumerate(rewritten):
        assert f"fxtp_kernels_collectives_all_gather(mul_1, dim = 1, rank = {r}, world = 4, " \
            in code
    assert "fxtp_kernels_collectives" not in (tmp_path / "01_traced.py").read_text()
    placements = (tmp_path / "02_placements.txt").read_text()
    assert "layers.0.attention input 0" in placements  # the boundary the plan asks for
    assert "fxtp_kernels_collectives" in (tmp_path / "04_localized.rank0.py").read_text()


def test_the_environment_variable_dumps_and_one_process_writes_shared_names(
        fake_group, tmp_path, monkeypatch):
    """On the fake backend (shape checks in one process) this rank, whichever it is, writes
    every file under the shared name, and removes per-rank copies a real run left there."""
    fake_group(4, rank=3)
    (tmp_path / "03_rewritten.rank1.py").write_text("stale")
    monkeypatch.setenv("FXTP_DUMP_DIR", str(tmp_path))
    gm = fxtp.parallelize(llama(), tm.llama_plan(), example_inputs=(TOKENS,))
    assert sorted(p.name for p in tmp_path.iterdir()) == \
        sorted(SHARED + ["03_rewritten.py", "04_localized.py"])
    assert (tmp_path / "04_localized.py").read_text() == gm.code.lstrip("\n")
    assert json.loads((tmp_path / "report.json").read_text()) == fxtp.explain(gm).to_dict()
    assert (tmp_path / "report.txt").read_text() == str(fxtp.explain(gm))


def test_a_failing_stage_leaves_the_stages_before_it_and_the_error(fake_group, tmp_path):
    fake_group(2)
    with pytest.raises(fxtp.ShardingError), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fxtp.parallelize(Unruled(), UNRULED_PLAN, example_inputs=(torch.randn(2, 4, 16),),
                         strict=True, dump_dir=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["01_traced.py", "error.txt"]
    error = (tmp_path / "error.txt").read_text()
    assert "ShardingError" in error and "aten._fft_r2c.default" in error and "'mix'" in error


def test_no_directory_no_files(fake_group, tmp_path, monkeypatch):
    fake_group(2)
    monkeypatch.delenv("FXTP_DUMP_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    fxtp.parallelize(llama(), tm.llama_plan(), example_inputs=(TOKENS,))
    assert list(tmp_path.iterdir()) == []
