"""How fxtp's passes scale: wall time and peak host memory of ``parallelize`` for Llama-3-8B,
-70B and -405B shapes built on the meta device, under torchtitan's plan (TP + sequence
parallel), at world size 8 on a fake process group (no data moves; the shards stay on the
meta device: the passes alone are measured), and how time grows with the layer count (a
least-squares line, with its R^2). Identical blocks are traced once and stamped
(:mod:`fxtp.frontend.stamping`), whatever the root calls them with: each calling form of
:data:`FORMS` (root buffers passed as they are, slices of them, keywords, a tuple, a root
parameter, tensors computed in the root) is measured apart.

Each point runs in a fresh process, so its peak RSS is its own; a 1-layer model is
parallelized first (the first call in a process pays torch.export's one-time set-up,
reported as ``first_call_setup_s``), then the timed one three times, each a new model: a
point's time is the least of the three (``seconds_each``: all three).

    python -m benchmarks.passes_scale           # 8B at 4..32 layers, 70B at 80, 405B at 126
    python -m benchmarks.passes_scale --quick   # 8B at 2 and 4 layers
    python -m benchmarks.passes_scale --form buffers --form kwargs   # those forms only

The import times of ``torch``, of ``fxtp`` alone and of ``fxtp`` with its plan vocabulary
(which loads torch and ``torch.distributed.tensor``; fresh processes, median of 5) are
recorded beside them (``import_s``), and the end-to-end time of ``python -m fxtp explain`` on the 8B
shape (``explain_cli_s``).

Results: ``benchmarks/results/passes_scale.json`` and ``passes_scale.png``.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import subprocess
import sys

import torch
import torch.nn as nn

from fxtp.examples.llama import Llama, LlamaConfig, TransformerBlock
from fxtp.passes.graph import STAMPED

RESULTS = pathlib.Path(__file__).parent / "results"
SHAPES = {  # Meta's Llama-3 configurations
    "8B": dict(dim=4096, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=1024,
               ffn_dim_multiplier=1.3),
    "70B": dict(dim=8192, n_heads=64, n_kv_heads=8, vocab_size=128256, multiple_of=4096,
                ffn_dim_multiplier=1.3),
    "405B": dict(dim=16384, n_heads=128, n_kv_heads=8, vocab_size=128256, multiple_of=4096,
                 ffn_dim_multiplier=1.2),
}
TARGETS_S = {"8B": 3.0, "70B": 5.0, "405B": 8.0}  # at full depth: 32, 80, 126 layers
TARGET_SLOPE_S = 0.02  # per extra identical layer
TARGET_EXPLAIN_S = 6.0
FORMS = {
    "sliced": "slices of the root's rotary tables, as one pair (fxtp's Llama)",
    "buffers": "the root's rotary tables as they are, positionally",
    "tuple": "the root's rotary tables as they are, as one pair",
    "kwargs": "the root's rotary tables as they are, by keyword",
    "parameter": "the root's rotary tables and a root parameter, as they are",
    "computed": "rotary tables and a padding mask computed in the root (Hugging Face)",
}


class ArgsBlock(TransformerBlock):
    """A Llama block given rotary tables at least as long as its input, and optionally a
    factor of its input (a padding mask, a learned scale)."""

    def forward(self, x, cos, sin=None, scale=None):
        """``cos`` and ``sin``, or ``cos`` the pair of them."""
        cos, sin = cos if sin is None else (cos, sin)
        if scale is not None:
            x = x * scale
        t = x.shape[1]
        return super().forward(x, (cos[:t], sin[:t]))


class ArgsLlama(Llama):
    """fxtp's Llama (``rope="real"``) whose root calls its blocks in calling ``form``, a
    key of :data:`FORMS`."""

    def __init__(self, cfg: LlamaConfig, form: str):
        super().__init__(cfg)
        self.form = form
        self.layers = nn.ModuleList(ArgsBlock(cfg) for _ in range(cfg.n_layers))
        if form == "parameter":
            self.scale = nn.Parameter(torch.ones(cfg.dim))

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        t = tokens.shape[1]
        kwargs = {}
        if self.form == "sliced":
            args = ((self.cos[:t], self.sin[:t]),)
        elif self.form == "buffers":
            args = (self.cos, self.sin)
        elif self.form == "tuple":
            args = ((self.cos, self.sin),)
        elif self.form == "kwargs":
            args, kwargs = (), {"cos": self.cos, "sin": self.sin}
        elif self.form == "parameter":
            args = (self.cos, self.sin, self.scale)
        else:  # "computed"
            positions = torch.arange(t, device=self.cos.device)
            args = ((self.cos[positions], self.sin[positions]),)
            kwargs = {"scale": (tokens != 0).unsqueeze(-1).to(h)}
        for layer in self.layers:
            h = layer(h, *args, **kwargs)
        return self.output(self.norm(h))


def one(shape: str, layers: int, form: str = "sliced", world: int = 8,
        repeats: int = 3) -> dict:
    """Run in this process: parallelize one meta model calling its blocks in ``form``,
    ``repeats`` times (a new model each); return the least time (what other work on a
    shared machine adds is left out), every time and peak RSS."""
    import resource
    import time

    import fxtp
    from fxtp.kernels.torch_compat import init_fake_process_group
    from fxtp.examples.llama import llama_sp_plan
    init_fake_process_group(world, rank=world - 1)
    tokens = torch.randint(0, 100, (1, 16))
    start = time.perf_counter()  # first use in a process: torch.export's one-time set-up
    with torch.device("meta"):
        small = ArgsLlama(LlamaConfig(n_layers=1, max_seq_len=64, **SHAPES[shape]), form)
    fxtp.parallelize(small, llama_sp_plan(), example_inputs=(tokens,), device="meta")
    warm_up = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        with torch.device("meta"):
            model = ArgsLlama(LlamaConfig(n_layers=layers, max_seq_len=64, **SHAPES[shape]),
                              form)
        start = time.perf_counter()
        gm = fxtp.parallelize(model, llama_sp_plan(), example_inputs=(tokens,), device="meta")
        times.append(time.perf_counter() - start)
    return {"shape": shape, "layers": layers, "form": form, "seconds": min(times),
            "seconds_each": times, "first_call_setup_s": warm_up,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "graph_nodes": len(gm.graph.nodes), "stamped": len(gm.meta[STAMPED]),
            "params_global": sum(p.numel() for p in model.parameters())}


IMPORTS = {"torch": "import torch", "fxtp": "import fxtp",  # fxtp loads torch on first use
           "fxtp+styles": "import fxtp; fxtp.ColwiseParallel"}  # what a plan needs


def import_seconds(statement: str, repeats: int = 5) -> float:
    """Median wall time of ``statement`` (imports) in a fresh Python process."""
    import statistics
    code = (f"import time; t = time.perf_counter(); {statement}; "
            f"print(time.perf_counter() - t)")
    return statistics.median(
        float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True).stdout) for _ in range(repeats))


def explain_cli_seconds(repeats: int = 3) -> float:
    """Median wall time of the README's ``python -m fxtp explain`` of the 8B shape (a new
    process each: imports included)."""
    import statistics
    import time
    command = [sys.executable, "-m", "fxtp", "explain", "--model",
               "benchmarks.explain_llama:model", "--plan", "benchmarks.explain_llama:plan",
               "--world-size", "8", "--input", "1x8192:int64", "--seq-parallel"]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(command, capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def point(shape: str, layers: int, form: str) -> dict:
    """:func:`one` in a fresh process; a ``RuntimeError`` saying how it failed."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.passes_scale", "--one", shape,
                          str(layers), form], capture_output=True, text=True)
    if out.returncode:
        lines = out.stderr.strip().splitlines() or ["(no error output)"]
        error = next((m.group(0) for m in map(re.compile(r"\w+Error: .*").search,
                                                reversed(lines)) if m), lines[-1])
        raise RuntimeError(f"{shape} with {layers} layers: {error}")
    p = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{shape:>4} {layers:3d} layers: {p['seconds']:7.2f} s, peak RSS "
          f"{p['peak_rss_mib']:8.0f} MiB, {p['graph_nodes']} nodes, {p['stamped']} stamped",
          flush=True)
    return p


