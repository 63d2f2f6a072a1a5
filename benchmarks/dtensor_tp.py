"""The peer recipe: torch's DTensor tensor parallelism (``parallelize_module``) of
:class:`fxtp.examples.llama.Llama` under the same plan as fxtp's, as ``benchmarks.run`` (CPU) and
``benchmarks.cuda`` time it."""
from __future__ import annotations

WHY_DTENSOR_PATCHED = (
    "DTensor TP with use_local_output=True hands attention local tensors, so the model's "
    "global head counts break its view(); the benchmark's DTensor copy sets each attention's "
    "n_heads and n_kv_heads to the local counts (as torchtitan does). fxtp runs the "
    "unmodified model.")


def dtensor_tp(model, world: int, device_type: str = "cpu"):
    """torch's DTensor TP of a :class:`fxtp.examples.llama.Llama` (or of its layers alone) under the
    same plan as fxtp's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    for layer in model.layers:  # see WHY_DTENSOR_PATCHED
        layer.attention.n_heads //= world
        layer.attention.n_kv_heads //= world
    plan = {**{f"layers.*.attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")},
            "layers.*.attention.wo": RowwiseParallel(),
            **{f"layers.*.feed_forward.{w}": ColwiseParallel() for w in ("w1", "w3")},
            "layers.*.feed_forward.w2": RowwiseParallel()}
    if hasattr(model, "tok_embeddings"):
        plan.update({"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
                     "output": ColwiseParallel(output_layouts=Replicate())})
    return parallelize_module(model, init_device_mesh(device_type, (world,)), plan)
