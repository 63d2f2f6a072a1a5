"""How a dim's units (heads, vocabulary rows, single elements) are dealt among the ranks:
``torch.chunk``'s dealing where there are at least as many units as ranks, each unit held by
consecutive ranks where there are fewer."""


def unit_range(units: int, rank: int, world: int) -> tuple[int, int]:
    """The units ``[start, stop)`` rank ``rank`` holds of ``units`` dealt among ``world``
    ranks (the dealing of :class:`~fxtp.passes.placement.UnitShard`)."""
    if units < world:
        unit = rank * units // world
        return unit, unit + 1
    per = -(-units // world)
    start = min(rank * per, units)
    return start, min(start + per, units)


def unit_span(units: int, size: int, rank: int, world: int) -> tuple[int, int]:
    """``(start, length)`` of the elements rank ``rank`` holds of a dim of ``size`` cut
    into ``units`` equal units dealt as :func:`unit_range` deals them."""
    start, stop = unit_range(units, rank, world)
    per_unit = size // units
    return start * per_unit, (stop - start) * per_unit
