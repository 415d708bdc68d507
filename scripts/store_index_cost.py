"""What the per-replica session index and the reaper cost at 10,000 sessions (one replica holding all of them).

    python scripts/store_index_cost.py [--sessions 10000] [--url redis://127.0.0.1:6379/15] [--cluster]

Measures, on the given Redis (and, with ``--cluster``, on a private 3-master loopback cluster started from
tests/_redis_ha.py):
- ``session_ids_of``: one ZRANGE of the index + one pipelined HGET per member (drain, load counting), s;
- the reaper's pass: one ``get`` per session the replica holds (``SessionTable.reap_expired``), s;
- create and commit throughput, for scale (the index is updated apart from the session's script).
Keys are written under a private prefix and deleted afterwards.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

from specdec_runtime.cloud_verifier.store import RedisSessionStore, SessionRecord  # noqa: E402
from specdec_runtime.common.types import SamplingParams, StoppingCriteria  # noqa: E402


def measure(url: str, n: int, label: str) -> None:
    store = RedisSessionStore(url, prefix=f"specdec-cost:{uuid.uuid4().hex}:", ttl_s=600)
    ids = [uuid.uuid4().hex for _ in range(n)]
    try:
        t0 = time.perf_counter()
        for sid in ids:
            store.create(SessionRecord(sid, "v1", "m", 64, list(range(64)), SamplingParams(),
                                       StoppingCriteria(max_new_tokens=256), 1, time.time(), time.time()))
        t_create = time.perf_counter() - t0
        t0 = time.perf_counter()
        for sid in ids:
            store.append_committed(sid, 64, [1, 2, 3], seq=1, finished=False, finish_reason=None, now=time.time(),
                                   verifier_id="v1")
        t_commit = time.perf_counter() - t0
        t0 = time.perf_counter()
        held = store.session_ids_of("v1")
        t_index = time.perf_counter() - t0
        assert len(held) == n, len(held)
        t0 = time.perf_counter()
        for sid in ids:
            store.get(sid)
        t_reap = time.perf_counter() - t0
        print(f"{label}: {n} sessions: session_ids_of {t_index * 1000:.0f} ms; reaper pass (get each) "
              f"{t_reap * 1000:.0f} ms ({t_reap / n * 1e6:.0f} us/session); create {n / t_create:.0f}/s; "
              f"commit {n / t_commit:.0f}/s")
    finally:
        for sid in ids:
            store.delete(sid)
        store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=10_000)
    ap.add_argument("--url", default="redis://127.0.0.1:6379/15")
    ap.add_argument("--cluster", action="store_true", help="also on a private 3-master loopback cluster")
    args = ap.parse_args()
    measure(args.url, args.sessions, args.url)
    if args.cluster:
        from _redis_ha import ClusterSet, binaries

        found = binaries()
        if found is None:
            sys.exit("no redis-server / redis-cli binary")
        cluster = ClusterSet(*found, replicas_per_master=0).start()
        try:
            measure(cluster.url, args.sessions, "3-master cluster")
        finally:
            cluster.stop()


if __name__ == "__main__":
    main()
