"""Rehearsal: every op of this rank's program runs on this rank's shapes.

After localization each ATen op is run once on meta tensors shaped as its inputs are on
this rank: the traced global shapes (``node.meta["val"]``) cut by the inputs' placements
(``node.meta[PLACEMENT]``). An op that fails on some ranks only (a view of a rank's empty
shard of unevenly dealt heads) then fails while ``parallelize``'s ranks can still agree on
it, not at the first call, where the ranks it works on would wait in the next collective.
Ops whose meta run says nothing of the real one are left out: those with data-dependent
results, those without tensor inputs, those reading sizes that are not plain ints, and
those in an autocast region (which casts CPU and CUDA tensors, not meta ones).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..kernels.torch_compat import OpOverload, pytree
from .context import PassContext
from .errors import ShardingError
from .graph import AUTOCAST, PLACEMENT, module_fqn
from .placement import is_sharded
from .rules import local_size

_UNSEEN = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
_META = torch.device("meta")


class _Unknown(Exception):
    """A value a meta stand-in cannot be made for."""


def rehearse(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Raise :class:`ShardingError` naming the first ATen op of ``gm`` that fails on
    ``ctx.group``'s rank's local shapes."""
    group = ctx.group
    for node in filter(_rehearsed, gm.graph.nodes):
        try:
            args, kwargs = fx.node.map_aggregate((node.args, node.kwargs),
                                                 lambda a: _stand_in(a, group))
        except _Unknown:
            continue
        try:
            node.target(*args, **kwargs)
        except NotImplementedError:  # no meta kernel: nothing to learn
            continue
        except Exception as e:  # noqa: BLE001 - raised as what it means for this rank
            shapes = [tuple(a.shape) for a in pytree.tree_leaves(args)
                      if isinstance(a, torch.Tensor)]
            fqn = module_fqn(node) or "<root>"
            raise ShardingError(
                f"{node.target} (node '{node.name}' in module '{fqn}') fails on rank "
                f"{group.rank} of {group.world}, whose inputs are shaped {shapes}: "
                f"{type(e).__name__}: {e}. fxtp localized it wrongly for this rank: please "
                f"report it; a plan whose sharded dims divide by the world size avoids it"
            ) from e
    return gm


def _rehearsed(node: fx.Node) -> bool:
    op = node.target
    autocast = node.meta.get(AUTOCAST)
    return node.op == "call_function" and isinstance(op, OpOverload) and \
        op.namespace == "aten" and not any(tag in op.tags for tag in _UNSEEN) and \
        not (autocast and autocast[2]) and \
        any(isinstance(a.meta.get("val"), torch.Tensor) for a in node.all_input_nodes)


def _stand_in(a, group):
    """A meta tensor of ``a``'s local shape on ``group``'s rank, for a node ``a``."""
    if isinstance(a, torch.device):
        return _META
    if not isinstance(a, fx.Node):
        return a
    value = a.meta.get("val")
    if not isinstance(value, torch.Tensor) or \
            not all(isinstance(s, int) for s in value.shape):
        raise _Unknown(a)
    shape = list(value.shape)
    placement = a.meta.get(PLACEMENT)
    if is_sharded(placement):
        dim = placement.dim % len(shape)
        shape[dim] = local_size(placement, shape[dim], group)
    return torch.empty(shape, dtype=value.dtype, device=_META)
