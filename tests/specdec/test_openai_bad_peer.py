"""edge-serve pointed at a gRPC server that is not a specdec verifier (it serves only the health service) answers
502 in OpenAI's error JSON, saying so in one line; a request body nested thousands deep is a 400 in the same JSON,
not a plain-text 500. Real components: a grpc server on 127.0.0.1, `specdec edge-serve` as a subprocess, the
official openai client and a raw HTTP request."""

from __future__ import annotations

import http.client
import json
from concurrent import futures

import grpc
import openai
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from test_openai_server import _edge_serve

pytestmark = pytest.mark.timeout(400)


@pytest.fixture
def not_a_verifier():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_not_a_verifier_is_a_502_and_a_deep_body_a_400(real_pair, not_a_verifier):
    with _edge_serve("--server", not_a_verifier) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        with pytest.raises(openai.APIStatusError) as e:
            c.chat.completions.create(model=c.models.list().data[0].id, max_tokens=4,
                                      messages=[{"role": "user", "content": "Hi!"}])
        assert e.value.status_code == 502, e.value
        error = e.value.body
        assert error["type"] == "bad_gateway" and "not a specdec verifier" in error["message"], error
        assert "\n" not in error["message"]

        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/chat/completions", body="[" * 100_000 + "]" * 100_000,
                     headers={"content-type": "application/json"})
        answer = conn.getresponse()
        body = answer.read()
        conn.close()
        assert answer.status == 400, (answer.status, body[:200])
        assert json.loads(body)["error"]["type"] == "invalid_request_error"
