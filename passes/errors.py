"""Exceptions fxtp raises. Each message names the module FQN, op or parameter and the fix."""


class FxtpError(Exception):
    """Base class for fxtp errors."""


class PlanError(FxtpError, ValueError):
    """The parallelize plan does not fit the model."""


class ShardingError(FxtpError, RuntimeError):
    """An op cannot be sharded as planned (raised in strict mode instead of a fallback)."""


class TraceError(FxtpError, RuntimeError):
    """The model could not be traced to a graph."""


class InputError(FxtpError, ValueError):
    """A call's inputs differ from the ones ``parallelize`` traced."""


class StampMismatch(FxtpError, RuntimeError):
    """A stamped block (:class:`fxtp.passes.graph.Stamp`) cannot run its reference's program
    as the passes left it (its inputs arrive placed differently, or the reference was not
    outlined): ``parallelize`` traces the blocks in full instead."""


class RankError(FxtpError, RuntimeError):
    """``parallelize`` failed on other ranks of the group (their error says why): this rank
    stops too, rather than wait in a collective they will not reach."""
