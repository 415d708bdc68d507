"""How a number looks in a report table: one home for every bench report (specdec/bench/report.py and the
replay's specdec/bench/replay/report.py)."""

from __future__ import annotations


def fmt(x, spec: str = ".2f") -> str:
    """``x`` formatted with ``spec``; "—" for a missing value (None)."""
    return "—" if x is None else format(x, spec)
