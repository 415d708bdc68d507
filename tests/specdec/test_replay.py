"""specdec.bench.replay on the tiny pair: the recording is cached under its key; replayed sessions against a real
gRPC verifier get exactly the recorded verdicts (and a tampered recording is caught as mismatches); the kernel
limit is measured. The whole `bench --replay` (verifier processes) is run by hand: docs/benchmarks.md, scripts/gpu_check.sh."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest

from specdec_runtime.cloud_verifier.store import MemorySessionStore
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec.bench.prompts import load_prompts
from specdec.bench.replay import load_or_record, measure_kernel_limit, recording_key, replay_sessions
from specdec.bench.replay.kernel import kernel_kv_tokens
from specdec.embedded import EmbeddedServer

pytestmark = pytest.mark.timeout(180)

PROMPTS = [
    {"question_id": 1, "category": "writing", "turns": ["Write a haiku about autumn leaves."]},
    {"question_id": 2, "category": "math", "turns": ["What is 12 times 7?"]},
    {"question_id": 3, "category": "qa", "turns": ["Name three rivers in Europe."]},
]
MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def setup(tiny_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("replay")
    prompts = root / "q.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    runner = TargetRunner(tiny_pair.target_dir, kv_cache_budget_tokens=1 << 16)
    calls = []

    def factory():
        calls.append(1)
        return runner

    def record(max_new_tokens=MAX_NEW_TOKENS):
        return load_or_record(prompts, load_prompts(prompts, 3), 3, tiny_pair.target_dir, tiny_pair.draft_dir,
                              factory, max_new_tokens=max_new_tokens, num_speculative_tokens=4, device="cpu",
                              dtype="float32", cache_dir=root / "cache")

    return dict(prompts=prompts, runner=runner, record=record, calls=calls, tiny=tiny_pair)


def test_recording_is_cached_under_its_key(setup):
    first = setup["record"]()
    assert not first.cached and len(setup["calls"]) == 1
    assert len(first.prompts) == 3 and first.num_steps >= 3
    for p in first.prompts:
        assert p.steps[0].committed_length == len(p.prompt_token_ids)
        assert p.steps[-1].finished and p.steps[-1].verdict_committed_length == len(p.prompt_token_ids) + len(
            p.output_token_ids)
        for s in p.steps:
            assert len(s.draft_token_ids) <= 4
    again = setup["record"]()
    assert again.cached and len(setup["calls"]) == 1  # no model run
    assert again.key == first.key and again.prompts == first.prompts
    other = recording_key(setup["prompts"], 3, setup["tiny"].target_dir, setup["tiny"].draft_dir,
                          num_speculative_tokens=4, max_new_tokens=MAX_NEW_TOKENS + 1, device="cpu", dtype="float32")
    assert other != first.key


def test_replayed_sessions_get_the_recorded_verdicts(setup):
    rec = setup["record"]()
    verifier = Verifier(setup["runner"], MemorySessionStore(ttl_s=60), max_batch_size=8)
    with EmbeddedServer(verifier=verifier) as address:
        tally = asyncio.run(replay_sessions(address, rec.prompts, 4, 2.0, max_new_tokens=rec.max_new_tokens,
                                            tokenizer_fingerprint=rec.tokenizer_fingerprint))
        assert tally.errors == 0, tally.error_samples
        assert tally.mismatches == 0, tally.mismatch_samples
        assert tally.sessions_completed > 0 and tally.verdicts > 0 and tally.tokens > 0
        assert tally.batch_size_sum > tally.verdicts  # 4 sessions at once: some blocks shared a forward pass
        assert verifier.num_sessions == 0  # every session closed

        tampered = copy.deepcopy(rec.prompts)
        step = tampered[0].steps[0]
        step.next_token_id += 1  # a recorded verdict the verifier will not give
        tally = asyncio.run(replay_sessions(address, tampered[:1], 1, 1.0, max_new_tokens=rec.max_new_tokens))
        assert tally.mismatches >= 1 and tally.errors == 0
        assert tally.mismatch_samples[0]["expected"][1] == step.next_token_id
    assert setup["runner"].kv_reserved_tokens == 0


def test_kernel_limit(setup):
    rec = setup["record"]()
    k = measure_kernel_limit(setup["runner"], rec.prompts, 4, 4, repeats=1)
    assert k["speedup"] > 0 and k["batched_ms"] > 0 and k["single_row_ms"] > 0
    assert k["tokens_per_row"] == 5 and k["mean_context_tokens"] > 0
    assert setup["runner"].kv_reserved_tokens == 0
    # the bench sizes its own runner's pool with kernel_kv_tokens: a pool of exactly that holds the N rows
    need = kernel_kv_tokens(rec.prompts, 4, 4)
    assert need >= 4 * (k["mean_context_tokens"] + 4)
    exact = TargetRunner(setup["runner"].model_dir, kv_cache_budget_tokens=need, check_architecture=False)
    assert measure_kernel_limit(exact, rec.prompts, 4, 4, repeats=1)["speedup"] > 0


def test_cloud_decoded_replay_gets_the_recorded_outputs(setup):
    """The same recorded sessions cloud-decoded (Decode): every token is the recorded one (greedy), several
    sessions' rows share forward passes; a tampered recording is a mismatch (negative control)."""
    rec = setup["record"]()
    verifier = Verifier(setup["runner"], MemorySessionStore(ttl_s=60), max_batch_size=8)
    with EmbeddedServer(verifier=verifier) as address:
        tally = asyncio.run(replay_sessions(address, rec.prompts, 4, 2.0, max_new_tokens=rec.max_new_tokens,
                                            tokenizer_fingerprint=rec.tokenizer_fingerprint, cloud=True))
        assert tally.errors == 0, tally.error_samples
        assert tally.mismatches == 0, tally.mismatch_samples
        assert tally.sessions_completed > 0 and tally.tokens == tally.verdicts > 0
        assert tally.batch_size_sum > tally.verdicts  # 4 sessions at once: rows shared forward passes
        tampered = copy.deepcopy(rec.prompts)
        tampered[0].output_token_ids[2] += 1
        tally = asyncio.run(replay_sessions(address, tampered[:1], 1, 1.0, max_new_tokens=rec.max_new_tokens,
                                            cloud=True))
        assert tally.mismatches >= 1 and tally.mismatch_samples[0]["token"] == 2
        assert verifier.num_sessions == 0


