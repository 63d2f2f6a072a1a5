"""Until its first call succeeds, an error on some ranks fails the call on every rank.

At the first call an error that shows on some ranks only (an index out of range in one
rank's shard of a sharded input, memory running out where the shards are largest) would
leave the other ranks waiting in the next collective until the group's timeout.
:func:`agree_until_first_success` makes every eager call of the result agree on it first:
before each collective of the call (:data:`fxtp.kernels.collectives.BEFORE_ISSUE`) and once
at its end, the ranks all-gather whether they raised. A rank that raised joins the
exchange the others wait in and raises its own error; the others raise
:class:`~fxtp.passes.errors.RankError` naming it. Each exchange is one tiny all-gather;
the first call that succeeds on every rank ends them. Backward is not covered; nor are
compiled calls (the hooks stand aside while dynamo traces, and in a call of
``torch.compile(gm)``, which runs them as Python outside its graph).
"""
from __future__ import annotations

import sys

import torch
import torch.fx as fx

from ..kernels import collectives
from ..kernels.torch_compat import in_compiled_module_call, run_as_python
from ..passes.errors import RankError
from .guards import comm_device, from_every_rank


def agree_until_first_success(gm: fx.GraphModule, group) -> None:
    """Register, on ``gm`` (and ``copy.deepcopy`` s of it), the hooks that make its calls
    agree on errors across ``group`` until one call succeeds on every rank."""

    def register(module: fx.GraphModule) -> None:
        state = {"agreed": False, "outer": None}

        def exchange(failed: bool) -> None:
            flags = from_every_rank(torch.tensor([int(failed)], device=comm_device(group)),
                                    group).tolist()
            others = [r for r, f in enumerate(flags) if f and r != group.rank]
            if others and not failed:
                collectives.BEFORE_ISSUE.remove(before_issue)
                raise RankError(
                    f"this call failed on rank(s) {others} of group '{group.name}' (their error "
                    f"says why) before any call had succeeded on every rank; this rank stops "
                    f"too rather than wait in a collective those ranks will not reach")

        def before_issue(_group_name: str) -> None:
            exchange(failed=False)

        def before(_module, _args):
            if state["agreed"] or torch.compiler.is_compiling() or in_compiled_module_call():
                return
            state["outer"] = sys.exc_info()[1]  # a call made while handling an error
            collectives.BEFORE_ISSUE.append(before_issue)

        def after(_module, _args, _output):
            if before_issue not in collectives.BEFORE_ISSUE:
                return  # not agreeing, or this rank already raised the others' failure
            error = sys.exc_info()[1]
            failed = error is not None and error is not state["outer"]
            exchange(failed)  # raises where another rank failed
            collectives.BEFORE_ISSUE.remove(before_issue)
            state["agreed"] = not failed
        for hook in (before, after):  # a compiled call runs them as Python, not as frames
            run_as_python(hook)
        module.register_forward_pre_hook(before)
        module.register_forward_hook(after, always_call=True)
    register(gm)
    gm._register_deepcopy_hook(register)
