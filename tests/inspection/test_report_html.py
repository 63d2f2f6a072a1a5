"""graph.html: one self-contained page, opened in a real headless browser (Debian's
chromium, installed here when missing). Its script builds the summary and the node tables
from the embedded report, so asserting on the rendered DOM shows that it ran. A screenshot
is kept in tests/artifacts/ (git-ignored)."""
import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from fxtp.inspection.report_html import render_html
from tests.helpers import transformer_models as tm
from tests.inspection.test_explain import TOKENS, explained

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="session")
def chromium():
    """Path of a chromium binary; ``apt-get install chromium`` when there is none."""
    found = shutil.which("chromium")
    if found is None:
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        install = subprocess.run("apt-get update && apt-get install -y chromium", shell=True,
                                 env=env, capture_output=True, text=True, timeout=1200)
        found = shutil.which("chromium")
        if found is None:
            pytest.skip(f"no chromium, and `apt-get install -y chromium` failed (exit "
                        f"{install.returncode}): {install.stderr.strip()[-400:]}")
    return found


def browse(chromium, page: Path, tmp_path: Path, *flags: str) -> str:
    run = subprocess.run([chromium, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *flags,
                          page.as_uri()], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


class Dom(HTMLParser):
    """The parts of a rendered page the tests read: ``body`` attributes, node rows
    (name -> classes), and the cell texts of every table with an id and of ``ul#fallbacks``."""

    def __init__(self, text: str):
        super().__init__()
        self.body, self.rows, self.tables, self.fallbacks = {}, {}, {}, []
        self._table = self._cell = None
        self._in_fallbacks = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body":
            self.body = a
        elif tag == "tr" and "node" in a.get("class", "").split():
            self.rows[a["data-name"]] = a["class"].split()
        elif tag == "table" and a.get("id"):
            self._table = self.tables.setdefault(a["id"], [])
        elif tag == "tr" and self._table is not None:
            self._table.append([])
        elif tag in ("td", "th") and self._table is not None:
            self._cell = []
        elif tag == "ul" and a.get("id") == "fallbacks":
            self._in_fallbacks = True
        elif tag == "li" and self._in_fallbacks:
            self.fallbacks.append("")

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._table[-1].append("".join(self._cell))
            self._cell = None
        elif tag == "table":
            self._table = None
        elif tag == "ul":
            self._in_fallbacks = False

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        elif self._in_fallbacks and self.fallbacks:
            self.fallbacks[-1] += data


def test_page_renders_the_summary_and_every_node_in_chromium(chromium, tmp_path):
    report = explained(8, lambda: (tm.llama_8_heads(), tm.llama_plan(seq_parallel=True),
                                   [TOKENS], {}))
    page = tmp_path / "graph.html"
    page.write_text(render_html(report))
    text = page.read_text()
    assert "http://" not in text and "https://" not in text and "<link" not in text
    assert "src=" not in text  # one self-contained file
    dom = Dom(browse(chromium, page, tmp_path, "--dump-dom"))
    assert dom.body.get("data-rendered") == "true"
    assert set(dom.rows) == {n.name for n in report.nodes}
    collectives = {n.name for n in report.nodes if n.collective}
    assert {name for name, classes in dom.rows.items() if "collective" in classes} == \
        collectives
    assert len(collectives) == 14  # 6 gathers, 5 scatters, a norm-weight bucket per block + 1
    assert "p-S" in dom.rows["layers_0_attention_wq_weight"]
    assert "p-P" in dom.rows["linear_3"]  # the rowwise wo's partial sums
    assert "p-R" in dom.rows["tokens"]
    # 8 ranks, fp32 (2, 16, 32) activations of 4 KiB: Megatron's sequence parallelism
    assert dom.tables["collectives"] == [
        ["collective", "forward", "fwd bytes", "backward", "bwd bytes"],
        ["all_gather", "6", "3.5 KiB", "5", "2.5 KiB"],
        ["all_reduce", "0", "0 B", "3", "640 B"],
        ["reduce_scatter", "5", "20.0 KiB", "5", "20.0 KiB"]]
    assert [row[:5] for row in dom.tables["layers"][1:]] == [
        ["tok_embeddings", "1 RS", "4.0 KiB", "1 AG", "512 B"],
        # each block's norm weights' gradient bucket (256 B), the final norm's at the root
        ["layers.0", "2 AG, 2 RS", "9.0 KiB", "2 AG, 1 AR, 2 RS", "9.3 KiB"],
        ["layers.1", "2 AG, 2 RS", "9.0 KiB", "2 AG, 1 AR, 2 RS", "9.3 KiB"],
        ["norm", "-", "0 B", "-", "0 B"],
        ["output", "2 AG", "1.5 KiB", "1 RS", "4.0 KiB"],
        ["<root>", "-", "0 B", "1 AR", "128 B"]]
    assert dom.fallbacks == ["none"]
    shot = tmp_path / "graph.png"
    browse(chromium, page, tmp_path, f"--screenshot={shot}", "--window-size=1400,1000")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(shot, ARTIFACTS / "explain_graph.png")


def test_page_highlights_fallbacks(chromium, tmp_path):
    report = explained(2, "fallback_input_grads")
    page = tmp_path / "graph.html"
    page.write_text(render_html(report))
    dom = Dom(browse(chromium, page, tmp_path, "--dump-dom"))
    (fallback,) = report.summary.fallbacks
    assert "fallback" in dom.rows[fallback.node]
    assert len(dom.fallbacks) == 1 and "aten._fft_r2c.default" in dom.fallbacks[0] and \
        "in 'mix'" in dom.fallbacks[0]
