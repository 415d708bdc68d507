"""edge-serve's ``route`` extension field (specdec/openai_server/route_field.py): the request's route is the one the
generation runs on (reported in the client's last result), absent it is the server's default, a bad value is a 400
naming ``route``. In process: the endpoint's app over an EdgeClient of the tiny pair and a real gRPC verifier."""

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
