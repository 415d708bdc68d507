"""The WAN bench's interleaving of routes (specdec.bench.wan.route_orders): over one cycle of orders each route
runs first equally often and directly after each other route equally often, so what a run leaves behind (a
session being released, the collector) does not fall on one route's runs only."""

from __future__ import annotations

from collections import Counter
from itertools import permutations

import pytest

from specdec.bench.wan import route_orders


@pytest.mark.parametrize("routes", [("speculative", "cloud", "auto"), ("speculative", "cloud", "auto", "cloud-first"),
                                    ("speculative", "cloud")])
def test_each_route_follows_each_other_equally_often(routes):
    orders = route_orders(routes)
    assert len(orders) == (2 * len(routes) if len(routes) % 2 else len(routes))
    assert all(sorted(order) == sorted(routes) for order in orders)  # every route once per slot
    firsts = Counter(order[0] for order in orders)
    assert len(set(firsts.values())) == 1 and set(firsts) == set(routes)
    pairs = Counter((a, b) for order in orders for a, b in zip(order, order[1:]))
    counts = {pair: pairs.get(pair, 0) for pair in permutations(routes, 2)}
    assert len(set(counts.values())) == 1 and min(counts.values()) > 0, counts
