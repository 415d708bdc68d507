"""The cost model behind route="auto" (edge_client/generation/route_cost.py), as pure functions of its estimates: Leviathan et
al.'s expected tokens per step, the α estimate from truncated blocks, the choice of speculative at a short round
trip vs cloud at a long one (with the draft cost that decides between them), and the start-up each route pays (the
draft's catch-up, a Decode call's first token) deciding short generations and switches."""

from __future__ import annotations

import random

import pytest

from specdec_runtime.common.types import DraftBlock, Verdict
from specdec_runtime.edge_client.generation.observation import BlockObservation
from specdec_runtime.edge_client.generation.route_cost import RouteEstimates, expected_tokens_per_step


class _Client:
    num_speculative_tokens = 4
    proactive = False
    backend = None


class _Run:
    class stopping:
        max_new_tokens = 256

    num_generated = 0
    committed: list[int] = []
    max_context_tokens = None


def test_expected_tokens_per_step_is_leviathan_eq_1():
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    # Monte Carlo: i.i.d. acceptance until the first rejection, + the bonus/recovered token
    rng, alpha, gamma = random.Random(0), 0.7, 4
    steps = [1 + next((i for i in range(gamma) if rng.random() >= alpha), gamma) for _ in range(200_000)]
    assert sum(steps) / len(steps) == pytest.approx(expected_tokens_per_step(alpha, gamma), rel=0.01)


def test_alpha_estimate_from_blocks_recovers_the_acceptance():
    rng, est = random.Random(1), RouteEstimates()
    for alpha in (0.3, 0.8):
        est.accepted = est.rejected = None
        sums = []
        for _ in range(400):
            n = next((i for i in range(4) if rng.random() >= alpha), 4)
            _observe(est, DraftBlock([1, 2, 3, 4]), Verdict(n, 5, n == 4, [1] * (n + 1), 10), 5.0, 0.001)
            sums.append(est.alpha)
        assert sum(sums[-200:]) / 200 == pytest.approx(alpha, abs=0.08)
    # negative control: the naive accepted / drafted ratio is biased low (truncation at the first rejection)
    assert (0.8 * (1 - 0.8 ** 4) / (1 - 0.8)) / 4 < 0.7


def _observe(est: RouteEstimates, block: DraftBlock, verdict: Verdict, round_trip_ms: float, draft_s: float,
             wall_ms: float | None = None) -> None:
    est.observe_block(BlockObservation(block, verdict, round_trip_ms, draft_s), wall_ms)


def _estimates(rtt_ms: float, draft_ms: float) -> RouteEstimates:
    return RouteEstimates(rtt_ms=rtt_ms, draft_ms_per_token=draft_ms, verify_ms=20.0, cloud_step_ms=20.0,
                          accepted=2.4, rejected=0.6)  # α = 0.8


def test_choice_follows_the_round_trip_and_the_draft_cost():
    client = _Client()
    assert _estimates(rtt_ms=2, draft_ms=2).choose(client, 256, 0, 64)[0] == "speculative"
    assert _estimates(rtt_ms=200, draft_ms=2).choose(client, 256, 0, 64)[0] == "cloud"
    assert _estimates(rtt_ms=2, draft_ms=60).choose(client, 256, 0, 64)[0] == "cloud"  # a slow device
    # nothing known of the draft: cloud only when it beats a perfect one
    unknown = RouteEstimates(rtt_ms=200, hint_forward_ms=20.0)
    assert unknown.choose(client, 256, 0, 64)[0] == "cloud"
    assert RouteEstimates(rtt_ms=1, hint_forward_ms=20.0).choose(client, 256, 0, 64)[0] == "speculative"


def _slow_draft() -> RouteEstimates:
    """Measured: speculative blocks commit 3 tokens per 60 ms (50 tok/s), cloud tokens come every 25 ms (40 tok/s)
    after a first one 100 ms after the call; the draft ingests unseen context at 4 ms per token (a slow device's
    prefill), drafts at 10 ms per token, RTT 50 ms, verify 20 ms."""
    return RouteEstimates(rtt_ms=50.0, draft_ms_per_token=10.0, catchup_ms_per_token=4.0, verify_ms=20.0,
                          cloud_step_ms=25.0, cloud_first_ms=100.0, cloud_first_rtt_ms=50.0, block_wall_ms=60.0,
                          tokens_per_block=3.0, block_rtt_ms=50.0, accepted=2.0, rejected=1.0)


