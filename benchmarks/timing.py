"""Timing variants side by side in one process, so a noisy shared machine slows them alike."""
from __future__ import annotations

import statistics
import time


def alternating(variants: dict, rounds: int, calls: int) -> dict:
    """Median over ``rounds`` of each variant's mean seconds per call (``variants``: name ->
    a callable taking no argument), the variants run in turn within every round."""
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, call in variants.items():
            start = time.perf_counter()
            for _ in range(calls):
                call()
            times[name].append((time.perf_counter() - start) / calls)
    return {name: statistics.median(t) for name, t in times.items()}
