"""route=cloud-first (and auto's cloud-first start) end to end over real gRPC on 127.0.0.1: the cloud streams the
first tokens while the draft prefills in its own thread, then the session goes on speculatively: greedy output
token-identical to target-only (HF generate), one session, tokens from both modes; a seeded sampled generation
with a forced hand-over point (an injected RouteSwitcher) gives the same tokens on every run whatever the draft's
speed (a fast draft, one slowed 4x: its prefill ends at another time), and, drafter-invariant (its default), the
same tokens at another hand-over point, on the cloud alone and on speculation alone (Algorithm 1: other tokens). The hand-over comes mid-stream, at the token the draft is ready (StopDecode ends the
Decode call at a token boundary; the tokens committed until the stop lands are read to the stream's end): a
seeded sampled generation handed over that way gives exactly the tokens of one handed over at a chunk end at the
same token."""

from __future__ import annotations

import pytest

from _reference import hf_greedy
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.edge_client.client import EdgeClient, encode_prompt
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
from specdec.bench.wan import SlowDrafter
from specdec.embedded import EmbeddedServer

pytestmark = pytest.mark.timeout(400)

PROMPT = ("Tell me a long story about a robot who learns to paint, with the colours of the sea, the names of "
          "its friends and what it saw on the way home.")


@pytest.fixture(scope="module")
def served(tiny_pair):
    verifier = Verifier(TargetRunner(tiny_pair.target_dir, kv_cache_budget_tokens=8192), max_batch_wait_ms=1.0)
    with EmbeddedServer(verifier=verifier, grace_s=1.0) as address:
        yield address


@pytest.fixture(scope="module")
def draft(tiny_pair):
    return OnnxDraftModel(tiny_pair.draft_dir)


class HandOverAfter:
    """A RouteSwitcher that hands a cloud-first start over to speculative after exactly ``k`` cloud tokens,
    ready or not (the prefill is stopped there; the first block feeds the rest), and never switches back."""

    def __init__(self, k: int):
        self.k = k

    def cloud_chunk_tokens(self, run):
        return self.k

    def to_speculative(self, client, run):
        return f"after {self.k} cloud tokens"

    def to_cloud(self, client, run):
        return None


class HandOverWhenReady:
    """A RouteSwitcher whose cloud-first Decode call asks for every token (no chunk end), and that hands over
    mid-stream at the first cloud token after the draft is ready, once at least ``k`` tokens were generated."""

    def __init__(self, k: int):
        self.k = k

    def cloud_chunk_tokens(self, run):
        return 0

    def hand_over(self, client, run):
        return "ready" if run.num_generated >= self.k else None

    def to_speculative(self, client, run):
        return None

    def to_cloud(self, client, run):
        return None


def _client(backend, drafter, tokenizer, **kw):
    return EdgeClient(backend, drafter, tokenizer, num_speculative_tokens=3, **kw)


def test_cloud_first_and_auto_are_target_only(tiny_pair, served, draft):
    ids = encode_prompt(draft.tokenizer, PROMPT)
    assert len(ids) > 40
    expected = hf_greedy(tiny_pair.target_dir, ids, 48)
    with GrpcBackend(served) as backend:
        results = {}
        for route in ("cloud-first", "auto"):  # a fresh client: auto knows nothing yet, so it starts cloud-first
            client = _client(backend, ModelDrafter(draft, draft_top_k=5), draft.tokenizer, route=route)
            results[route] = client.generate(ids, max_new_tokens=48, ignore_eos=True)
        forced = _client(backend, ModelDrafter(draft, draft_top_k=5), draft.tokenizer, route="cloud-first",
                         route_switcher=HandOverAfter(7))
        results["forced"] = forced.generate(ids, max_new_tokens=48, ignore_eos=True)
    for name, result in results.items():
        route = result.route
        print(name, route)
        assert result.token_ids == expected, name
        assert route["initial"] == "cloud", (name, route)
        assert result.num_sessions == 1 and route["tokens"]["cloud"] + route["tokens"]["speculative"] == 48
    # the hand-over happened mid-way, at a time reported. When cloud-first and auto hand over depends on how fast
    # the draft catches up with the cloud on this machine's load (a race), so only the forced hand-over must happen;
    # a route that stayed on the cloud says why, and either way its tokens are the target's, asserted above
    for name in ("cloud-first", "auto"):
        if results[name].route["final"] == "cloud":
            assert "cloud" in results[name].route["why"], (name, results[name].route)
    switched = [n for n in ("cloud-first", "auto", "forced") if results[n].route["final"] == "speculative"]
    assert "forced" in switched, {n: results[n].route for n in results}
    for name in switched:
        route = results[name].route
        assert route["final"] == "speculative", (name, route)
        assert route["tokens"]["speculative"] > 0 < route["tokens"]["cloud"], (name, route)
        assert route["switches"][0]["to"] == "speculative" and route["switches"][0]["at_s"] > 0, (name, route)
    for name in [n for n in switched if n != "forced"]:  # asked mid-stream (cloud-first's call asks every token)
        switch = results[name].route["switches"][0]
        assert switch["asked_at_token"] <= switch["at_token"] < 48 and switch["asked_s"] <= switch["at_s"], switch
    assert results["forced"].route["switches"][0]["at_token"] == 7