def test_start_up_decides_short_generations_steady_rates_long_ones():
    """Steady rates favour speculative (50 vs 40 tok/s). For 32 tokens after a 200-token prompt the draft's
    catch-up (800 ms) and first block (~110 ms) make cloud sooner (~0.88 s vs ~1.49 s); for 2,000 tokens the
    start-up is paid once and speculative wins (~40.9 s vs ~50.5 s); with the prompt already in the draft's cache
    (0 unseen) speculative wins the short one too. A rate-only model picks speculative for all three."""
    client, est = _Client(), _slow_draft()
    assert est.speculative_tokens_per_s(client) > est.cloud_tokens_per_s(1024)  # steady: speculative faster
    assert est.speculative_finish_ms(client, 32, 200) == pytest.approx(800 + 110.5 + 1000 * 29 / 50)
    assert est.cloud_finish_ms(32, 64, 1024) == pytest.approx(100 + 31 * 25)
    assert est.choose(client, 32, 200, 64, 1024)[0] == "cloud"
    assert est.choose(client, 2000, 200, 64, 1024)[0] == "speculative"
    assert est.choose(client, 32, 0, 64, 1024)[0] == "speculative"


def test_cloud_chunks_each_pay_the_first_token_delay_shifted_by_the_rtt():
    """64 + 128 + 8 tokens: three Decode calls, each 100 ms to its first token; an RTT 30 ms longer than when the
    first token was measured adds 30 ms to each."""
    est = _slow_draft()
    assert est.cloud_finish_ms(200, 64, 1024) == pytest.approx(3 * 100 + (63 + 127 + 7) * 25)
    assert est.cloud_finish_ms(200, 64) == pytest.approx(100 + 199 * 25)  # one call for the rest
    est.rtt_ms = 80.0
    assert est.cloud_finish_ms(200, 64, 1024) == pytest.approx(3 * 130 + (63 + 127 + 7) * 25)


def test_switching_back_to_speculative_pays_the_draft_catch_up():
    """Between cloud chunks with 100 tokens left (cloud: ~2.65 s), speculative is expected to finish ~23 % sooner
    when the draft is caught up (~2.05 s), but only ~3 % when it must first ingest the 128 tokens cloud decode
    committed (+0.51 s): below the switch margin, auto stays on cloud (a rate-only model switched: 50 vs 39 tok/s)."""
    from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
    from specdec_runtime.edge_client.generation.routing import RouteRun, after_chunk

    class _Drafter:  # ModelDrafter's record of its cache, without a model
        _cached_ids: list[int] = []
        _cached_prefix, uncached = ModelDrafter._cached_prefix, ModelDrafter.uncached

    client, run = _Client(), _Run()
    client.route_estimates, client.drafter = _slow_draft(), _Drafter()
    run.committed = list(range(200))
    run.num_generated, run.route = 156, RouteRun("auto", mode="cloud", steps_in_mode=1)
    _Drafter._cached_ids = list(range(71))  # the prompt and the first speculative tokens: 128 cloud tokens unseen
    after_chunk(client, run)
    assert run.route.mode == "cloud"
    _Drafter._cached_ids = list(range(199))  # caught up: the switch pays no catch-up and wins
    after_chunk(client, run)
    assert run.route.mode == "speculative"