def fit(points: list[dict]) -> dict:
    """Least squares ``seconds = a + b * layers`` and its R^2."""
    xs, ys = [p["layers"] for p in points], [p["seconds"] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys) or 1.0
    return {"intercept_s": a, "seconds_per_layer": b, "r2": 1 - ss_res / ss_tot}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--form", action="append", choices=FORMS,
                        help="a calling form to measure (repeatable; default: all): " +
                        "; ".join(f"{k}: {v}" for k, v in FORMS.items()))
    parser.add_argument("--one", nargs=3, metavar=("SHAPE", "LAYERS", "FORM"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), args.one[2])))
        return None
    runs = [("8B", 2), ("8B", 4)] if args.quick else \
        [("8B", n) for n in (4, 8, 16, 32)] + [("70B", 80), ("405B", 126)]
    points, fits, failed = [], {}, {}
    for form in args.form or FORMS:
        print(f"{form}: {FORMS[form]}")
        try:
            points += [point(shape, layers, form) for shape, layers in runs]
        except RuntimeError as e:
            failed[form] = str(e)
            print(f"failed: {e}")
            continue
        fits[form] = line = fit([p for p in points if p["shape"] == "8B" and
                                 p["form"] == form])
        print(f"8B: {line['seconds_per_layer']:.3f} s/layer + {line['intercept_s']:.2f} s "
              f"(R^2 {line['r2']:.4f})")
    imports = {name: import_seconds(statement) for name, statement in IMPORTS.items()}
    print("import: " + ", ".join(f"{m} {t:.2f} s" for m, t in imports.items()))
    cli = explain_cli_seconds()
    print(f"python -m fxtp explain, 8B shape, world 8, sequence parallel: {cli:.2f} s")
    report = {"world": 8, "plan": "llama_sp_plan", "forms": {f: FORMS[f] for f in fits},
              "points": points, "fit_8B": fits, "failed": failed, "targets_s": TARGETS_S,
              "target_slope_s": TARGET_SLOPE_S, "import_s": imports, "explain_cli_s": cli,
              "target_explain_s": TARGET_EXPLAIN_S}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "passes_scale.json").write_text(json.dumps(report, indent=2))
    plot(points, fits, RESULTS / "passes_scale.png")
    return report


def plot(points: list[dict], fits: dict[str, dict], path: pathlib.Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no {path.name}")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    top = max(p["layers"] for p in points)
    for (form, line), color in zip(fits.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        for shape, marker in (("8B", "o"), ("70B", "s"), ("405B", "^")):
            mine = [p for p in points if p["shape"] == shape and p["form"] == form]
            ax.plot([p["layers"] for p in mine], [p["seconds"] for p in mine], marker,
                    color=color)
        ax.plot([0, top], [line["intercept_s"],
                           line["intercept_s"] + line["seconds_per_layer"] * top],
                "--", color=color, label=f"{form}: {line['seconds_per_layer']:.3f} s/layer (8B)")
    ax.axhline(TARGETS_S["8B"], color="grey", lw=0.5)
    ax.set_xlabel("layers (o 8B, s 70B, ^ 405B shapes)")
    ax.set_ylabel("parallelize wall time (s)")
    ax.set_title("fxtp passes, world 8 (fake group), meta device")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