def test_steady_rate_does_not_depend_on_where_the_window_cuts_a_step():
    """Batch steps of 18 s committing 3 tokens to each of 8 slots, a 20 s window opened by a step's verdicts: the
    window receives that step's verdicts and the next one's (1.8x the true 8 * 3 / 18 tokens/s over the window);
    the rate between verdicts is the true one. A slot with one verdict in the window counts over the window."""
    from specdec.bench.replay.sessions import ReplayTally

    tally = ReplayTally(window_s=20.0)
    true_rate = 8 * 3 / 18.0
    for _ in range(8):  # verdicts as the window opens (100 s) and one step later
        tally.add_slot(first_t=100.0, last_t=118.0, tokens_after_first=3, tokens_in_window=6,
                       verdicts_after_first=1, verdicts_in_window=2)
    assert tally.steady_tokens_per_s() == pytest.approx(true_rate, abs=0.005)
    assert tally.steady_verdicts_per_s() == pytest.approx(8 / 18.0, abs=0.001)  # one block per slot and step
    assert 8 * 6 / tally.window_s == pytest.approx(1.8 * true_rate, rel=1e-3)  # what tokens / window says
    tally.add_slot(first_t=109.0, last_t=109.0, tokens_after_first=0, tokens_in_window=4)
    assert tally.steady_tokens_per_s() == pytest.approx(true_rate + 4 / 20.0, abs=0.005)
    assert ReplayTally(window_s=20.0).steady_tokens_per_s() is None
