"""pytest plugin for scripts/mutation.sh: run each mutant's tests fastest first.

mutmut 3 hands a mutant's tests (the ones that executed the mutated function) to pytest with ``-x`` in no
particular order; a killed mutant costs the time up to its first failing test, so running the cheapest tests
first makes most kills cheap. Order: by test module (modules whose fastest test is fastest first, so a module's
fixtures are set up once), then by each test's own duration, both from mutmut's instrumented run
(``mutants/mutmut-stats.json``, ``duration_by_test``). Without that file (mutmut's first, instrumented run) the
order is left alone. Loaded with ``-p mutation_pytest_order`` (scripts/ on PYTHONPATH).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

_durations: dict[str, float] | None = None


def _load() -> dict[str, float]:
    global _durations
    if _durations is None:
        path = Path("mutants") / "mutmut-stats.json"
        try:
            _durations = json.loads(path.read_text()).get("duration_by_test", {})
        except (OSError, ValueError):
            return {}
    return _durations


def pytest_collection_modifyitems(session, config, items):
    durations = _load()
    if not durations:
        return
    cost = {item.nodeid: durations.get(item.nodeid, math.inf) for item in items}
    first = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        first[module] = min(first.get(module, math.inf), cost[item.nodeid])
    items.sort(key=lambda item: (first[item.nodeid.split("::")[0]], item.nodeid.split("::")[0], cost[item.nodeid]))
