"""``python -m fxtp COMMAND``: fxtp's command line.

``demo`` trains a small Llama with TP + sequence parallel + loss parallel next to the
single-device model (2 gloo CPU ranks spawned, or the ranks of ``torchrun``)::

    python -m fxtp demo [--steps 30] [--batch 4] [--world 2]

``explain`` checks a plan without a cluster: the model is built on the meta device (no
memory, no data), the passes run on a fake process group of ``--world-size`` ranks in this
process, and the report of one rank is printed::

    python -m fxtp explain --model pkg.module:factory --plan pkg.module:plan_fn \\
        --world-size 8 --input 8x2048:int64 [--seq-parallel] [--dump-dir d] [--json]
    python -m fxtp explain --hf-config LlamaConfig --plan derive --compare auto \\
        --world-size 8 --input 1x2048:int64

``factory()`` returns the model, or ``--hf-config`` names a Hugging Face config to build a
causal LM from (no weights); ``plan_fn()`` returns the plan (``plan_fn(seq_parallel=True)``
with ``--seq-parallel``); a plan dict may be named instead of a function, or ``auto`` (the
model's own Hugging Face plan) or ``derive`` (:func:`fxtp.derive_plan`'s plan, printed
first); ``--compare`` prints what another plan sends and holds beside it. Each
``--input`` is one positional example input, ``SHAPE[:DTYPE]`` (``2x16:int64``; float32
by default), made on the meta device; without any, one ``1x16:int64`` batch of token ids.

A subcommand is a function that adds its parser to the subparsers and sets ``run`` (a
function of the parsed arguments returning the exit status); list it in ``COMMANDS``.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from contextlib import contextmanager
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .inspection.explanation import explain
from .kernels.torch_compat import init_fake_process_group
from .passes.errors import FxtpError
from .pipeline import parallelize
from .planning.derive import compared, derive_plan, place_plans


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fxtp",
                                     description="fxtp: tensor parallelism as graph passes")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(commands)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except FxtpError as e:
        print(f"python -m fxtp {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


# --- explain ------------------------------------------------------------------------------

def add_explain(commands) -> None:
    p = commands.add_parser("explain", help="print what fxtp does to a model under a plan, "
                            "on the meta device and a fake process group",
                            description=__doc__.split("\n\n")[1])
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", metavar="MODULE:FACTORY",
                       help="a function (or class) returning the model, e.g. "
                            "tests.helpers.transformer_models:Llama")
    model.add_argument("--hf-config", metavar="PATH_OR_CLASS",
                       help="a Hugging Face causal LM built from its config alone (no "
                            "weights): a config file or directory, or a config class such "
                            "as LlamaConfig (its defaults)")
    p.add_argument("--plan", required=True, metavar="MODULE:PLAN",
                   help="a function returning the plan (called with seq_parallel=True under "
                        "--seq-parallel), a plan dict, 'auto' (a Hugging Face model's own) "
                        "or 'derive' (fxtp.derive_plan's, printed first)")
    p.add_argument("--compare", metavar="MODULE:PLAN",
                   help="also place this plan and print what each sends and holds")
    p.add_argument("--world-size", required=True, type=int, help="tensor-parallel ranks")
    p.add_argument("--input", action="append", type=example_input, metavar="SHAPE[:DTYPE]",
                   help="one positional example input, e.g. 2x16:int64 (float32 if no "
                   f"dtype); repeat for more inputs (default: {DEFAULT_INPUT}, a batch of "
                   f"token ids for a language model)")
    p.add_argument("--seq-parallel", action="store_true",
                   help="call the plan function as plan_fn(seq_parallel=True)")
    p.add_argument("--rank", type=int, default=0, help="the rank whose view is reported")
    p.add_argument("--dump-dir", help="also write every stage, report.json and graph.html")
    p.add_argument("--json", action="store_true", help="print report.json instead of tables")
    p.set_defaults(run=run_explain)


DEFAULT_INPUT = "1x16:int64"


def run_explain(args) -> int:
    args.input = args.input or [example_input(DEFAULT_INPUT)]
    with torch.device("meta"):
        model = hf_model(args.hf_config) if args.hf_config else load(args.model)()
    kwargs = {"use_cache": False} if args.hf_config else None
    if args.plan == "derive":
        plan = derive_plan(model, example_inputs=args.input, example_kwargs=kwargs,
                           world_size=args.world_size, sequence_parallel=args.seq_parallel)
        if not args.json:
            print(f"derived plan:\n{plan}\n")
    else:
        plan = plan_of(args.plan, args.seq_parallel)
    if args.compare:
        plans = {args.plan: plan, args.compare: plan_of(args.compare, args.seq_parallel)}
        print(compared(place_plans(model, plans, example_inputs=args.input,
                                   example_kwargs=kwargs, world_size=args.world_size)) + "\n")
    with fake_group(args.world_size, args.rank):
        gm = parallelize(model, plan, example_inputs=args.input, example_kwargs=kwargs,
                         dump_dir=args.dump_dir, device="meta")
        report = explain(gm)
    print(report.to_json() if args.json else report)
    return 0


def plan_of(spec: str, seq_parallel: bool):
    """The plan ``spec`` names: ``"auto"``, or ``MODULE:PLAN`` (a plan function, called with
    ``seq_parallel=True`` where asked, or a plan dict)."""
    if spec == "auto":
        return spec
    plan = load(spec)
    if callable(plan):
        return plan(seq_parallel=True) if seq_parallel else plan()
    if seq_parallel:
        raise SystemExit(f"--seq-parallel needs a plan function; {spec} is not callable")
    return plan


def hf_model(spec: str) -> torch.nn.Module:
    """A Hugging Face causal LM built from a config (a file, a directory, or a config class
    of ``transformers`` with its defaults), on the current device."""
    import transformers
    if hasattr(transformers, spec):
        config = getattr(transformers, spec)()
    else:
        config = transformers.AutoConfig.from_pretrained(spec)
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config)


def load(spec: str):
    """``package.module:name.attr`` -> that object (importable from the current
    directory)."""
    module, sep, name = spec.partition(":")
    if not sep or not name:
        raise SystemExit(f"expected MODULE:NAME (e.g. tests.helpers.transformer_models:Llama), got "
                         f"{spec!r}")
    try:
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"cannot load {spec}: {type(e).__name__}: {e}") from e
    return obj


def example_input(spec: str) -> torch.Tensor:
    """``2x16:int64`` -> an int64 (2, 16) tensor on the meta device."""
    shape, _, dtype_name = spec.partition(":")
    dtype = getattr(torch, dtype_name or "float32", None)
    try:
        sizes = [int(s) for s in shape.split("x")]
    except ValueError:
        sizes = None
    if not isinstance(dtype, torch.dtype) or sizes is None:
        raise argparse.ArgumentTypeError(f"expected SHAPE[:DTYPE] such as 2x16:int64, got "
                                         f"{spec!r}")
    return torch.empty(sizes, dtype=dtype, device="meta")


@contextmanager
def fake_group(world_size: int, rank: int = 0):
    """A fake process group of ``world_size`` ranks in this process (shapes only)."""
    if dist.is_initialized():
        raise SystemExit("a process group is already initialized; run the fxtp command "
                         "line in a fresh process")
    init_fake_process_group(world_size, rank)
    try:
        yield
    finally:
        dist.destroy_process_group()


# --- demo ---------------------------------------------------------------------------------

def add_demo(commands) -> None:
    from .examples import demo
    p = commands.add_parser("demo", help="train a small Llama with TP + sequence parallel + "
                            "loss parallel next to the single-device model",
                            description=demo.__doc__.split("\n\n")[0])
    demo.add_arguments(p)
    p.set_defaults(run=run_demo)


def run_demo(args) -> int:
    from .examples import demo
    demo.main(args)
    return 0


COMMANDS: list[Callable] = [add_demo, add_explain]