def test_first_block_of_a_segment_measures_the_catch_up_not_the_draft_cost():
    """A segment's first block drafts 4 tokens after ingesting 100 unseen ones (430 ms); the next blocks draft 4 in
    40 ms. c_draft stays 10 ms (the first block is not a per-token sample), c_catchup = (430 − 4·10) / 100; the same
    after a second segment (a switch back from cloud decode) with 50 unseen tokens."""
    est = RouteEstimates()
    verdict = Verdict(3, 5, False, [1, 2, 3, 4], 10, forward_ms=20.0)
    for unseen, first_ms in ((100, 430.0), (50, 235.0)):
        est.begin_segment(unseen)
        _observe(est, DraftBlock([1, 2, 3, 4], draft_ms=first_ms), verdict, 25.0, first_ms / 1000)
        for _ in range(5):
            _observe(est, DraftBlock([1, 2, 3, 4], draft_ms=40.0), verdict, 25.0, 0.04, 70.0)
        assert est.draft_ms_per_token == pytest.approx(10.0)
        assert est.catchup_ms_per_token == pytest.approx(3.9)


def test_running_means_are_unbiased_by_the_first_sample():
    """A short warm-up chunk: 15 cloud tokens, the first gap 100 ms (a stalled token), the rest 20 ms: the estimate
    is their mean, not ~60 % the first one (an EWMA started from it)."""
    est = RouteEstimates()
    for gap in [100.0] + [20.0] * 14:
        est.observe_cloud(False, gap, Verdict(0, 5, False, [5], 11))
    assert est.cloud_step_ms == pytest.approx((100 + 14 * 20) / 15)


def test_measured_block_rate_overrides_the_model_and_follows_the_rtt():
    """Blocks whose wall time says 4 tokens per 200 ms (20 tok/s) make the speculative estimate 20 tok/s, whatever
    the model would say from α and the draft cost; a later RTT 100 ms longer (learnt from cloud tokens) moves it
    to 4 tokens per 300 ms. The draft's cost per token is the block's own draft_ms, not the edge time spent
    drafting for it (which includes drafting the next block ahead)."""
    client, est = _Client(), RouteEstimates()
    for i in range(30):
        block = DraftBlock([1, 2, 3, 4], draft_ms=8.0)
        _observe(est, block, Verdict(3, 5, False, [1, 2, 3, 4], 10, forward_ms=20.0), 25.0, 0.5,
                          None if i == 0 else 200.0)
    model = RouteEstimates(rtt_ms=est.rtt_ms, draft_ms_per_token=est.draft_ms_per_token, verify_ms=est.verify_ms,
                           accepted=est.accepted, rejected=est.rejected)
    assert est.draft_ms_per_token == pytest.approx(2.0)
    assert model.speculative_tokens_per_s(client) > 40  # the model alone: far faster than measured
    assert est.speculative_tokens_per_s(client) == pytest.approx(20.0, rel=1e-6)
    rtt = est.rtt_ms
    for _ in range(200):  # cloud tokens whose first arrives a full RTT of 105 ms later
        est.observe_cloud(True, 105.0 + 20.0, Verdict(0, 5, False, [5], 11, forward_ms=20.0))
    assert est.rtt_ms == pytest.approx(105.0, abs=0.5) and rtt == pytest.approx(5.0)
    assert est.speculative_tokens_per_s(client) == pytest.approx(1000 * 4 / 300, rel=0.01)


def test_one_slow_cloud_token_barely_moves_the_step_estimate():
    est = RouteEstimates()
    for _ in range(40):
        est.observe_cloud(False, 50.0, Verdict(0, 5, False, [5], 11))
    est.observe_cloud(False, 850.0, Verdict(0, 5, False, [5], 11))  # one 800 ms stall
    assert est.cloud_step_ms == pytest.approx(100.0)


def test_auto_switches_at_a_block_boundary_only_with_enough_tokens_left():
    """Cloud expected far faster (RTT 200 ms, slow draft): auto leaves speculative after a block — unless fewer than
    MIN_TOKENS_LEFT_TO_SWITCH tokens are left, where the switch's round trip and the estimates' noise outweigh the
    gain."""
    from specdec_runtime.edge_client.generation.routing import MIN_TOKENS_LEFT_TO_SWITCH, RouteRun, SpeculativeRoute

    class _AutoClient(_Client):
        route_estimates = _estimates(rtt_ms=200, draft_ms=60)

    class _AutoRun(_Run):
        class stopping:
            max_new_tokens = 64

    block, verdict = DraftBlock([1, 2, 3, 4], draft_ms=240.0), Verdict(1, 5, False, [1, 5], 10, forward_ms=20.0)
    switched = {}
    for left in (MIN_TOKENS_LEFT_TO_SWITCH + 8, MIN_TOKENS_LEFT_TO_SWITCH - 1):
        run = _AutoRun()
        run.num_generated, run.route = 64 - left, RouteRun("auto", steps_in_mode=5)
        switched[left] = SpeculativeRoute(_AutoClient(), run).after_block(BlockObservation(block, verdict, 220.0, 0.24))
        assert run.route.mode == ("cloud" if switched[left] else "speculative")
    assert switched == {MIN_TOKENS_LEFT_TO_SWITCH + 8: True, MIN_TOKENS_LEFT_TO_SWITCH - 1: False}


