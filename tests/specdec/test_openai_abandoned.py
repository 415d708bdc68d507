"""edge-serve and a client that goes away before its non-streamed answer: the generation stops at its next chunk,
the one worker is free for the requests behind it, and the request is logged ``finish=abandoned``.

In process: the endpoint's app under a real uvicorn server on 127.0.0.1, an EdgeClient of the tiny pair and a real
gRPC verifier. The draft is held inside its second block until the test lets it go, so that the disconnect
happens while the generation is in flight whatever the machine's speed; nothing here waits on a clock but the
bounded loops."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import socket
import threading
import time

import pytest

pytestmark = pytest.mark.timeout(400)

HOLD_DEADLINE_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, deadline_s: float) -> bool:
    end = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


@contextlib.contextmanager
def _serving(tiny_pair):
    """(port, drafter, engine): the endpoint under uvicorn on 127.0.0.1, its generations held inside their second
    block while ``drafter.hold`` is set (until ``drafter.release``, bounded)."""
    import uvicorn

    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier
    from specdec_runtime.edge_client.client import EdgeClient
    from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
    from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend
    from specdec.embedded import EmbeddedServer
    from specdec.openai_server import Engine, create_app

    class HeldDrafter(ModelDrafter):
        """The real drafter; while ``hold`` is set, its second proposal waits for ``release`` (bounded)."""

        def __init__(self, model):
            super().__init__(model)
            self.hold, self.held, self.release = threading.Event(), threading.Event(), threading.Event()
            self.proposals = 0

        def propose(self, *args, **kwargs):
            self.proposals += 1
            if self.hold.is_set() and self.proposals == 2:
                self.held.set()
                self.release.wait(HOLD_DEADLINE_S)
            return super().propose(*args, **kwargs)

    class WatchedEngine(Engine):
        jobs: list = []

        def submit(self, req):
            job = super().submit(req)
            self.jobs.append(job)
            return job

    verifier = Verifier(TargetRunner(tiny_pair.target_dir, kv_cache_budget_tokens=8192), max_batch_wait_ms=1.0)
    draft = OnnxDraftModel(tiny_pair.draft_dir)
    drafter = HeldDrafter(draft)
    port = _free_port()
    with EmbeddedServer(verifier=verifier, grace_s=1.0) as address, GrpcBackend(address) as backend:
        edge = EdgeClient(backend, drafter, draft.tokenizer, num_speculative_tokens=2, route="speculative")
        engine = WatchedEngine(edge, "tiny", max_conversations=0)
        engine.jobs = []
        server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            assert _wait(lambda: server.started, 60), "uvicorn did not start"
            yield port, drafter, engine
        finally:
            drafter.release.set()
            server.should_exit = True
            thread.join(30)
            engine.close()


def _request_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("request ")]


def test_an_abandoned_non_streamed_request_stops_and_frees_the_worker(tiny_pair, caplog):
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    caplog.set_level(logging.INFO)
    with _serving(tiny_pair) as (port, drafter, engine):
        drafter.hold.set()
        gone = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        gone.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"})
        assert drafter.held.wait(60), "the generation never reached its second block"
        gone.close()  # the client goes away while its generation is in flight
        job = engine.jobs[0]
        stopped = _wait(job.cancelled.is_set, HOLD_DEADLINE_S / 2)
        drafter.hold.clear()
        drafter.release.set()
        assert stopped, "the server never noticed that the client of a non-streamed request had gone"
        # the worker is free: the next request is answered, and in full
        after = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        after.request("POST", "/v1/completions", body=json.dumps({**body, "max_tokens": 8}),
                      headers={"content-type": "application/json"})
        answer = after.getresponse()
        assert answer.status == 200
        assert json.loads(answer.read())["usage"]["completion_tokens"] == 8
        after.close()
    lines = _request_lines(caplog)
    assert any("finish=abandoned" in line for line in lines), lines
    # the abandoned generation stopped at its next chunk: its 64 tokens alone would take at least 22 proposals
    # (3 tokens a block at most); stopped, it and the second request's 8 tokens take at most 11
    assert drafter.proposals < 64 // 3


def test_an_abandoned_streamed_request_is_logged_and_stops(tiny_pair, caplog):
    """A streamed request whose client goes away after its first event: the generation stops and the request's
    one log line says ``finish=abandoned``."""
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 64, "temperature": 0, "ignore_eos": True,
            "stream": True}
    caplog.set_level(logging.INFO)
    with _serving(tiny_pair) as (port, drafter, engine):
        drafter.hold.set()
        gone = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        gone.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"})
        answer = gone.getresponse()
        assert answer.status == 200
        assert answer.readline().startswith(b"data: "), "no first event"
        assert drafter.held.wait(60), "the generation never reached its second block"
        gone.sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
        gone.close()
        drafter.hold.clear()
        drafter.release.set()
        job = engine.jobs[0]
        assert _wait(job.cancelled.is_set, HOLD_DEADLINE_S / 2), "the stream's generation never stopped"
        assert _wait(lambda: any("finish=abandoned" in line for line in _request_lines(caplog)), 30), \
            _request_lines(caplog)
    assert drafter.proposals < 64 // 3
