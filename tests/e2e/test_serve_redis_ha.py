"""`specdec serve` with ``SPECDEC_REDIS_URL=redis+sentinel://...`` and ``redis+cluster://...`` (real processes on
127.0.0.1): it logs which store it uses, generates token-identical to target-only, and under Sentinel its
readiness follows the master: NOT_SERVING once the master is SIGKILLed, SERVING again after the promotion (with
``SPECDEC_REDIS_WAIT_REPLICAS=1``: once the new master has a replica again, the second one re-pointed by the
sentinels), and generation goes on."""

from __future__ import annotations

import uuid

import pytest

from _cluster import health_status, start_replicas, stop_process, wait_until
from _redis_ha import ClusterSet, SentinelSet, binaries
from _reference import hf_greedy

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.timeout(300)]

PROMPT = "Tell me a story about a robot who learns to paint."
MAX_NEW_TOKENS = 24


@pytest.fixture()
def redis_binaries():
    found = binaries()
    if found is None:
        pytest.skip("no redis-server / redis-cli binary (the Debian package redis-server)")
    return found


def _generate(address: str, tiny_pair):
    from specdec_runtime.edge_client.client import EdgeClient, encode_prompt
    from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
    from specdec_runtime.edge_client.transport.failover import FailoverBackend, RetryPolicy
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel

    model = OnnxDraftModel(tiny_pair.draft_dir)
    ids = encode_prompt(model.tokenizer, PROMPT)
    backend = FailoverBackend(address, policy=RetryPolicy(connect_timeout_s=2.0, budget_s=60.0, max_attempts=100))
    with EdgeClient(backend, ModelDrafter(model), model.tokenizer, num_speculative_tokens=3) as client:
        return ids, client.generate(ids, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)


def test_serve_under_sentinel_readiness_follows_the_master(redis_binaries, tiny_pair, tmp_path):
    sentinels = SentinelSet(*redis_binaries, num_replicas=2, down_after_ms=1000).start()
    replicas = []
    try:
        replicas = start_replicas(1, tiny_pair.target_dir, sentinels.url, f"specdec-test:{uuid.uuid4().hex}:",
                                  tmp_path, env={"SPECDEC_HEALTH_CHECK_INTERVAL_S": "0.2",
                                                 "SPECDEC_REDIS_WAIT_REPLICAS": "1",
                                                 "SPECDEC_REDIS_SOCKET_TIMEOUT_S": "0.5"})
        (replica,) = replicas
        assert f"session store: Redis sentinel at {sentinels.url}" in replica.log()
        ids, first = _generate(replica.address, tiny_pair)
        expected = hf_greedy(tiny_pair.target_dir, ids, MAX_NEW_TOKENS)
        assert first.token_ids == expected

        old = sentinels.master.port
        sentinels.master.kill()
        assert wait_until(lambda: health_status(replica.address) == "NOT_SERVING", 10.0, step_s=0.1)
        sentinels.wait_promoted(old)
        assert wait_until(lambda: health_status(replica.address) == "SERVING", 30.0, step_s=0.1)
        _, again = _generate(replica.address, tiny_pair)
        assert again.token_ids == expected and again.num_sessions == 1
    finally:
        for r in replicas:
            stop_process(r.proc)
        sentinels.stop()


def test_serve_on_a_cluster(redis_binaries, tiny_pair, tmp_path):
    cluster = ClusterSet(*redis_binaries, replicas_per_master=0).start()
    replicas = []
    try:
        replicas = start_replicas(1, tiny_pair.target_dir, cluster.url, f"specdec-test:{uuid.uuid4().hex}:",
                                  tmp_path)
        (replica,) = replicas
        assert f"session store: Redis cluster at {cluster.url}" in replica.log()
        ids, result = _generate(replica.address, tiny_pair)
        assert result.token_ids == hf_greedy(tiny_pair.target_dir, ids, MAX_NEW_TOKENS)
    finally:
        for r in replicas:
            stop_process(r.proc)
        cluster.stop()


def test_serve_started_before_the_cluster_is_created(redis_binaries, tiny_pair, tmp_path):
    """Pods start together: the nodes are up but ``redis-cli --cluster create`` has not run yet. The server
    stays up NOT_SERVING (one log line, no traceback), turns SERVING once the cluster is formed, and serves."""
    cluster = ClusterSet(*redis_binaries, replicas_per_master=0).start_nodes()
    replicas = []
    try:
        replicas = start_replicas(1, tiny_pair.target_dir, cluster.url, f"specdec-test:{uuid.uuid4().hex}:",
                                  tmp_path, env={"SPECDEC_HEALTH_CHECK_INTERVAL_S": "0.2"}, wait_serving=False)
        (replica,) = replicas
        assert wait_until(lambda: health_status(replica.address) == "NOT_SERVING" or not replica.alive(), 120.0,
                          step_s=0.2), replica.log()
        assert not wait_until(lambda: not replica.alive() or health_status(replica.address) != "NOT_SERVING",
                              3.0, step_s=0.2), replica.log()
        log = replica.log()
        assert "Traceback" not in log and "NOT_SERVING: session store unreachable" in log, log

        cluster.create()
        assert wait_until(lambda: health_status(replica.address) == "SERVING", 30.0, step_s=0.2), replica.log()
        ids, result = _generate(replica.address, tiny_pair)
        assert result.token_ids == hf_greedy(tiny_pair.target_dir, ids, MAX_NEW_TOKENS)
        assert "Traceback" not in replica.log()
    finally:
        for r in replicas:
            stop_process(r.proc)
        cluster.stop()
