"""16 concurrent sessions through one faulty WAN (specdec.netem): 5 % of chunks stalled 200 ms in each direction,
and connection resets (TCP RST to both peers) while the sessions are mid-stream. Every session — 12 on
route=speculative, 4 on route=cloud (cloud decode) — finishes with no error, every token verified, and its
greedy output token-identical to target-only decoding (HF generate).

Resets: the issue's rate is "one per minute" of a long run; this run lasts a few seconds, so a Poisson rate
scaled to it would give no reset at all with a fair probability (rate × duration ≈ 1 → P(0) ≈ 37 %). The rate is
scaled to "one per run, certainly" and made deterministic in progress instead of time: every open connection is
reset once the cloud sessions have received half their tokens (so a cloud Decode stream is cut mid-stream: they
are the faster ones here and may finish before the speculative sessions are far along), and again once the
speculative sessions have received a third of their fewest possible chunks and one more than at the first reset
(so sessions that have reconnected are hit a second time). Progress, not wall time, keeps the resets inside the run however loaded the
machine is. (gRPC shares one TCP connection among channels to the same address, so each reset cuts every
session's calls at once.)
"""

from __future__ import annotations

import threading
import time

import pytest

from _reference import hf_greedy
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.edge_client.client import EdgeClient, encode_prompt
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.transport.failover import FailoverBackend, RetryPolicy
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
from specdec.embedded import EmbeddedServer
from specdec.netem import LinkProfile, WanProxy

# the tiny pair may be built in this test's setup (slow on a loaded machine)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NUM_SESSIONS = 16
NEW_TOKENS = 24
GAMMA = 3
RUN_TIMEOUT_S = 90.0  # the whole concurrent run, s
SUBJECTS = ["a robot", "the sea", "a red fox", "winter", "a lighthouse", "bread", "a violin", "the moon",
            "a river", "chess", "a small town", "rain", "a library", "mountains", "a train", "coffee"]
PROMPTS = [f"Write two sentences about {s}." for s in SUBJECTS]


def _route(i: int) -> str:
    return "cloud" if i % 4 == 3 else "speculative"


class Progress:
    """Chunks received so far, per route, across all sessions (thread-safe)."""

    def __init__(self):
        self.cond = threading.Condition()
        self.chunks = {"speculative": 0, "cloud": 0}

    def add(self, route: str) -> None:
        with self.cond:
            self.chunks[route] += 1
            self.cond.notify_all()

    def wait_for(self, route: str, n: int, done: threading.Event) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.chunks[route] >= n or done.is_set(), RUN_TIMEOUT_S) \
                and self.chunks[route] >= n


def _session(i, address, model, start, progress, results, errors):
    """One edge device: its own draft model and connection (FailoverBackend), greedy, counting chunks into
    ``progress``; all sessions begin together at the ``start`` barrier."""
    start.wait(timeout=RUN_TIMEOUT_S)
    policy = RetryPolicy(connect_timeout_s=5.0, budget_s=30.0, attempt_timeout_s=20.0)
    backend = FailoverBackend(address, policy=policy, seed=i)
    try:
        with EdgeClient(backend, ModelDrafter(model), model.tokenizer, num_speculative_tokens=GAMMA,
                        timeout_s=30.0, route=_route(i)) as client:
            ids = encode_prompt(model.tokenizer, PROMPTS[i])
            for _ in client.stream_chunks(ids, max_new_tokens=NEW_TOKENS, ignore_eos=True):
                progress.add(_route(i))
            results[i] = (client.last_result, backend.num_failovers)
    except Exception as exc:  # noqa: BLE001 - every error is reported by the assertion
        errors.append((i, repr(exc)))


def _reset_at_progress(wan, progress, marks, done, log):
    """Reset every open connection each time the sessions of a route have received ``n`` chunks, for each
    (route, n) of ``marks`` — and at least one chunk more than at the previous reset, so that a route already
    past its mark when the previous reset came is hit once it streams again (not in the same instant, when
    no connection is open yet). A reset that finds no open connection (a chunk gRPC had buffered before the
    previous reset arrives while every session is still reconnecting) is tried again after the next chunk, up to
    5 times."""
    for route, n in marks:
        with progress.cond:
            at_last_reset = progress.chunks[route] if log else -1
        target = max(n, at_last_reset + 1)
        for _ in range(5):
            if not progress.wait_for(route, target, done):
                return
            hit = wan.reset_connections()
            if hit:
                break
            with progress.cond:
                target = progress.chunks[route] + 1
        log.append((route, n, hit, dict(progress.chunks)))


