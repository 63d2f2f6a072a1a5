"""Ops on ``(*, C, *spatial)`` planes, each channel on its own: resampling, pooling,
reflection and replication padding, pixel shuffles, grid sampling."""
from __future__ import annotations

import torch

from ..dimspec import DimSpec, fixed_label
from ..graph import output_vals, tensor_inputs
from .base import Rule, dim_labels, ndim_of

aten = torch.ops.aten


def planes(spatial: int, linear: bool = True, grid: bool = False):
    """Ops on ``(*, C, *spatial)`` planes, each channel of each sample on its own
    (resampling, pooling, reflection and replication padding, pixel shuffles): every
    leading dim shards (the batch, the channels, a pixel shuffle's channels in matching
    chunks), the ``spatial`` last ones never do (an output point reads its neighbours).
    ``linear`` in the first input: Partial passes through it. Further tensor inputs: laid
    out as the first (``max_unpool``'s indices), or ``grid`` (``grid_sample``'s ``(N,
    *out, k)`` points, sharing the batch only)."""
    def spec(node):
        lead = dim_labels(ndim_of(node.args[0]) - spatial)
        def whole(k):
            return tuple(fixed_label() for _ in range(k))
        ins = [lead + whole(spatial)]
        for arg in tensor_inputs(node)[1:]:
            ins.append(lead[:1] + whole(ndim_of(arg) - 1) if grid else lead + whole(spatial))
        outs = tuple(lead + whole(out.dim() - len(lead)) for out in output_vals(node))
        return DimSpec(tuple(ins), outs, "sum" if linear else "none",
                       (0,) if linear else None)
    return Rule(spec)


RULES: dict = {
    # planes of (*, C, *spatial): resampled, pooled, padded per channel
    **{op: planes(1) for op in (aten.upsample_nearest1d.default,
                                aten._upsample_nearest_exact1d.default,
                                aten.upsample_linear1d.default, aten.reflection_pad1d.default,
                                aten.replication_pad1d.default)},
    **{op: planes(2) for op in (aten.upsample_nearest2d.default,
                                aten._upsample_nearest_exact2d.default,
                                aten.upsample_bilinear2d.default, aten.upsample_bicubic2d.default,
                                aten._upsample_bilinear2d_aa.default,
                                aten._upsample_bicubic2d_aa.default, aten.avg_pool2d.default,
                                aten._adaptive_avg_pool2d.default, aten.reflection_pad2d.default,
                                aten.replication_pad2d.default, aten.pixel_shuffle.default,
                                aten.pixel_unshuffle.default, aten.max_unpool2d.default)},
    **{op: planes(3) for op in (aten.upsample_nearest3d.default,
                                aten._upsample_nearest_exact3d.default,
                                aten.upsample_trilinear3d.default, aten.avg_pool3d.default,
                                aten._adaptive_avg_pool3d.default, aten.reflection_pad3d.default,
                                aten.replication_pad3d.default, aten.max_unpool3d.default)},
    aten.max_pool2d_with_indices.default: planes(2, linear=False),
    aten.adaptive_max_pool2d.default: planes(2, linear=False),
    aten.max_pool3d_with_indices.default: planes(3, linear=False),
    aten.adaptive_max_pool3d.default: planes(3, linear=False),
    aten.grid_sampler_2d.default: planes(2, grid=True),
    aten.grid_sampler_3d.default: planes(3, grid=True),
}
