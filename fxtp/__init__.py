"""fxtp: tensor parallelism for PyTorch as a compiler pass over torch.fx graphs."""
from torch.distributed.tensor import Partial, Replicate, Shard

from .comm_count import count_collectives
from .errors import FxtpError, PlanError, ShardingError, TraceError
from .parallelize import parallelize
from .styles import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                     PrepareModuleInputOutput, PrepareModuleOutput, RowwiseParallel)

__all__ = [
    "parallelize", "ColwiseParallel", "RowwiseParallel", "PrepareModuleInput",
    "PrepareModuleOutput", "PrepareModuleInputOutput", "ParallelStyle", "Shard", "Replicate",
    "Partial", "count_collectives", "FxtpError", "PlanError", "ShardingError", "TraceError",
]

from . import backend  # noqa: E402,F401 - registers the "fxtp" torch.compile backend