def test_sixteen_sessions_through_stalls_and_resets_are_target_only(tiny_pair):
    # one draft model per device: one OnnxDraftModel is not shared across threads (its ONNX Runtime binding
    # is not thread-safe: "Only OrtValues that are Tensors are convertible")
    models = [OnnxDraftModel(tiny_pair.draft_dir) for _ in range(NUM_SESSIONS)]
    prompt_ids = [encode_prompt(models[0].tokenizer, p) for p in PROMPTS]
    expected = [hf_greedy(tiny_pair.target_dir, ids, NEW_TOKENS) for ids in prompt_ids]
    verifier = Verifier(TargetRunner(tiny_pair.target_dir, kv_cache_budget_tokens=16384), max_batch_wait_ms=2.0)
    profile = LinkProfile.symmetric(latency_ms=5, jitter_ms=2, stall_probability=0.05, stall_ms=200)
    # speculative: at least one chunk per block of GAMMA + 1 tokens; cloud decode: a chunk per token. The first
    # reset comes at half the cloud tokens (while every cloud session still streams, so a Decode stream is cut),
    # the second at a third of the speculative sessions' fewest chunks (the slower route: still streaming).
    num_cloud = sum(_route(i) == "cloud" for i in range(NUM_SESSIONS))
    marks = (("cloud", num_cloud * NEW_TOKENS // 2),
             ("speculative", (NUM_SESSIONS - num_cloud) * NEW_TOKENS // (GAMMA + 1) // 3))
    results, errors, reset_log = {}, [], []
    progress, done = Progress(), threading.Event()
    with EmbeddedServer(verifier=verifier, grace_s=1.0) as address, WanProxy(0, address, profile, seed=3) as wan:
        resetter = threading.Thread(target=_reset_at_progress, args=(wan, progress, marks, done, reset_log),
                                    daemon=True)
        barrier = threading.Barrier(NUM_SESSIONS)
        threads = [threading.Thread(target=_session, daemon=True,
                                    args=(i, wan.address, models[i], barrier, progress, results, errors))
                   for i in range(NUM_SESSIONS)]
        start = time.monotonic()
        resetter.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=max(0.0, RUN_TIMEOUT_S - (time.monotonic() - start)))
        elapsed = time.monotonic() - start
        done.set()
        resetter.join(timeout=5.0)
        stats = wan.stats()
    failovers = sum(n for _, n in results.values())
    print(f"{NUM_SESSIONS} sessions through the faulty WAN: {elapsed:.1f} s, resets at {reset_log}, "
          f"{failovers} failovers, {stats}")
    assert not errors, errors
    assert sorted(results) == list(range(NUM_SESSIONS)), f"unfinished sessions after {RUN_TIMEOUT_S} s"
    for i, (result, _) in results.items():
        assert result.token_ids == expected[i], (i, _route(i))
        assert result.num_unverified_tokens == 0, i
        assert result.route["tokens"][_route(i)] == NEW_TOKENS, (i, result.route)
    # the faults happened and hit live streams
    assert len(reset_log) == 2 and all(n >= 1 for _, _, n, _ in reset_log), reset_log
    assert stats.reset_events >= 2 and stats.resets >= 2
    # Not asserted: that a cloud session itself saw a failover. The progress marks count chunks the sessions have
    # consumed, and gRPC may already hold the rest of a Decode stream when the reset comes (seen: 0 cloud
    # failovers in 1 run of 5). A Decode stream cut mid-stream, deterministically: test_cloud_decode.py's
    # test_cloud_route_survives_a_reset_mid_stream.
    assert failovers >= 1
    assert stats.stalls >= 1  # both directions together: one alone sees ~100 chunks, P(no stall) ~ 0.6 %
