"""How the report writes numbers: markdown tables, ratios, shares, counts and durations, one spelling each.

Departures: none (tooling).
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence


def md_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A markdown table (cells as given, ``None`` shown as an em dash)."""
    cell = lambda v: "—" if v is None else str(v)                                     # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


def x(v: float, digits: int = 2) -> str:
    """A ratio: ``1.32x``."""
    return f"{v:.{digits}f}x"


def x_vs(v: float, goal: float, digits: int = 2) -> str:
    """A ratio beside its goal, with enough digits that the rounding does not put it on the goal's other side:
    ``x_vs(1.0999, 1.1)`` is ``1.0999x``, not ``1.10x``."""
    while digits < 6 and (round(v, digits) >= goal) != (v >= goal):
        digits += 1
    return x(v, digits)


def n(v: float, digits: int = 0) -> str:
    """A number with thousands separators: ``8,637``."""
    return f"{v:,.{digits}f}"


def pct(v: float, digits: int = 0) -> str:
    """A share: ``57%``."""
    return f"{100 * v:.{digits}f}%"


def bold(text: str, on: bool = True) -> str:
    return f"**{text}**" if on else text


def minutes(seconds: float) -> str:
    """``8 min 17 s`` (or ``25 s``)."""
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s} s" if m else f"{s} s"


def median(values) -> float:
    return float(statistics.median(values))

