"""Summaries the benchmarks share."""

from __future__ import annotations

import statistics


def spread(xs: list[float], nd: int = 2) -> dict:
    """Median, min and max of ``xs`` rounded to ``nd`` decimals, and how many there were."""
    return {
        "median": round(statistics.median(xs), nd),
        "min": round(min(xs), nd),
        "max": round(max(xs), nd),
        "n": len(xs),
    }
