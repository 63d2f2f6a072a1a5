"""Losses over classes: ``cross_entropy_loss`` and ``nll_loss_nd``, by
:mod:`~fxtp.passes.loss_parallel`."""
from __future__ import annotations

import torch

from ..loss_parallel import (class_sharded, cross_entropy_spec, cross_entropy_strategies,
                             loss_parallel, nll_on_classes)
from .base import Rule

aten = torch.ops.aten


RULES: dict = {
    aten.cross_entropy_loss.default: Rule(cross_entropy_spec, local_op=loss_parallel,
                                          extra=cross_entropy_strategies, communicates=True),
    aten.nll_loss_nd.default: Rule(cross_entropy_spec, local_op=nll_on_classes,
                                   extra=class_sharded),
}
