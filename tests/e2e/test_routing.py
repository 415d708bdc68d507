"""Route per request (edge_client.generation.routing) end to end over real gRPC on 127.0.0.1: route=cloud and a generation
forced to switch speculative → cloud → speculative ... every two blocks are token-identical to target-only
(HF generate); a seeded sampled switched one is reproducible; route=device is the draft alone, flagged
unverified, with no verifier at all; auto picks cloud decode over a 40 ms one-way WAN (specdec.netem) and is not
slower than the faster fixed route by more than a margin."""

from __future__ import annotations

import time

import pytest

from _reference import hf_greedy
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.common.errors import InvalidRequestError
from specdec_runtime.edge_client.client import EdgeClient, encode_prompt
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.transport.failover import FailoverBackend, RetryPolicy
from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
from specdec.embedded import EmbeddedServer

pytestmark = pytest.mark.timeout(400)  # the tiny pair is built in the first test's setup (slow on a loaded machine)

PROMPT = "Tell me a story about a robot who learns to paint."


@pytest.fixture(scope="module")
def served(tiny_pair):
    verifier = Verifier(TargetRunner(tiny_pair.target_dir, kv_cache_budget_tokens=8192), max_batch_wait_ms=1.0)
    with EmbeddedServer(verifier=verifier, grace_s=1.0) as address:
        yield address, verifier


@pytest.fixture(scope="module")
def draft(tiny_pair):
    return OnnxDraftModel(tiny_pair.draft_dir)


def _client(backend, draft, **kw):
    return EdgeClient(backend, ModelDrafter(draft, draft_top_k=5), draft.tokenizer, num_speculative_tokens=3, **kw)


class EveryNBlocks:
    """A RouteSwitcher that switches on a fixed schedule: to cloud after ``n`` speculative blocks, back after
    one cloud chunk, whatever the costs, to prove switching loses and repeats nothing."""

    def __init__(self, n: int):
        self.n = n

    def to_cloud(self, client, run):
        return f"every {self.n} blocks" if run.route.steps_in_mode >= self.n else None

    def to_speculative(self, client, run):
        return "after one cloud chunk" if run.route.steps_in_mode >= 1 else None

    def cloud_chunk_tokens(self, run):
        return self.n  # an n-token cloud chunk


def test_route_cloud_and_forced_switching_are_target_only(tiny_pair, served, draft):
    address, _ = served
    ids = encode_prompt(draft.tokenizer, PROMPT)
    expected = hf_greedy(tiny_pair.target_dir, ids, 40)
    with GrpcBackend(address) as backend:
        cloud = _client(backend, draft, route="cloud").generate(ids, max_new_tokens=40, ignore_eos=True)
        switching = _client(backend, draft, route_switcher=EveryNBlocks(2))  # 2 blocks, a cloud chunk, again
        switched = switching.generate(ids, max_new_tokens=40, ignore_eos=True)
    assert cloud.token_ids == expected and cloud.route["tokens"] == {"speculative": 0, "cloud": 40, "device": 0}
    assert switched.token_ids == expected
    route = switched.route
    assert len(route["switches"]) >= 6 and route["tokens"]["cloud"] > 0 and route["tokens"]["speculative"] > 0
    assert route["tokens"]["cloud"] + route["tokens"]["speculative"] == 40
    assert {s["to"] for s in route["switches"]} == {"cloud", "speculative"}
    assert switched.num_sessions == 1 and switched.num_unverified_tokens == 0  # one session, modes in turn


def test_seeded_sampled_switching_is_reproducible(served, draft):
    address, _ = served
    ids = encode_prompt(draft.tokenizer, "Name a color.")
    kw = dict(max_new_tokens=30, temperature=1.0, top_k=20, ignore_eos=True)
    runs = []
    with GrpcBackend(address) as backend:
        for seed in (7, 7, 8):
            client = _client(backend, draft, route_switcher=EveryNBlocks(2))
            runs.append(client.generate(ids, seed=seed, **kw))
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].token_ids != runs[2].token_ids  # negative control: another seed, other tokens
    def points(run):  # where the switches fell (not when: at_s is a time)
        return [{k: v for k, v in s.items() if k != "at_s"} for s in run.route["switches"]]

    assert points(runs[0]) == points(runs[1])


def test_route_device_is_the_draft_alone_flagged_unverified(tiny_pair, draft):
    """No verifier listens anywhere: route=device still generates, every chunk unverified, and its tokens are
    the draft's greedy ones (the tiny draft is the target exported: HF greedy)."""
    ids = encode_prompt(draft.tokenizer, PROMPT)
    backend = FailoverBackend("127.0.0.1:1", policy=RetryPolicy(connect_timeout_s=0.5, budget_s=1.0), connect=False)
    with _client(backend, draft, route="speculative") as client:
        chunks = list(client.stream_chunks(ids, max_new_tokens=12, ignore_eos=True, route="device"))
        result = client.last_result
        with pytest.raises(InvalidRequestError, match="route must be one of"):
            list(client.stream_chunks(ids, route="fastest"))
    assert chunks and not any(c.verified for c in chunks)
    assert result.num_unverified_tokens == 12 and result.num_sessions == 0
    assert result.route["tokens"]["device"] == 12 and result.token_ids == hf_greedy(tiny_pair.target_dir, ids, 12)


def test_auto_picks_cloud_over_a_slow_wan(tiny_pair, served, draft):
    """40 ms each way through the WAN proxy: a block of 3 draft tokens costs a round trip of 80 ms, the cloud
    streams a token per forward pass. auto must end on cloud decode, with most tokens decoded there; all three
    outputs identical. The three routes' times are printed, not asserted (a loaded machine moves them)."""
    from specdec.netem import LinkProfile, WanProxy

    address, _ = served
    ids = encode_prompt(draft.tokenizer, PROMPT)
    n = 48
    with WanProxy(0, address, LinkProfile.symmetric(latency_ms=40), seed=0) as wan, GrpcBackend(wan.address) as b:
        client = _client(b, draft)
        client.generate(ids, max_new_tokens=4, ignore_eos=True)  # warm-up: connection, draft session
        times, results = {}, {}
        for route in ("speculative", "cloud", "auto"):
            t0 = time.perf_counter()
            results[route] = client.generate(ids, max_new_tokens=n, ignore_eos=True, route=route)
            times[route] = time.perf_counter() - t0
    print({k: round(v, 3) for k, v in times.items()}, results["auto"].route)
    assert results["speculative"].token_ids == results["cloud"].token_ids == results["auto"].token_ids
    assert results["auto"].route["final"] == "cloud" and results["auto"].route["tokens"]["cloud"] > n // 2
