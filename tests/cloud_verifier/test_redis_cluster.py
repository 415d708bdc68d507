"""The session store on a Redis Cluster, with real processes on 127.0.0.1 (3 masters + 1 replica each,
``redis-cli --cluster create``; tests/_redis_ha.py):

- the store's scripts on a cluster: sessions spread over every master, each script's keys in one slot (no
  CROSSSLOT), NOSCRIPT after a script flush answered by loading the script on that node;
- 64 greedy sessions through a verifier, a master failed over mid-run (CLUSTER FAILOVER on its replica): no
  error (a CROSSSLOT would fail a block: it is no retryable error), every output identical to target-only;
- the reaper still reaps abandoned sessions: their KV caches freed, their keys deleted on every node.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest
import redis

from _cluster import wait_until
from _redis_ha import ClusterSet, binaries
from _reference import hf_greedy
from specdec_runtime.cloud_verifier.store import RedisSessionStore, SessionRecord
from specdec_runtime.common.types import SamplingParams, StoppingCriteria

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.timeout(240)]

PROMPTS = ["Tell me a story about a robot who learns to paint.", "Why is the sky blue?",
           "Write a haiku about the sea.", "List three uses of copper."]
NUM_SESSIONS = 64
MAX_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def cluster():
    found = binaries()
    if found is None:
        pytest.skip("no redis-server / redis-cli binary (the Debian package redis-server)")
    c = ClusterSet(*found, replicas_per_master=1, node_timeout_ms=1000)
    try:
        yield c.start()
    finally:
        c.stop()


def _store(cluster, ttl_s: float = 60) -> RedisSessionStore:
    return RedisSessionStore(cluster.url, prefix=f"specdec-test:{uuid.uuid4().hex}:", ttl_s=ttl_s,
                             socket_timeout_s=1.0, retry_budget_s=20.0)


def _record(sid: str, vid: str = "v1") -> SessionRecord:
    return SessionRecord(sid, vid, "m", 3, [1, 2, 3], SamplingParams(), StoppingCriteria(max_new_tokens=100),
                         seed=1, created_at=1.0, last_seen_at=1.0)


def _keys(store) -> list[bytes]:
    return list(store.client.scan_iter(match=f"{store.prefix}*"))  # every node


def test_scripts_run_on_a_cluster(cluster):
    store = _store(cluster)
    try:
        ids = [uuid.uuid4().hex for _ in range(64)]
        for sid in ids:
            store.create(_record(sid))
        nodes = {store.client.get_node_from_key(store.session_key(sid)).name for sid in ids}
        assert len(nodes) == 3  # spread over every master
        for sid in ids:
            assert store.append_committed(sid, 3, [4], seq=1, finished=False, finish_reason=None, now=2.0) == 4
        for node in cluster.nodes:  # as on a replica promoted after a failover: no script cached there
            redis.Redis(port=node.port).script_flush()
        for sid in ids:
            assert store.append_committed(sid, 4, [5], seq=2, finished=False, finish_reason=None, now=3.0) == 5
            assert store.get(sid).committed_token_ids == [1, 2, 3, 4, 5]
        assert sorted(store.session_ids_of("v1")) == sorted(ids)
        assert store.claim(ids[0], "v2", now=4.0) and store.disown(ids[1], "v1")
        assert store.session_ids_of("v2") == [ids[0]] and len(store.session_ids_of("v1")) == 62
        for sid in ids:
            assert store.delete(sid)
        assert _keys(store) == []
    finally:
        store.close()


def test_sixty_four_sessions_survive_a_master_failover(cluster, tiny_pair, capsys):
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier
    from specdec_runtime.edge_client.client import EdgeClient, encode_prompt
    from specdec_runtime.edge_client.transport.failover import FailoverBackend, RetryPolicy
    from specdec_runtime.edge_client.drafting.ngram import NgramDrafter
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
    from specdec.embedded import EmbeddedServer

    store = _store(cluster)
    tokenizer = OnnxDraftModel(tiny_pair.draft_dir).tokenizer
    prompt_ids = [encode_prompt(tokenizer, p) for p in PROMPTS]
    expected = [hf_greedy(tiny_pair.target_dir, ids, MAX_NEW_TOKENS) for ids in prompt_ids]
    runner = TargetRunner(tiny_pair.target_dir, kv_cache_budget_tokens=65536)
    verifier = Verifier(runner, store, verifier_id="cluster-verifier", max_batch_wait_ms=2.0, max_sessions=128)
    results, errors = {}, []
    try:
        with EmbeddedServer(verifier=verifier, grace_s=1.0) as address:
            def worker(i: int) -> None:
                try:
                    # 64 clients connecting at once on 2 busy cores: give the connection time
                    backend = FailoverBackend(address, policy=RetryPolicy(connect_timeout_s=15.0, budget_s=60.0,
                                                                          max_attempts=200))
                    with EdgeClient(backend, NgramDrafter(), tokenizer, num_speculative_tokens=3) as client:
                        results[i] = client.generate(prompt_ids[i % len(PROMPTS)], max_new_tokens=MAX_NEW_TOKENS,
                                                     ignore_eos=True)
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append((i, repr(e)))

            threads = [threading.Thread(target=worker, args=(i,)) for i in range(NUM_SESSIONS)]
            for t in threads:
                t.start()
            assert wait_until(lambda: verifier.num_sessions >= NUM_SESSIONS // 2 or errors, 60.0)
            assert not errors, errors[:3]
            master = next(n for n in cluster.nodes if cluster.role(n) == "master")
            t0 = time.monotonic()
            cluster.fail_over(cluster.replica_of(master))
            failover_s = time.monotonic() - t0
            for t in threads:
                t.join(120.0)
        with capsys.disabled():
            print(f"\n[cluster] CLUSTER FAILOVER mid-run: promoted in {failover_s:.2f} s; {len(results)} sessions")
        assert not errors, errors[:3]
        assert len(results) == NUM_SESSIONS
        for i, r in results.items():
            assert r.token_ids == expected[i % len(PROMPTS)], i
            assert r.finish_reason.value == "length"
    finally:
        verifier.shutdown()
        store.close()


def test_reaper_reaps_abandoned_sessions(cluster, tiny_pair):
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier

    store = _store(cluster, ttl_s=60)  # keys outlive the verifier's 1 s TTL: only the reaper deletes them
    runner = TargetRunner(tiny_pair.target_dir, kv_cache_budget_tokens=16384)
    verifier = Verifier(runner, store, verifier_id="cluster-reaper", session_ttl_s=1, reap_interval_s=0.2)

    async def main() -> None:
        await verifier.start()
        try:
            for _ in range(12):  # opened, then abandoned: no block, no close
                await verifier.open_session([1, 2, 3, 4, 5], SamplingParams(), StoppingCriteria(max_new_tokens=8))
            assert verifier.num_sessions == 12 and _keys(store)
            deadline = time.monotonic() + 20.0
            while (verifier.num_sessions or _keys(store)) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            assert verifier.num_sessions == 0 and _keys(store) == []
            assert runner.kv_reserved_tokens == 0
        finally:
            await verifier.stop(1.0)

    try:
        asyncio.run(main())
    finally:
        verifier.shutdown()
        store.close()


def test_master_sigkill_ping_and_commits_follow(cluster):
    """A master SIGKILLed (last in this module: the cluster keeps 3 masters, one without a replica): ping is
    False while its slots have no master (the health task's NOT_SERVING), the replica is promoted by the
    cluster itself, ping is True again and commits to its slots go on, counted as a store failover."""
    from prometheus_client import REGISTRY

    store = _store(cluster)
    try:
        master = next(n for n in cluster.nodes if cluster.role(n) == "master")
        replica = cluster.replica_of(master)
        ids = [uuid.uuid4().hex for _ in range(32)]
        for sid in ids:
            store.create(_record(sid))
        on_it = [sid for sid in ids if store.client.get_node_from_key(store.session_key(sid)).port == master.port]
        assert on_it and store.ping()
        before = REGISTRY.get_sample_value("specdec_store_failovers_total") or 0.0
        t0 = time.monotonic()
        master.kill()
        assert wait_until(lambda: not store.ping(), 10.0, step_s=0.05)
        # a commit to the dead master's slots waits (bounded retry) until the replica took over
        assert store.append_committed(on_it[0], 3, [4], seq=1, finished=False, finish_reason=None, now=2.0) == 4
        print(f"\n[cluster] master SIGKILL -> first commit on its slots {time.monotonic() - t0:.2f} s")
        assert cluster.role(replica) == "master"
        assert wait_until(store.ping, 10.0, step_s=0.1)
        for sid in on_it[1:]:
            assert store.append_committed(sid, 3, [4], seq=1, finished=False, finish_reason=None, now=2.0) == 4
        assert (REGISTRY.get_sample_value("specdec_store_failovers_total") or 0.0) > before
    finally:
        store.close()
