"""Gradient clipping by the norm of the full (single-device) gradients."""
from __future__ import annotations

import math

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor
from torch.nn.utils import get_total_norm

from ..kernels.torch_compat import foreach_mul_
from ..passes.placement import is_sharded

from ..frontend.names import model_fqn
from ..kernels.collectives import _all_reduce
from .info import info_of


@torch.no_grad()
def clip_grad_norm_(gm: fx.GraphModule, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach=None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for an fxtp module: the total norm is the one of
    the single-device gradients, the same on every rank (a plain tensor), and every rank
    scales its local gradients by the same factor. Sharded gradients' partial norms are
    reduced across the group in one all-reduce; replicated gradients (identical on every
    rank) count once. Parameters sharded further (FSDP2 on a 2-D mesh) are left to
    ``torch.nn.utils.clip_grad_norm_``, which reduces their DTensor norms itself."""
    info = info_of(gm)
    params = [(model_fqn(name), p) for name, p in gm.named_parameters() if p.grad is not None]
    if any(isinstance(p, DTensor) and p.device_mesh != info.mesh for _, p in params):
        total = torch.nn.utils.clip_grad_norm_([p for _, p in params], max_norm, norm_type,
                                               error_if_nonfinite, foreach)
        return total.full_tensor() if isinstance(total, DTensor) else total
    sharded, replicated = [], []
    for name, p in params:
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        (sharded if is_sharded(info.param_placements.get(name)) else replicated).append(grad)
    grads = sharded + replicated
    if not grads:
        return torch.tensor(0.0)
    norm_type = float(norm_type)
    dtype, device = grads[0].dtype, grads[0].device

    def local_norm(tensors):
        return get_total_norm(tensors, norm_type, False, foreach) if tensors else \
            torch.zeros((), dtype=dtype, device=device)
    if math.isinf(norm_type):
        total = torch.maximum(_all_reduce(local_norm(sharded), info.group, "max"),
                              local_norm(replicated))
    else:
        powered = _all_reduce(local_norm(sharded) ** norm_type, info.group)
        total = (powered + local_norm(replicated) ** norm_type) ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from "
                           f"`parameters` is non-finite, so it cannot be clipped. To disable "
                           f"this error and scale the gradients by the non-finite norm "
                           f"anyway, set `error_if_nonfinite=False`")
    foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total
