"""Readiness on a Redis Cluster that forms while the verifier starts: `serve` (the real start-up: the tiny target
loaded from its directory, the store from a ``redis+cluster://`` URL, the gRPC server and its health task, default
health interval) with ``redis-cli --cluster create`` run at seeded random moments before, during and after the
target load, 10 runs. Every run:

- health says SERVING only once every slot is served: each SERVING answer is followed at once by a check of every
  node (``cluster_state:ok``, 16384 slots assigned); the cluster only grows towards that state here, so a node
  still short of it after a SERVING answer means the answer came too early;
- SERVING within 10 s of the cluster covering every slot (the moment the test sees every node ok);
- then a greedy generation runs through the gRPC port (SERVING meant it: the session opens and commits in the
  cluster), token-identical to target-only decoding with plain HF transformers.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from _cluster import wait_until
from _redis_ha import ClusterSet, binaries
from _reference import hf_greedy
from specdec.bench.chaos.procs import free_port
from specdec_runtime.cloud_verifier.serving.server import SERVICE_NAME

pytestmark = [pytest.mark.redis, pytest.mark.timeout(600)]

RUNS = 10
SERVING_WITHIN_S = 10.0
PROMPT_IDS = [1, 504, 3458, 314, 253]
MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def redis_bins():
    found = binaries()
    if found is None:
        pytest.skip("no redis-server / redis-cli binary (the Debian package redis-server)")
    return found


@pytest.fixture(scope="module")
def target_only(tiny_pair) -> list[int]:
    """Greedy target-only continuation of PROMPT_IDS (plain HF generate), the tokens every run must give."""
    return hf_greedy(tiny_pair.target_dir, PROMPT_IDS, MAX_NEW_TOKENS)


def _generate(tiny_pair, address: str) -> list[int]:
    """Greedy speculative generation with the tiny ONNX draft against the verifier at ``address``."""
    from specdec_runtime.edge_client.client import EdgeClient
    from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
    from specdec_runtime.edge_client.transport.failover import FailoverBackend

    draft = OnnxDraftModel(tiny_pair.draft_dir)
    with EdgeClient(FailoverBackend(address), ModelDrafter(draft), draft.tokenizer,
                    num_speculative_tokens=3) as client:
        return client.generate(PROMPT_IDS, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True).token_ids


@pytest.fixture(scope="module")
def load_s(tiny_pair) -> float:
    """How long loading the tiny target takes here (warm), s: the span the "during" moments fall in."""
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner

    begin = time.monotonic()
    TargetRunner(tiny_pair.target_dir)
    return time.monotonic() - begin


def _covered(cluster: ClusterSet) -> bool:
    """Every node says cluster_state:ok with all 16384 slots assigned."""
    import redis

    try:
        for node in cluster.nodes:
            info = redis.Redis(port=node.port, socket_timeout=1.0).cluster("info")
            if info.get("cluster_state") != "ok" or int(info.get("cluster_slots_assigned", 0)) != 16384:
                return False
        return True
    except redis.RedisError:
        return False


class Serve:
    """``serve(settings)`` on its own event loop in a thread, as ``specdec serve`` runs it."""

    def __init__(self, settings):
        from specdec_runtime.cloud_verifier.serving.server import serve

        self.error: BaseException | None = None
        self._loop = self._stop = None
        ready = threading.Event()

        async def main():
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            ready.set()
            await serve(settings, stop=self._stop)

        def run():
            try:
                asyncio.run(main())
            except BaseException as e:  # noqa: BLE001 - reported by the test
                self.error = e
                ready.set()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        ready.wait(30)

    def stop(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)


class Watcher:
    """Polls health (every 50 ms) until stopped; after each SERVING answer checks the cluster at once."""

    def __init__(self, address: str, cluster: ClusterSet):
        self.cluster, self.first_serving, self.early = cluster, None, []
        self._channel = grpc.insecure_channel(address)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        stub = health_pb2_grpc.HealthStub(self._channel)
        while not self._done.is_set():
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=1.0).status
            except grpc.RpcError:
                status = None
            if status == health_pb2.HealthCheckResponse.SERVING:
                if not _covered(self.cluster):
                    self.early.append(time.monotonic())
                self.first_serving = self.first_serving or time.monotonic()
            self._done.wait(0.05)

    def close(self) -> None:
        self._done.set()
        self._thread.join(10)
        self._channel.close()


def _moments(load_s: float) -> list[float | None]:
    """When to create the cluster, s after serve starts (None: before it starts): 2 before, 4 during the target
    load, 4 after it; seeded."""
    rng = random.Random(45)
    during = [rng.uniform(0.0, load_s) for _ in range(4)]
    after = [load_s + rng.uniform(0.2, 3.0) for _ in range(4)]
    return [None, None, *during, *after]


def _settings(tiny_pair, cluster: ClusterSet, port: int):
    from specdec_runtime.cloud_verifier.config import VerifierSettings

    return VerifierSettings(target=str(tiny_pair.target_dir), redis_url=cluster.url, port=port, metrics_port=0,
                            redis_prefix=f"specdec-test:{uuid.uuid4().hex}:", redis_socket_timeout_s=1.0,
                            grace_period_s=1.0, kv_cache_budget_tokens=4096)


def _one_run(tiny_pair, redis_bins, moment: float | None, target_only: list[int]) -> str:
    """One start-up with the cluster created at ``moment``; '' when every check held, else what failed."""
    cluster = ClusterSet(*redis_bins, replicas_per_master=0).start_nodes()
    server = watcher = None
    try:
        if moment is None:
            cluster.create()
        port = free_port()
        begin = time.monotonic()
        server = Serve(_settings(tiny_pair, cluster, port))
        watcher = Watcher(f"127.0.0.1:{port}", cluster)
        if moment is not None:
            time.sleep(max(0.0, begin + moment - time.monotonic()))
            cluster.create()  # returns once every node says cluster_state:ok
        covered_at = time.monotonic()
        if not wait_until(lambda: watcher.first_serving is not None or server.error is not None,
                          SERVING_WITHIN_S, step_s=0.05):
            return f"not SERVING within {SERVING_WITHIN_S} s of the cluster covering every slot"
        if server.error is not None:
            return f"serve failed: {server.error!r}"
        if watcher.early:
            return f"SERVING {len(watcher.early)} times while a slot was not served"
        if watcher.first_serving - covered_at > SERVING_WITHIN_S:
            return f"SERVING {watcher.first_serving - covered_at:.1f} s after the cluster covered every slot"
        tokens = _generate(tiny_pair, f"127.0.0.1:{port}")
        if tokens != target_only:
            return f"greedy through the cluster {tokens} != target-only {target_only}"
        return ""
    finally:
        if watcher is not None:
            watcher.close()
        if server is not None:
            server.stop()
        cluster.stop()


@pytest.mark.slow  # > 10 s here (measured): the full suite runs it, the quick tier does not
def test_serving_exactly_once_the_cluster_serves_every_slot(tiny_pair, redis_bins, load_s, target_only, tmp_path,
                                                            monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))  # the cost tables of these starts stay here
    failures = {}
    for run, moment in enumerate(_moments(load_s)):
        why = _one_run(tiny_pair, redis_bins, moment, target_only)
        if why:
            failures[run] = (moment, why)
    assert not failures, f"{len(failures)} of {RUNS} runs failed (run: (moment s, why)): {failures}"
