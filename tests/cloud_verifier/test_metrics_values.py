"""The verifier's Prometheus counters, scraped over HTTP (/metrics), have the right VALUES: after known generations
their increments equal the sums of the clients' own stats, and they stay flat while the verifier idles.

Four generations through EdgeClient + GrpcBackend against one EmbeddedServer (three of them concurrently, so blocks
share forward passes): greedy with the accepting draft, seeded sampling with the rejecting draft, top-k/top-p
sampling, and target-only decoding (empty blocks).
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdec_runtime.cloud_verifier import metrics
from specdec_runtime.cloud_verifier.store import MemorySessionStore
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.edge_client.client import EdgeClient
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
from specdec.embedded import EmbeddedServer

pytestmark = pytest.mark.timeout(180)

PROMPT = [5, 6, 7, 8, 9, 10]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def metrics_url():
    port = _free_port()
    metrics.serve_metrics(port, addr="127.0.0.1")
    return f"http://127.0.0.1:{port}/metrics"


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of every sample the endpoint serves."""
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_counter_values_equal_the_clients_stats_and_stay_flat_when_idle(tiny_pair, metrics_url):
    runner = TargetRunner(tiny_pair.target_dir)
    verifier = Verifier(runner, MemorySessionStore(ttl_s=60), max_num_speculative_tokens=4, max_batch_wait_ms=5.0,
                        reap_interval_s=0.1)
    runs = [  # (draft dir or None, γ, generate kwargs)
        (tiny_pair.draft_dir, 3, dict(max_new_tokens=14)),
        (tiny_pair.other_draft_dir, 2, dict(max_new_tokens=9, temperature=0.9, seed=4)),
        (tiny_pair.draft_dir, 4, dict(max_new_tokens=11, temperature=1.0, top_k=20, top_p=0.9, seed=5)),
        (None, 1, dict(max_new_tokens=5)),
    ]
    results, errors = [None] * len(runs), []
    with EmbeddedServer(verifier=verifier, grace_s=1.0) as address:
        before = scrape(metrics_url)

        def work(i):
            draft_dir, gamma, kw = runs[i]
            model = OnnxDraftModel(draft_dir or tiny_pair.draft_dir)
            drafter = ModelDrafter(model, draft_top_k=4) if draft_dir else None
            try:
                with EdgeClient(GrpcBackend(address), drafter, model.tokenizer, num_speculative_tokens=gamma) as c:
                    results[i] = c.generate(PROMPT, ignore_eos=True, chat=False, **kw)
            except Exception as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        work(3)
        assert not errors, errors
        after = scrape(metrics_url)
        time.sleep(1.0)  # idle: the reaper runs ~10 times, nothing is verified
        idle = scrape(metrics_url)
    stats = [r.stats for r in results]
    d = lambda name, **labels: value(after, name, **labels) - value(before, name, **labels)  # noqa: E731

    assert all(r.finish_reason.value == "length" for r in results)
    assert d("specdec_spec_decode_num_drafts_total") == sum(s.num_drafts for s in stats)
    assert d("specdec_spec_decode_num_draft_tokens_total") == sum(s.num_draft_tokens for s in stats)
    assert d("specdec_spec_decode_num_accepted_tokens_total") == sum(s.num_accepted_tokens for s in stats)
    assert d("specdec_generation_tokens_total") == sum(s.num_generated_tokens for s in stats)
    width = max(len(s.num_accepted_tokens_per_pos) for s in stats)
    for pos in range(width):
        assert d("specdec_spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)) == sum(
            s.num_accepted_tokens_per_pos[pos] for s in stats if pos < len(s.num_accepted_tokens_per_pos)), pos
    assert d("specdec_queue_wait_seconds_count") == sum(s.num_drafts for s in stats)
    # every verify step ran in some forward pass; the concurrent ones may have shared passes
    assert d("specdec_batch_size_sum") == sum(s.num_drafts for s in stats)
    assert d("specdec_batch_size_count") <= sum(s.num_drafts for s in stats)
    assert d("specdec_target_forward_passes_total") >= d("specdec_batch_size_count") >= 1
    assert d("specdec_sessions_opened_total") == len(runs) and d("specdec_sessions_closed_total") == len(runs)
    assert value(after, "specdec_sessions_open") == 0 and value(after, "specdec_kv_cache_used_bytes") == 0
    # the numbers are not trivially zero: drafts were made, some accepted, some rejected
    assert 0 < d("specdec_spec_decode_num_accepted_tokens_total") < d("specdec_spec_decode_num_draft_tokens_total")

    # idle: no specdec counter, histogram count, sum or bucket moves (process_* metrics of the client library do)
    moving = {k: (after.get(k), idle.get(k)) for k in set(after) | set(idle)
              if k[0].startswith("specdec_") and k[0].endswith(("_total", "_count", "_sum", "_bucket"))
              and after.get(k) != idle.get(k)}
    assert not moving, moving
