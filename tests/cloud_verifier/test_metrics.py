"""Prometheus metrics of the verifier move with the work done (names follow vLLM's spec_decode_* counters)."""

from __future__ import annotations

import urllib.request

from prometheus_client import REGISTRY

from specdec_runtime.cloud_verifier import metrics
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec.embedded import LocalBackend
from specdec_runtime.edge_client.client import EdgeClient
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel


def _value(name: str, labels: dict | None = None) -> float:
    v = REGISTRY.get_sample_value(name, labels or {})
    return 0.0 if v is None else v


def test_metrics_follow_verification(tiny_pair):
    runner = TargetRunner(tiny_pair.target_dir)
    backend = LocalBackend(Verifier(runner))
    before = {n: _value(n) for n in (
        "specdec_spec_decode_num_drafts_total", "specdec_spec_decode_num_draft_tokens_total",
        "specdec_spec_decode_num_accepted_tokens_total", "specdec_batch_size_count",
        "specdec_target_forward_seconds_count", "specdec_queue_wait_seconds_count",
    )}
    pos0 = _value("specdec_spec_decode_num_accepted_tokens_per_pos_total", {"position": "0"})
    try:
        model = OnnxDraftModel(tiny_pair.draft_dir)
        client = EdgeClient(backend, ModelDrafter(model), model.tokenizer, num_speculative_tokens=3)
        res = client.generate([5, 6, 7, 8, 9], max_new_tokens=12, ignore_eos=True)
        s = res.stats
        d = lambda n: _value(n) - before[n]  # noqa: E731
        assert d("specdec_spec_decode_num_drafts_total") == s.num_drafts
        assert d("specdec_spec_decode_num_draft_tokens_total") == s.num_draft_tokens
        assert d("specdec_spec_decode_num_accepted_tokens_total") == s.num_accepted_tokens
        assert _value("specdec_spec_decode_num_accepted_tokens_per_pos_total", {"position": "0"}) - pos0 == \
            s.num_accepted_tokens_per_pos[0]
        assert d("specdec_batch_size_count") >= s.num_drafts
        assert d("specdec_target_forward_seconds_count") >= s.num_drafts
        assert d("specdec_queue_wait_seconds_count") == s.num_drafts
        assert _value("specdec_sessions_open") == 0
        assert _value("specdec_kv_cache_used_bytes") == 0
        assert _value("specdec_kv_cache_capacity_bytes") == runner.kv_cache_budget_tokens * runner.kv_bytes_per_token
    finally:
        backend.close()


def test_metrics_http_endpoint():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    metrics.serve_metrics(port, addr="127.0.0.1")
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "specdec_spec_decode_num_drafts_total" in body
    assert "specdec_kv_cache_used_bytes" in body
    # the endpoint serves the values, not only the names (tests/cloud_verifier/test_metrics_values.py checks them
    # against the clients' stats)
    from prometheus_client.parser import text_string_to_metric_families

    served = {s.name: s.value for f in text_string_to_metric_families(body) for s in f.samples if not s.labels}
    for name in ("specdec_spec_decode_num_drafts_total", "specdec_spec_decode_num_draft_tokens_total",
                 "specdec_spec_decode_num_accepted_tokens_total", "specdec_kv_cache_used_bytes",
                 "specdec_kv_cache_capacity_bytes"):
        assert served[name] == _value(name), name
