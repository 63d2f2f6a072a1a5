"""fxtp: tensor parallelism for PyTorch as a compiler pass over torch.fx graphs."""
from torch.distributed.tensor import Partial, Replicate, Shard

from .comm_count import count_collectives
from .errors import FxtpError, PlanError, ShardingError, TraceError
from .explain import explain
from .loss import cross_entropy
from .parallelize import parallelize
from .report import Report
from .styles import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                     PrepareModuleInputOutput, PrepareModuleOutput, RowwiseParallel,
                     SequenceParallel)

__all__ = [
    "parallelize", "explain", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
    "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput", "ParallelStyle",
    "Shard", "Replicate", "Partial", "count_collectives", "cross_entropy", "Report",
    "FxtpError",
    "PlanError", "ShardingError", "TraceError",
]
