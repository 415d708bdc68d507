"""The session store under Sentinel, with real processes on 127.0.0.1 (1 master, 1 replica, 3 sentinels,
down-after 1 s; tests/_redis_ha.py):

- 8 greedy sessions drafting through a verifier (gRPC, the SDK with its retrying backend); the master is
  SIGKILLed mid-generation: the sentinels promote the replica, the store follows it, every session finishes
  token-identical to target-only with the requested length; failover time (kill -> first commit after) printed;
- readiness: the store's ping is False while no master answers and True again after the promotion (the health
  task's NOT_SERVING / SERVING); ``specdec_store_failovers_total`` counts the move;
- durability with ``wait_replicas`` = 1: every acknowledged commit survives a SIGKILL of the master right after
  it; a replica that does not acknowledge in time makes the commit unconfirmed (VerifierUnavailableError);
  the latency WAIT adds, measured.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid

import pytest

from _cluster import wait_until
from _redis_ha import SentinelSet, binaries
from _reference import hf_greedy
from specdec_runtime.cloud_verifier.store import RedisSessionStore, SessionRecord
from specdec_runtime.common.errors import VerifierUnavailableError
from specdec_runtime.common.types import SamplingParams, StoppingCriteria

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.timeout(180)]

PROMPTS = ["Tell me a story about a robot who learns to paint.", "Why is the sky blue?",
           "Write a haiku about the sea.", "List three uses of copper.", "What is a prime number?",
           "Describe a cat in one sentence.", "How do bees make honey?", "Name a famous bridge."]
MAX_NEW_TOKENS = 48


@pytest.fixture()
def sentinels():
    found = binaries()
    if found is None:
        pytest.skip("no redis-server / redis-cli binary (the Debian package redis-server)")
    s = SentinelSet(*found, num_replicas=1, down_after_ms=1000)
    try:
        yield s.start()
    finally:
        s.stop()


def _store(url: str, **kw) -> RedisSessionStore:
    return RedisSessionStore(url, prefix=f"specdec-test:{uuid.uuid4().hex}:", ttl_s=60, socket_timeout_s=0.5,
                             retry_budget_s=20.0, **kw)


def _record(sid: str) -> SessionRecord:
    return SessionRecord(sid, "v1", "m", 3, [1, 2, 3], SamplingParams(), StoppingCriteria(max_new_tokens=10_000),
                         seed=1, created_at=1.0, last_seen_at=1.0)


def _failovers() -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("specdec_store_failovers_total") or 0.0


def test_eight_sessions_survive_a_master_sigkill(sentinels, tiny_pair, capsys):
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier
    from specdec_runtime.edge_client.client import EdgeClient, encode_prompt
    from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
    from specdec_runtime.edge_client.transport.failover import FailoverBackend, RetryPolicy
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
    from specdec.embedded import EmbeddedServer

    store = _store(sentinels.url)
    commits: list[float] = []  # monotonic s of every commit the store acknowledged
    append = store.append_committed

    def recording_append(*args, **kwargs):
        length = append(*args, **kwargs)
        commits.append(time.monotonic())
        return length

    store.append_committed = recording_append
    model = OnnxDraftModel(tiny_pair.draft_dir)
    prompt_ids = [encode_prompt(model.tokenizer, p) for p in PROMPTS]
    expected = [hf_greedy(tiny_pair.target_dir, ids, MAX_NEW_TOKENS) for ids in prompt_ids]
    runner = TargetRunner(tiny_pair.target_dir, kv_cache_budget_tokens=16384)
    verifier = Verifier(runner, store, verifier_id="sentinel-verifier", max_batch_wait_ms=1.0)
    results, errors = {}, []
    try:
        with EmbeddedServer(verifier=verifier, grace_s=1.0) as address:
            def worker(i: int) -> None:
                try:
                    backend = FailoverBackend(address, policy=RetryPolicy(connect_timeout_s=2.0, budget_s=60.0,
                                                                          max_attempts=200))
                    with EdgeClient(backend, ModelDrafter(OnnxDraftModel(tiny_pair.draft_dir)), model.tokenizer,
                                    num_speculative_tokens=3) as client:
                        results[i] = client.generate(prompt_ids[i], max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append((i, e))

            threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(PROMPTS))]
            for t in threads:
                t.start()
            assert wait_until(lambda: len(commits) >= 40, 60.0), "no progress before the kill"
            old_port, failovers0 = sentinels.master.port, _failovers()
            killed_at = time.monotonic()
            sentinels.master.kill()
            promoted = sentinels.wait_promoted(old_port, timeout_s=30.0)
            promoted_at = time.monotonic()
            for t in threads:
                t.join(120.0)
        assert not errors, errors
        after = [t for t in commits if t > killed_at]
        assert after, "no commit after the kill"
        recovery_s = after[0] - killed_at
        with capsys.disabled():
            print(f"\n[sentinel] master SIGKILL -> promotion {promoted_at - killed_at:.2f} s, -> first commit "
                  f"after {recovery_s:.2f} s; {len(commits)} commits, {len(after)} after the kill")
        assert promoted != old_port and _failovers() > failovers0
        for i, r in results.items():
            assert r.token_ids == expected[i], i
            assert r.finish_reason.value == "length" and r.num_sessions == 1
        assert len(results) == len(PROMPTS)
    finally:
        verifier.shutdown()
        store.close()


def test_ping_follows_the_master(sentinels):
    """No master: ping False (the health task answers NOT_SERVING); promoted: True again, writes go there."""
    store = _store(sentinels.url)
    try:
        store.create(_record("s"))
        assert store.ping()
        old = sentinels.master.port
        sentinels.master.kill()
        assert wait_until(lambda: not store.ping(), 5.0, step_s=0.05)
        sentinels.wait_promoted(old)
        assert wait_until(store.ping, 10.0, step_s=0.1)
        assert store.append_committed("s", 3, [4], seq=1, finished=False, finish_reason=None, now=2.0) == 4
        assert store.get("s").committed_token_ids == [1, 2, 3, 4]
    finally:
        store.close()


def test_wait_replicas_keeps_every_acknowledged_commit(sentinels, capsys):
    """wait_replicas=1: the master is SIGKILLed right after a burst of acknowledged commits; the promoted
    replica has every one. The latency WAIT adds is measured against the same commits without it."""
    plain, durable = _store(sentinels.url), _store(sentinels.url, wait_replicas=1, wait_timeout_ms=1000)
    try:
        timings = {}
        for name, store in (("wait 0", plain), ("wait 1", durable)):
            store.create(_record("s"))
            times = []
            for k in range(200):
                t0 = time.perf_counter()
                store.append_committed("s", 3 + k, [k], seq=k + 1, finished=False, finish_reason=None, now=2.0)
                times.append((time.perf_counter() - t0) * 1000)
            timings[name] = (statistics.median(times), sorted(times)[int(0.99 * len(times))])
        with capsys.disabled():
            print("\n[sentinel] commit latency (median, p99 ms): "
                  + ", ".join(f"{k} {m:.2f} / {p:.2f}" for k, (m, p) in timings.items()))
        old = sentinels.master.port
        sentinels.master.kill()  # right after the last acknowledged commit
        sentinels.wait_promoted(old)
        assert durable.get("s").committed_token_ids == [1, 2, 3, *range(200)]
    finally:
        plain.close()
        durable.close()


def test_unacknowledged_commit_is_unconfirmed(sentinels):
    """A replica that does not acknowledge within wait_timeout_ms (stopped): the commit raises
    VerifierUnavailableError (the verifier keeps it unconfirmed and settles it from the store later)."""
    import signal

    store = _store(sentinels.url, wait_replicas=1, wait_timeout_ms=200)
    replica = sentinels.replicas[0]
    try:
        store.create(_record("s"))
        replica.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(VerifierUnavailableError, match="not confirmed by 1 replica"):
                store.append_committed("s", 3, [4], seq=1, finished=False, finish_reason=None, now=2.0)
        finally:
            replica.proc.send_signal(signal.SIGCONT)
        assert store.get("s").committed_length == 4  # it landed on the master: settle finds it there
    finally:
        store.close()
