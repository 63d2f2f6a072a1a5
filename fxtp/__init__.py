"""fxtp: tensor parallelism for PyTorch as a compiler pass over torch.fx graphs."""
from torch.distributed.tensor import Partial, Replicate, Shard

from .causal_lm import generate, parallelize_causal_lm
from .checkpoint import full_state_dict, load_full_state_dict, load_state_dict, state_dict
from .clip import clip_grad_norm_
from .comm_count import count_collectives
from .passes.errors import FxtpError, InputError, PlanError, ShardingError, TraceError
from .explain import explain
from .loss import cross_entropy
from .materialize import init_weights
from .parallelize import parallelize
from .report import Report
from .styles import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                     PrepareModuleInputOutput, PrepareModuleOutput, RowwiseParallel,
                     SequenceParallel)

__all__ = [
    "parallelize", "explain", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
    "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput", "ParallelStyle",
    "Shard", "Replicate", "Partial", "count_collectives", "cross_entropy", "Report",
    "state_dict", "load_state_dict", "full_state_dict", "load_full_state_dict",
    "clip_grad_norm_", "init_weights", "parallelize_causal_lm", "generate", "FxtpError", "InputError", "PlanError",
    "ShardingError", "TraceError",
]

from . import backend  # noqa: E402,F401 - registers the "fxtp" torch.compile backend