def test_a_generation_s_last_block_is_not_a_rate_sample():
    """Blocks of 4 tokens per 200 ms, then the last block of a generation, cut to the 1 token left (finished, 120
    ms): the speculative rate stays 20 tok/s (counting it: 13 tokens per 720 ms, 18 tok/s)."""
    client, est = _Client(), RouteEstimates()
    for _ in range(3):
        _observe(est, DraftBlock([1, 2, 3, 4], draft_ms=8.0), Verdict(3, 5, False, [1, 2, 3, 4], 10), 25.0,
                          0.01, 200.0)
    _observe(est, DraftBlock([1], draft_ms=2.0), Verdict(0, 5, False, [1], 10, finished=True), 25.0, 0.002, 120.0)
    assert est.speculative_tokens_per_s(client) == pytest.approx(20.0)


def test_auto_explores_a_close_thin_or_stale_speculative_estimate_only():
    """A cloud pick by less than EXPLORE_MARGIN is explored while the speculative rate rests on fewer than
    MIN_RATE_SAMPLES blocks, and again once no block came for EXPLORE_AFTER_GENERATIONS generations; a clear cloud
    win, or a close one on a fresh, well-measured rate, is taken as it is."""
    from types import SimpleNamespace

    from specdec_runtime.edge_client.generation.route_cost import EXPLORE_AFTER_GENERATIONS, EXPLORE_MARGIN, MIN_RATE_SAMPLES

    est, opened = RouteEstimates(), SimpleNamespace(load=0.0, forward_ms=20.0)
    close, far = (1.1 * 4000, 4000.0), (1.01 * EXPLORE_MARGIN * 4000, 4000.0)
    assert est.explore_reason(*close) and "from 0 blocks" in est.explore_reason(*close)
    assert est.explore_reason(*far) is None and est.explore_reason(None, 4000.0) is None
    for i in range(MIN_RATE_SAMPLES - 1):
        _observe(est, DraftBlock([1, 2, 3, 4], draft_ms=8.0), Verdict(3, 5, False, [1, 2, 3, 4], 10), 25.0,
                          0.01, None if i == 0 else 200.0)
    assert est.explore_reason(*close) is not None  # one block short of MIN_RATE_SAMPLES rate samples
    _observe(est, DraftBlock([1, 2, 3, 4], draft_ms=8.0), Verdict(3, 5, False, [1, 2, 3, 4], 10), 25.0,
                      0.01, 200.0)
    _observe(est, DraftBlock([1, 2, 3, 4], draft_ms=8.0), Verdict(3, 5, False, [1, 2, 3, 4], 10), 25.0,
                      0.01, 200.0)
    assert est.explore_reason(*close) is None  # measured and fresh: exploit
    for _ in range(EXPLORE_AFTER_GENERATIONS):  # generations on the cloud, no block
        est.begin(None, opened)
    assert est.explore_reason(*close) is None
    est.begin(None, opened)
    assert f"no block in {EXPLORE_AFTER_GENERATIONS} generations" in est.explore_reason(*close)
    assert est.explore_reason(*far) is None
    _observe(est, DraftBlock([1, 2, 3, 4], draft_ms=8.0), Verdict(3, 5, False, [1, 2, 3, 4], 10), 25.0,
                      0.01, 200.0)
    assert est.explore_reason(*close) is None  # the explored generation's blocks refresh it
