"""The ``"fxtp"`` torch.compile backend (a ``torch_dynamo_backends`` entry point, see
setup.cfg, which torch.compile loads by name): fxtp's graph passes, then inductor.

* ``torch.compile(gm, backend="fxtp")`` with ``gm = fxtp.parallelize(...)``: training and
  inference. Dynamo's graph of ``gm`` calls fxtp's collectives; the passes of
  :mod:`fxtp.passes.optimize` merge, cancel and bucket them (forward and backward), then
  inductor compiles with :mod:`fxtp.passes.schedule` overlapping collectives with compute.
* ``torch.compile(model, backend="fxtp", fullgraph=True, options={"plan": plan,
  "mesh": mesh})``: a plain model, parallelized inside compile (:mod:`fxtp.compiling.in_compile`),
  then as above. Made for inference; see that module for what training through it costs.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..kernels.collectives import allow_in_dynamo_graphs
from ..passes.optimize import optimize

from ..passes.errors import FxtpError

INDUCTOR_CONFIG = {"reorder_for_peak_memory": False}
"""Inductor's peak-memory reordering would move the compute placed between a collective and
its wait (by :mod:`fxtp.passes.schedule`) back before the collective."""


NO_BUFFER_REUSE = {"allow_buffer_reuse": False}
"""For a program calling nested compile regions: with buffer reuse, torch 2.13's inductor
let a reused region's backward overwrite a saved input, and gradients came out wrong
(pytorch/pytorch#193960)."""


def fxtp_backend(gm: fx.GraphModule, example_inputs, options=None, mode=None):
    allow_in_dynamo_graphs()
    if mode is not None:
        raise FxtpError(f"backend='fxtp' takes no mode (got mode={mode!r}); leave it out")
    options = dict(options or {})
    plan, mesh = options.pop("plan", None), options.pop("mesh", None)
    if options:
        raise FxtpError(f"backend='fxtp' takes options 'plan' and 'mesh'; unexpected: "
                        f"{sorted(options)}")
    if mesh is not None and plan is None:
        raise FxtpError("backend='fxtp': options={'mesh': ...} needs a 'plan' too")
    if plan is not None:
        from .in_compile import parallelize_dynamo_graph
        gm = parallelize_dynamo_graph(gm, example_inputs, plan, mesh)
    optimize(gm)
    from ..kernels.torch_compat import compile_fx  # slow to import: only when compiling

    from ..passes.schedule import OverlapCollectives
    return compile_fx(gm, example_inputs, config_patches=INDUCTOR_CONFIG | {
        "post_grad_custom_post_pass": OverlapCollectives()} | (
            NO_BUFFER_REUSE if _has_regions(gm) else {}))


def _has_regions(gm: fx.GraphModule) -> bool:
    """Does ``gm`` call nested compile regions (``fxtp.compile``'s blocks)?"""
    return any(n.target is torch.ops.higher_order.invoke_subgraph for n in gm.graph.nodes)