def test_seeded_sampled_hand_over_is_reproducible_whatever_the_draft_speed(served, draft):
    ids = encode_prompt(draft.tokenizer, PROMPT)
    kw = dict(max_new_tokens=40, temperature=1.0, top_k=20, ignore_eos=True, seed=11)
    runs = {}
    with GrpcBackend(served) as backend:
        for k, slowdown in ((2, 1), (2, 30), (2, 1), (20, 1), (20, 4)):
            drafter = SlowDrafter(ModelDrafter(draft, draft_top_k=5), slowdown)
            client = _client(backend, drafter, draft.tokenizer, route="cloud-first", route_switcher=HandOverAfter(k))
            result = client.generate(ids, **kw)
            assert [s["at_token"] for s in result.route["switches"]] == [k]
            assert result.route["tokens"]["cloud"] == k
            runs.setdefault(k, []).append(result.token_ids)
    for k, outs in runs.items():
        assert all(out == outs[0] for out in outs), k  # the same hand-over point: the same tokens
    assert runs[2][0][:2] == runs[20][0][:2]  # the cloud's first tokens are the same draws


def test_seeded_sampled_mid_stream_hand_over_equals_a_chunk_end_one_at_the_same_token(served, draft):
    """The stop hands over at a token the timing decides (k + the tokens in flight); whatever it is, the output
    equals that of a hand-over at a chunk end at the same token: no token lost, repeated, or drawn otherwise."""
    ids = encode_prompt(draft.tokenizer, PROMPT)
    kw = dict(max_new_tokens=40, temperature=1.0, top_k=20, ignore_eos=True, seed=5)
    with GrpcBackend(served) as backend:
        outs = []
        for k in (3, 12):
            stopped = _client(backend, ModelDrafter(draft, draft_top_k=5), draft.tokenizer, route="cloud-first",
                              route_switcher=HandOverWhenReady(k)).generate(ids, **kw)
            (switch,) = stopped.route["switches"]
            at = switch["at_token"]
            assert k <= switch["asked_at_token"] <= at < 40 and stopped.route["tokens"]["cloud"] == at, switch
            chunked = _client(backend, ModelDrafter(draft, draft_top_k=5), draft.tokenizer, route="cloud-first",
                              route_switcher=HandOverAfter(at)).generate(ids, **kw)
            assert chunked.route["switches"][0]["at_token"] == at
            assert stopped.token_ids == chunked.token_ids, (k, at)
            outs.append((at, stopped.token_ids))
    if outs[0][0] != outs[1][0]:  # other switch points: other tokens of the same distribution (not required)
        print("hand-over at", outs[0][0], "and", outs[1][0], "identical:", outs[0][1] == outs[1][1])


