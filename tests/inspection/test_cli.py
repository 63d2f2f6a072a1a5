"""`python -m fxtp explain`: an 8-rank plan checked in one process, on the meta device and a
fake process group, with no cluster and no parameter memory."""
import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxtp.cli import example_input, main
from fxtp.inspection.report import Report
from tests.helpers import transformer_models as tm

ROOT = Path(__file__).resolve().parents[2]
L, B, T, D, V, WORLD = 2, 2, 16, 32, 64, 8
ACTIVATION = B * T * D * 4  # fp32 (B, T, D)
LLAMA = ["--model", "tests.helpers.transformer_models:llama_8_heads",
         "--plan", "tests.helpers.transformer_models:llama_plan", "--input", f"{B}x{T}:int64"]


def fxtp_cli(*args):
    env = {k: v for k, v in os.environ.items() if k != "FXTP_DUMP_DIR"}
    return subprocess.run([sys.executable, "-m", "fxtp", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**env, "OMP_NUM_THREADS": "1"})


def test_explain_an_8_rank_sequence_parallel_llama_plan(tmp_path):
    run = fxtp_cli("explain", *LLAMA, "--world-size", str(WORLD), "--seq-parallel", "--json",
                   "--dump-dir", str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    report = Report.from_json(run.stdout)
    s = report.summary
    assert s.world_size == WORLD
    assert s.forward.counts == {"all_gather": 2 * L + 2, "reduce_scatter": 2 * L + 1}
    assert s.forward.bytes == {"all_gather": (2 * L + 1) * ACTIVATION // WORLD
                               + B * T * V // WORLD * 4,
                               "reduce_scatter": (2 * L + 1) * ACTIVATION}
    assert s.backward.counts == {"all_gather": 2 * L + 1, "reduce_scatter": 2 * L + 1,
                                 "all_reduce": L + 1}  # a bucket per block, one for the rest
    assert s.backward.bytes == {"all_gather": (2 * L + 1) * ACTIVATION // WORLD,
                                "reduce_scatter": (2 * L + 1) * ACTIVATION,
                                "all_reduce": (2 * L + 1) * D * 4}
    count = sum(p.numel() for p in tm.llama_8_heads().parameters())
    assert (s.param_bytes, s.param_bytes_unsharded) == \
        (((count - 5 * D) // WORLD + 5 * D) * 4, count * 4)  # all sharded but 5 norm weights
    nodes = {n.name: n for n in report.nodes}
    assert nodes["layers_0_feed_forward_w1_weight"].local_shape == [96 // WORLD, D]
    assert nodes["reduce_scatter"].local_shape == [B, T // WORLD, D]
    assert (tmp_path / "report.json").read_text() == report.to_json()
    assert {p.name for p in tmp_path.iterdir()} == {
        "01_traced.py", "02_placements.txt", "03_rewritten.py", "04_localized.py",
        "report.txt", "report.json", "graph.html"}


def test_explain_prints_the_tables_of_the_plain_tensor_parallel_plan(capsys):
    assert main(["explain", *LLAMA, "--world-size", str(WORLD)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    summary = lines[lines.index(next(l for l in lines if l.startswith("Collectives per"))):]
    rows = {line.split()[0]: line.split()[1:] for line in summary[3:5]}
    assert rows == {"all_gather": ["1", "1.0", "KiB", "0", "0", "B"],  # the logits
                    "all_reduce": [str(2 * L + 1), "20.0", "KiB", str(2 * L + 1), "20.0",
                                   "KiB"]}
    # 30880 fp32 parameters, all sharded but the 5 norm weights: (30880 - 5 D) / 8 + 5 D
    assert "parameters per rank: 15.6 KiB of 120.6 KiB unsharded (13.0%)" in out


def test_plan_errors_are_reported_without_a_traceback(capsys):
    assert main(["explain", *LLAMA, "--world-size", "128"]) == 1
    assert capsys.readouterr().err.startswith(
        "python -m fxtp explain: PlanError: parameter 'tok_embeddings.weight' "
        "(RowwiseParallel) is sharded on dim 0 of size 64, which is smaller than the "
        "world size 128")


def test_a_missing_factory_is_named():
    with pytest.raises(SystemExit, match="cannot load tests.helpers.transformer_models:Nope: "
                                         "AttributeError"):
        main(["explain", "--model", "tests.helpers.transformer_models:Nope", "--plan",
              "tests.helpers.transformer_models:llama_plan", "--input", "2x16:int64",
              "--world-size", "2"])


def test_inputs_are_shapes_with_an_optional_dtype():
    x = example_input("2x16:int64")
    assert (x.shape, x.dtype, x.device.type) == ((2, 16), torch.int64, "meta")
    assert example_input("3").dtype == torch.float32
    with pytest.raises(argparse.ArgumentTypeError, match="SHAPE"):
        example_input("2x16:int65")


def test_explain_derives_a_plan_prints_it_and_compares_it_with_a_given_one(capsys):
    assert main(["explain", "--model", "tests.helpers.transformer_models:llama_8_heads",
                 "--plan", "derive", "--compare", "tests.helpers.transformer_models:llama_plan",
                 "--input", f"{B}x{T}:int64", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    derived = out[:out.index("\n\n")].splitlines()
    assert derived[0] == "derived plan:"
    assert [line.split() for line in derived if "feed_forward.w2" in line] == [
        ["layers.*.feed_forward.w2", "RowwiseParallel()"]]
    table = out.splitlines()[len(derived) + 1:len(derived) + 4]
    assert [row.split()[:2] for row in table] == [
        ["plan", "fallbacks"], ["derive", "0"],
        ["tests.helpers.transformer_models:llama_plan", "0"]]
    assert "fxtp.explain:" in out


def test_explain_builds_a_hugging_face_model_from_its_config_alone(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    config.save_pretrained(tmp_path)
    assert main(["explain", "--hf-config", str(tmp_path), "--plan", "derive", "--compare",
                 "auto", "--world-size", "2", "--input", "1x16:int64"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.*.mlp.down_proj" in out and "fallbacks" in out
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines()
            if line.split()[:1] in (["derive"], ["auto"])}
    assert rows == {"derive": "0", "auto": "0"}
