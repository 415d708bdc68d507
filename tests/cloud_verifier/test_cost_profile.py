"""The adaptive policy's cost model does not hold the verifier up: real Verifier, tiny Llama target (conftest
``tiny_pair``), the real EdgeClient with its ONNX drafter over LocalBackend, cost tables in a temp dir.

- ``Verifier.start()`` with the default policy measures one probe pass, no profile: a session is opened and
  verified (greedy tokens == HF target-only) while the background profile cannot have run (it waits for an hour
  without work); let go, it profiles and saves the table; the next start reads that table and profiles nothing;
- a saved table is what the policy decides from: a steep one makes it cut blocks, and the tokens stay exact;
- a profile pass gives way: it stops between passes when work arrives, and never takes a page it would have to
  evict or a session may need (returns the pages it took);
- the table file: atomic, and ignored when unreadable or for another key.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from _cluster import wait_until
from _reference import hf_greedy
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.cloud_verifier.verify_policy.cost import PROFILE_SHAPES, ForwardCostModel, measure_shape
from specdec_runtime.cloud_verifier.verify_policy.cost_table import CostTableCache, target_key
from specdec_runtime.edge_client.client import EdgeClient, encode_prompt
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
from specdec.embedded import LocalBackend

pytestmark = pytest.mark.timeout(300)

PROMPT = "Tell me a story about a robot who learns to paint."
NEW_TOKENS = 24
HOUR_S = 3600.0  # a quiet period no test reaches: the background profile does not run


@pytest.fixture(scope="module")
def runner(tiny_pair):
    return TargetRunner(tiny_pair.target_dir, kv_cache_budget_tokens=8192)


@pytest.fixture(scope="module")
def draft(tiny_pair):
    return OnnxDraftModel(tiny_pair.draft_dir)


def _generate(backend, draft, ids) -> list[int]:
    client = EdgeClient(backend, ModelDrafter(draft, draft_top_k=4), draft.tokenizer, num_speculative_tokens=6)
    return client.generate(ids, max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids


def test_start_serves_first_then_profiles_and_saves(runner, draft, tiny_pair, tmp_path):
    ids = encode_prompt(draft.tokenizer, PROMPT)
    verifier = Verifier(runner, max_num_speculative_tokens=8, cost_table_dir=tmp_path, profile_quiet_s=HOUR_S)
    backend = LocalBackend(verifier)  # runs Verifier.start() (default policy: adaptive)
    try:
        cost = verifier.batcher.verify_policy.cost
        assert verifier.batcher.verify_policy.uses_cost_model
        assert cost.num_observations == 1 and verifier.profiler.prior == "probe"  # one probe pass, no profile
        assert _generate(backend, draft, ids) == hf_greedy(tiny_pair.target_dir, ids, NEW_TOKENS)
        assert not verifier.profiler.done.is_set() and verifier.profiler.points == []  # served before any profile
        assert not list(tmp_path.iterdir())

        verifier.profiler.quiet_s = 0.0  # let it go: idle now (the session was closed)
        assert wait_until(verifier.profiler.done.is_set, 120.0, step_s=0.05)
        saved = verifier.profiler.saved_to
        assert saved is not None and saved.parent == tmp_path
        assert [(r, t) for r, t, _ in verifier.profiler.points] == [(r, r * n) for r, n in PROFILE_SHAPES]
        assert cost.num_observations > len(PROFILE_SHAPES)  # probe + live steps + profile
    finally:
        backend.close()

    again = Verifier(runner, max_num_speculative_tokens=8, cost_table_dir=tmp_path, profile_quiet_s=0.0)
    backend = LocalBackend(again)
    try:
        from_file = ForwardCostModel()
        for r, t, s in json.loads(saved.read_text())["points"]:
            from_file.observe_profiled(r, t, s)
        assert again.profiler.prior == "saved" and again.profiler.done.is_set()  # nothing left to profile
        assert again.batcher.verify_policy.cost.coefficients() == from_file.coefficients()
        assert _generate(backend, draft, ids) == hf_greedy(tiny_pair.target_dir, ids, NEW_TOKENS)
    finally:
        backend.close()


def test_a_saved_table_decides_the_cuts_and_tokens_stay_exact(runner, draft, tiny_pair, tmp_path):
    """A steep saved table (every token of a pass costs as much as the first: a verifier deep in its
    compute-bound regime) makes the adaptive policy cut low-confidence tails from the first step on."""
    model_id = "steep"
    steep = [(rows, tokens, 0.02 * tokens) for rows, tokens in ((1, 1), (1, 16), (4, 16), (4, 64), (16, 128))]
    CostTableCache(tmp_path).save(target_key(runner, model_id), steep)
    verifier = Verifier(runner, model_id=model_id, max_num_speculative_tokens=8, cost_table_dir=tmp_path,
                        profile_quiet_s=HOUR_S)
    backend = LocalBackend(verifier)
    try:
        assert verifier.profiler.prior == "saved"
        for prompt in (PROMPT, "one two three four, one two three four, one two"):
            ids = encode_prompt(draft.tokenizer, prompt)
            assert _generate(backend, draft, ids) == hf_greedy(tiny_pair.target_dir, ids, NEW_TOKENS), prompt
    finally:
        backend.close()
    policy = verifier.batcher.verify_policy
    assert policy.verified_positions < policy.drafted_positions  # the table made it cut


def test_a_profile_pass_gives_way_and_takes_no_page_it_needs(runner):
    pages = runner.kv_pool.pages
    free = pages.num_free
    assert measure_shape(runner, 1, 8, should_stop=lambda: True) is None  # work is waiting: not even the warm-up
    assert measure_shape(runner, 1, 8) > 0
    too_many = free // -(-8 // runner.kv_pool.page_size) + 1
    assert measure_shape(runner, too_many, 8) is None  # the pool is short: measured later, nothing evicted
    assert pages.num_free == free  # every page it took is back


def test_profiler_stops_with_the_verifier(runner, tmp_path):
    verifier = Verifier(runner, cost_table_dir=tmp_path, profile_quiet_s=0.0)

    async def run():
        await verifier.start()
        await verifier.stop(1.0)

    asyncio.run(run())
    assert verifier.profiler.done.is_set()  # ended (cancelled mid-profile or finished), nothing left running


def test_table_file_is_atomic_and_checked(runner, tmp_path):
    cache = CostTableCache(tmp_path)
    key = target_key(runner, "m")
    points = [(1, 8, 0.01), (8, 64, 0.05)]
    path = cache.save(key, points)
    assert cache.load(key) == points and [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left
    assert cache.load({**key, "threads": key["threads"] + 1}) is None  # another key: another file
    assert cache.load({**key, "dtype": "bfloat16"}) is None
    path.write_text('{"version": 1, "key": ')  # cut short (a writer that died before os.replace leaves none)
    assert cache.load(key) is None
    path.write_text(json.dumps({"version": 1, "key": {**key, "model": "other"}, "points": [[1, 8, 0.01]]}))
    assert cache.load(key) is None