def test_an_older_verifier_without_stop_decode_hands_over_at_a_chunk_end(tiny_pair, served, draft):
    """A verifier without StopDecode answers UNIMPLEMENTED (a bare gRPC server stands for it): the backend
    remembers it, and cloud-first then sizes its chunks to the draft's readiness and hands over at a chunk end,
    still token-identical to target-only."""
    import time
    from concurrent import futures

    import grpc

    bare = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = bare.add_insecure_port("127.0.0.1:0")
    bare.start()
    try:
        with GrpcBackend(f"127.0.0.1:{port}") as old:
            old.stop_decode("no-such-session", 1)
            deadline = time.monotonic() + 10
            while old.can_stop_decode and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not old.can_stop_decode
    finally:
        bare.stop(0)
    ids = encode_prompt(draft.tokenizer, PROMPT)
    with GrpcBackend(served) as backend:
        backend.can_stop_decode = False  # as after that answer
        client = _client(backend, ModelDrafter(draft, draft_top_k=5), draft.tokenizer, route="cloud-first")
        result = client.generate(ids, max_new_tokens=48, ignore_eos=True)
    (switch,) = result.route["switches"]
    assert "asked_at_token" not in switch and result.route["final"] == "speculative", result.route
    assert result.token_ids == hf_greedy(tiny_pair.target_dir, ids, 48)


def _close_cloud_pick(est, client, ids, new_tokens, block_samples):
    """``est`` (a client's measured estimates) with the speculative blocks' wall time set so that, for this
    prompt on a fresh draft, the cost model picks the cloud by 10 % (speculative's finish is linear in it), its
    rate resting on ``block_samples`` blocks."""
    import copy

    from specdec_runtime.edge_client.generation.routing import FIRST_CLOUD_CHUNK, MAX_CLOUD_CHUNK

    est = copy.deepcopy(est)
    est.block_rtt_ms, est.generations_since_blocks = est.rtt_ms, 0
    unseen, cloud = len(ids) - 1, est.cloud_finish_ms(new_tokens, FIRST_CLOUD_CHUNK, MAX_CLOUD_CHUNK)
    spec = []
    for wall in (100.0, 200.0):
        est.block_wall_ms = wall
        spec.append(est.speculative_finish_ms(client, new_tokens, unseen))
    est.block_wall_ms = 100.0 + 100.0 * (1.1 * cloud - spec[0]) / (spec[1] - spec[0])
    assert est.block_wall_ms > 0 and est.choose(client, new_tokens, unseen, FIRST_CLOUD_CHUNK, MAX_CLOUD_CHUNK)[0] \
        == "cloud"
    est._counts["block_wall_ms"] = block_samples
    return _frozen(est)


def _frozen(est):
    """``est`` that no longer learns from the run: the decisions under test are made on the estimates given,
    not on this run's own timings (the machine's load would move a 10 % margin either way)."""
    import dataclasses

    from specdec_runtime.edge_client.generation.route_cost import RouteEstimates

    class FrozenEstimates(RouteEstimates):
        def observe_block(self, *args, **kwargs):
            pass

        def observe_cloud(self, *args, **kwargs):
            pass

        def observe_prefill(self, *args, **kwargs):
            pass

    return FrozenEstimates(**{f.name: getattr(est, f.name) for f in dataclasses.fields(est)})


def test_auto_explores_a_close_cloud_pick_on_thin_estimates_and_stays_target_only(tiny_pair, served, draft):
    """The cost model picks the cloud by 10 %: on a rate measured from 3 blocks auto explores (a cloud-first
    start that hands over once the draft is ready), token-identical to target-only; on one measured from 100
    recent blocks it stays on the cloud to the end. Both runs decide on the estimates given (frozen: see
    :func:`_frozen`)."""
    ids = encode_prompt(draft.tokenizer, PROMPT)
    expected = hf_greedy(tiny_pair.target_dir, ids, 48)
    with GrpcBackend(served) as backend:
        learner = _client(backend, ModelDrafter(draft, draft_top_k=5), draft.tokenizer, route="auto")
        learner.generate(ids, max_new_tokens=48, ignore_eos=True)  # measures both routes' estimates
        assert learner.route_estimates.cloud_first_ms is not None
        results = {}
        for samples in (3, 100):
            client = _client(backend, ModelDrafter(draft, draft_top_k=5), draft.tokenizer, route="auto")
            client.route_estimates = _close_cloud_pick(learner.route_estimates, client, ids, 48, samples)
            results[samples] = client.generate(ids, max_new_tokens=48, ignore_eos=True)
    explored, kept = results[3].route, results[100].route
    print(explored, kept, sep="\n")
    assert results[3].token_ids == expected and results[100].token_ids == expected
    assert explored["initial"] == "cloud" and "from 3 blocks only" in explored["explore"], explored
    assert explored["switches"][0]["to"] == "speculative" and explored["tokens"]["speculative"] > 0, explored
    assert kept["initial"] == kept["final"] == "cloud" and "explore" not in kept, kept
    assert kept["tokens"]["cloud"] == 48 and not kept["switches"], kept


