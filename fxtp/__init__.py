"""fxtp: tensor parallelism for PyTorch as a compiler pass over torch.fx graphs.

``import fxtp`` loads its errors only; every other name loads its module on first use:
the plan vocabulary (styles, placements) with ``torch.distributed.tensor``, the names that
trace, rewrite or compile (``fxtp.parallelize``, ``fxtp.explain``, ...) with
``torch.export`` and dynamo. The ``"fxtp"`` torch.compile
backend is a ``torch_dynamo_backends`` entry point (setup.cfg): ``torch.compile(...,
backend="fxtp")`` finds it by name.
"""
import importlib as _importlib

from .passes.errors import (FxtpError, InputError, PlanError, RankError, ShardingError,
                            TraceError)

_ON_FIRST_USE = {
    **dict.fromkeys(["ColwiseParallel", "RowwiseParallel", "SequenceParallel",
                     "ExpertTensorParallel",
                     "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput",
                     "ParallelStyle", "Shard", "Replicate", "Partial"], ".plans.styles"),
    "count_collectives": ".inspection.comm_count", "Report": ".inspection.report",
    "parallelize": ".pipeline", "explain": ".inspection.explanation",
    "derive_plan": ".planning.derive",
    "cross_entropy": ".edges.loss",
    "state_dict": ".edges.checkpoint", "load_state_dict": ".edges.checkpoint",
    "full_state_dict": ".edges.checkpoint", "load_full_state_dict": ".edges.checkpoint",
    "clip_grad_norm_": ".edges.clip", "init_weights": ".edges.materialize",
    "fsdp_shard_placement": ".edges.dtensor_params",
    "parallelize_causal_lm": ".serving.causal_lm", "generate": ".serving.causal_lm",
    "compile": ".compiling.regional", "compile_blocks": ".compiling.regional",
    "local_parameters": ".edges.local_steps",
}
"""Public name -> the module that defines it, imported when the name is first read."""

__all__ = [
    "parallelize", "derive_plan", "explain", "ColwiseParallel", "RowwiseParallel",
    "SequenceParallel", "ExpertTensorParallel",
    "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput", "ParallelStyle",
    "Shard", "Replicate", "Partial", "count_collectives", "cross_entropy", "Report",
    "state_dict", "load_state_dict", "full_state_dict", "load_full_state_dict",
    "clip_grad_norm_", "init_weights", "fsdp_shard_placement", "local_parameters",
    "parallelize_causal_lm", "generate",
    "compile", "compile_blocks", "FxtpError",
    "InputError", "PlanError", "RankError", "ShardingError", "TraceError",
]


def __getattr__(name: str):
    if name not in _ON_FIRST_USE:
        raise AttributeError(f"module 'fxtp' has no attribute {name!r}")
    value = getattr(_importlib.import_module(_ON_FIRST_USE[name], __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted({n for n in globals() if not n.startswith("_")} | set(_ON_FIRST_USE))

