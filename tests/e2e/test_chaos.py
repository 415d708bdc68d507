"""`specdec bench --chaos --store sentinel` for 75 s (real processes on 127.0.0.1: a Sentinel-managed Redis, two
`specdec serve` replicas with a small KV pool, a WAN proxy in front of each): every fault kind injected at least
once, every finished output identical to its reference (target-only for the greedy kinds, the fault-free run for
seeded sampling, logprobs within 1e-4), nothing lost or truncated, no undocumented error, no Redis key and no KV
page left once the session TTL has passed.

The sampled kind runs with the differently seeded draft (``other_draft_dir``): a draft with the target's own
weights makes p ≈ q, and its residual draws are rounding noise (specdec/bench/chaos/check.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from _cluster import ROOT
from _redis_ha import binaries

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.timeout(900)]

DURATION_S = 75


def test_chaos_sentinel_run_loses_nothing(tiny_pair, tmp_path):
    if binaries() is None:
        pytest.skip("no redis-server / redis-cli binary (the Debian package redis-server)")
    plot = tmp_path / "chaos.png"
    out = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "bench", "--chaos", "--store", "sentinel", "--sessions", "6",
         "--duration-s", str(DURATION_S), "--seed", "1", "--target", str(tiny_pair.target_dir), "--draft",
         str(tiny_pair.other_draft_dir), "--plot", str(plot), "--json"],
        check=False, capture_output=True, text=True, cwd=str(ROOT), timeout=840)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    print({k: v for k, v in report.items() if k not in ("fault_events", "kinds")})
    # token ids and logprobs identical, one logprob per token even for blocks settled from the store
    assert report["mismatches"] == 0, report["problems"]
    assert report["logprobs_missing"] == 0, report["problems"]
    assert report["lost"] == 0 and report["truncated"] == 0, report["problems"]
    assert report["undocumented_errors"] == 0, report["errors_by_code"]
    assert not report["fault_errors"], report["fault_errors"]
    assert all(n >= 1 for n in report["faults_by_kind"].values()), report["faults_by_kind"]
    assert set(report["requests_by_kind"]) == set(report["kinds"]), report["requests_by_kind"]
    assert report["tokens"] > 0 and report["failovers"] >= 1
    assert report["redis_keys_left"] == 0 and report["kv_pages_left"] == 0
    assert report["kv_preemptions"] >= 1  # the pool was small enough to preempt
    assert plot.stat().st_size > 10_000
