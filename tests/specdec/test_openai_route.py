"""edge-serve's ``route`` extension field (specdec/openai_server/route_field.py): the request's route is the one the
generation runs on (reported in the client's last result), absent it is the server's default, a bad value is a 400
naming ``route``; the metrics of a response and its one log line, which names the draft (a local draft or head by
its directory). In process: the endpoint's app over an EdgeClient of the tiny pair (or a tiny random EAGLE-3
head) and a real gRPC verifier."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(400)  # the tiny pair is built in setup (slow on a loaded machine)


@pytest.fixture(scope="module")
def app_client(tiny_pair):
    from fastapi.testclient import TestClient

    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier
    from specdec_runtime.edge_client.client import EdgeClient
    from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
    from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
    from specdec.embedded import EmbeddedServer
    from specdec.openai_server import Engine, create_app

    verifier = Verifier(TargetRunner(tiny_pair.target_dir, kv_cache_budget_tokens=8192), max_batch_wait_ms=1.0)
    draft = OnnxDraftModel(tiny_pair.draft_dir)
    with EmbeddedServer(verifier=verifier, grace_s=1.0) as address, GrpcBackend(address) as backend:
        edge = EdgeClient(backend, ModelDrafter(draft), draft.tokenizer, num_speculative_tokens=3, route="cloud")
        engine = Engine(edge, "tiny", max_conversations=0)
        with TestClient(create_app(engine)) as http:
            yield http, edge
        engine.close()


def _completion(http, **extra):
    return http.post("/v1/completions", json={"model": "tiny", "prompt": "Once upon a time", "max_tokens": 12,
                                              "temperature": 0, "ignore_eos": True, **extra})


def test_route_field_and_server_default(app_client):
    http, edge = app_client
    answers = {}
    for route in (None, "speculative", "cloud-first", "device"):
        r = _completion(http, **({"route": route} if route else {}))
        assert r.status_code == 200, r.text
        answers[route] = r.json()["choices"][0]["text"]
        assert edge.last_result.route["requested"] == (route or "cloud")  # absent: the server's default
    assert edge.last_result.num_unverified_tokens == 12  # device: the draft alone, counted as unverified
    assert answers[None] == answers["speculative"] == answers["cloud-first"]  # greedy: lossless routes agree
    bad = _completion(http, route="fastest")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "route"


def _read_vllm_spec_metrics(body: dict) -> dict:
    """What a harness written against vLLM's documented per-request fields (vllm-project/vllm#48915,
    ``metrics.speculative_decoding``) reads from a response, with the identities it relies on."""
    spec = body["metrics"]["speculative_decoding"]
    hist = spec["acceptance_histogram"]  # hist[j]: verify steps that accepted exactly j draft tokens
    assert sum(hist) == spec["num_spec_steps"]
    assert sum(j * n for j, n in enumerate(hist)) == spec["num_accepted_draft_tokens"]
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_draft_tokens"]
                                                           / spec["num_spec_steps"])
    assert spec["draft_acceptance_rate"] == pytest.approx(spec["num_accepted_draft_tokens"] / spec["num_draft_tokens"])
    return spec


def test_vllm_shaped_spec_metrics_and_one_log_line(app_client, caplog, tiny_pair):
    import json
    import logging

    http, edge = app_client
    with caplog.at_level(logging.INFO, logger="specdec.edge_serve"):
        r = _completion(http, route="speculative")
    assert r.status_code == 200, r.text
    body, stats = r.json(), edge.last_result.stats
    spec = _read_vllm_spec_metrics(body)
    assert (spec["num_spec_steps"], spec["num_draft_tokens"], spec["num_accepted_draft_tokens"]) == (
        stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    assert spec["num_accepted_draft_tokens"] > 0 and spec["num_spec_tokens"] == 3
    ec = body["metrics"]["edge_cloud"]  # the fields no vLLM harness has: each one there and filled
    assert ec["route"] == ec["route_requested"] == "speculative" and ec["fallback_reason"] is None
    assert ec["rtt_ms"] is not None and ec["rtt_ms"] >= 0 and ec["draft_ms"] > 0 and ec["target_forward_ms"] > 0
    assert ec["num_unjudged_draft_tokens"] >= 0 and ec["num_unverified_tokens"] == 0
    assert ec["num_sessions"] == 1 and ec["num_failovers"] == 0 and ec["route_switches"] == 0
    assert ec["draft_version"] is None  # a local draft
    assert set(ec) == {"route", "route_requested", "route_switches", "fallback_reason", "rtt_ms", "draft_ms",
                       "target_forward_ms", "num_unjudged_draft_tokens", "num_unverified_tokens", "num_sessions",
                       "num_failovers", "draft_version"}
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "specdec.edge_serve"]
    assert len(lines) == 1 and lines[0].startswith(f"request {body['id']} tenant=- route=speculative "
                                                   f"draft={tiny_pair.draft_dir.name} "
                                                   f"prompt_tokens={body['usage']['prompt_tokens']} output_tokens=12")
    assert "finish=length" in lines[0] and f"acceptance={spec['draft_acceptance_rate']:.3f}" in lines[0]
    # streamed: the finishing chunk carries them, as vLLM's last chunk does
    with http.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "Once upon a time", "stream": True,
                                                      "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                                      "route": "speculative"}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    finishing = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finishing) == 1 and _read_vllm_spec_metrics(finishing[0]) == spec  # greedy: the same steps


def test_the_log_line_names_a_draft_head(tiny_pair, tmp_path_factory, caplog):
    """A head (drafts from the verifier's features) is named in the request's log line by its directory, as a
    local ONNX draft is; a request for route device, which a head cannot serve, is a 400 naming ``route`` with
    the endpoint's remedy."""
    import logging

    from fastapi.testclient import TestClient

    from _heads import write_eagle3
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier
    from specdec_runtime.edge_client.client import EdgeClient
    from specdec_runtime.edge_client.drafting.head import HeadDrafter
    from specdec_runtime.edge_client.drafting.head_model import OnnxHead
    from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend
    from specdec.embedded import EmbeddedServer
    from specdec.models.head_export import export_head
    from specdec.openai_server import Engine, create_app

    root = tmp_path_factory.mktemp("log-head")
    vocab = sorted(set(range(0, 49152, 61)) | set(range(200)))
    head = OnnxHead(export_head(tiny_pair.target_dir, write_eagle3(root / "ckpt", tiny_pair.target_dir, vocab),
                                root / "tiny-eagle3-head"))
    with EmbeddedServer(verifier=Verifier(TargetRunner(tiny_pair.target_dir)), grace_s=1.0) as address, \
            GrpcBackend(address) as backend:
        engine = Engine(EdgeClient(backend, HeadDrafter(head), head.tokenizer, num_speculative_tokens=3), "tiny",
                        max_conversations=0)
        with TestClient(create_app(engine)) as http, caplog.at_level(logging.INFO, logger="specdec.edge_serve"):
            r = _completion(http)
            device = _completion(http, route="device")  # a head cannot decode alone: the operator's remedy
        engine.close()
    assert device.status_code == 400 and device.json()["error"]["param"] == "route", device.text
    assert "--device-draft" in device.json()["error"]["message"] and "EdgeClient" not in device.text
    assert r.status_code == 200, r.text
    assert r.json()["metrics"]["speculative_decoding"]["num_draft_tokens"] > 0  # the head drafted
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "specdec.edge_serve"]
    assert len(lines) == 2 and " route=speculative draft=tiny-eagle3-head " in lines[0], lines
    assert lines[1].endswith(" finish=error"), lines  # the refused route=device request