def test_seeded_sampled_tokens_are_the_same_at_any_switch_point(served, draft):
    """A seeded sampled cloud-first generation is drafter-invariant (common.rejection): handed over after 2 or
    after 20 cloud tokens, or sent wholly to the cloud or to speculation (invariance asked for), the same tokens,
    those of cloud decode with the seed. Negative control: with Algorithm 1 (drafter_invariant=False) the two
    hand-over points give other tokens."""
    ids = encode_prompt(draft.tokenizer, PROMPT)
    kw = dict(max_new_tokens=40, temperature=1.0, top_k=20, ignore_eos=True, seed=23)
    with GrpcBackend(served) as backend:
        def run(route, k=None, **more):
            switcher = HandOverAfter(k) if k is not None else None
            client = _client(backend, ModelDrafter(draft, draft_top_k=5), draft.tokenizer, route=route,
                             route_switcher=switcher)
            return client.generate(ids, **kw, **more)

        cloud = run("cloud").token_ids
        handed = {k: run("cloud-first", k) for k in (2, 20)}
        speculative = run("speculative", drafter_invariant=True)
        classic = run("speculative").stats.acceptance_rate  # Algorithm 1 (the speculative route's default)
        algorithm_1 = {k: run("cloud-first", k, drafter_invariant=False).token_ids for k in (2, 20)}
    for k, result in handed.items():
        assert [s["at_token"] for s in result.route["switches"]] == [k]
        assert result.route["tokens"]["speculative"] == 40 - k
        assert result.token_ids == cloud, k
    assert speculative.token_ids == cloud
    accepted = speculative.stats.acceptance_rate
    print(f"\nacceptance rate: drafter-invariant {accepted:.2f}, Algorithm 1 {classic:.2f}")
    assert accepted > 0.2  # the draft's coupled draws match the target's often: blocks are accepted in part
    assert algorithm_1[2] != algorithm_1[20]


class CountingDrafter(ModelDrafter):
    """The ONNX drafter, recording the draft tokens each ``propose`` was asked for."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.asked: list[int] = []

    def propose(self, committed_token_ids, num_speculative_tokens, *args, **kwargs):
        self.asked.append(num_speculative_tokens)
        return super().propose(committed_token_ids, num_speculative_tokens, *args, **kwargs)


def test_drafter_invariant_sessions_draft_no_bonus_position(served, draft):
    """A seeded sampled drafter-invariant session with adaptive γ sends classic blocks (γ draft tokens, not γ + 1:
    its tokens depend on no schedule, so a draft token at the bonus position would buy nothing) and keeps the
    cloud route's tokens. Control: the same session under Algorithm 1 drafts γ + 1 (bonus_drafted blocks)."""
    ids = encode_prompt(draft.tokenizer, PROMPT)
    kw = dict(max_new_tokens=24, temperature=1.0, top_k=20, ignore_eos=True, seed=5)
    with GrpcBackend(served) as backend:
        cloud = _client(backend, None, draft.tokenizer, route="cloud").generate(ids, **kw).token_ids
        asked = {}
        for invariant in (True, False):
            drafter = CountingDrafter(draft, draft_top_k=5)
            client = _client(backend, drafter, draft.tokenizer, route="speculative", adaptive=True)
            result = client.generate(ids, **kw, drafter_invariant=invariant)
            asked[invariant] = drafter.asked
            if invariant:
                assert result.token_ids == cloud
    assert asked[True] and max(asked[True]) == 3, asked  # num_speculative_tokens=3 (_client)
    assert max(asked[False]) == 4, asked
