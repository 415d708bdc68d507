"""The verdict of the verify step (cloud_verifier.batcher.Batcher._apply_verdict), in-process and exact.

A real Verifier (real batcher, session table, MemorySessionStore) over a real target: a tiny random Llama (one
layer, hidden 32) with the real SmolLM2 tokenizer, built here without an ONNX draft so the module sets up in about
a second. Greedy decoding, so every field is known in advance from the target's own greedy continuation
(plain HF ``generate``, tests/_reference.py): the accepted count, the recovered / bonus token and ``is_bonus``,
``next_token_id = -1`` when a stop inside the accepted prefix ends the session, the committed tokens cut by
every stopping rule, the store's record (tokens, ``last_seq``, finish state, owner) and the metrics counted.
The wire-level view of the same fields is test_verdict_fields.py; these run in ~2 s and serve
scripts/mutation.sh.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from prometheus_client import REGISTRY

from _reference import hf_greedy
from specdec_runtime.cloud_verifier.store import MemorySessionStore
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.cloud_verifier.work import Work
from specdec_runtime.common.errors import InvalidRequestError, StaleSessionError, TargetOutputError
from specdec_runtime.common.rejection import verify_block
from specdec_runtime.common.types import DraftBlock, FinishReason, SamplingParams, StoppingCriteria

pytestmark = pytest.mark.timeout(120)

PROMPTS = [[1, 504, 3458, 28], [1, 9690, 314, 253], [1, 2683, 2412, 30, 1170], [1, 22, 333, 4444]]
GAMMA = 4


# Built once per process: the target directory, its runner and the greedy reference are read-only for these
# tests (every verifier here closes its sessions), so a process that runs this module again (scripts/mutation.sh
# forks one per mutant) reuses them instead of rebuilding the model.
_BUILT: dict = {}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, smollm2_tokenizer_dir):
    if "target_dir" not in _BUILT:
        import torch
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                             initializer_range=0.2, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                             pad_token_id=2)
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp("verdict-target")
        LlamaForCausalLM(config).eval().save_pretrained(path)
        AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir)).save_pretrained(path)
        _BUILT["target_dir"] = path
    return _BUILT["target_dir"]


@pytest.fixture(scope="module")
def runner(target_dir):
    if "runner" not in _BUILT:
        _BUILT["runner"] = TargetRunner(target_dir, kv_cache_budget_tokens=8192)
    assert _BUILT["runner"].kv_reserved_tokens == 0  # no session left over from an earlier run
    return _BUILT["runner"]


@pytest.fixture(scope="module")
def ref(target_dir) -> tuple[list[int], list[int]]:
    """(prompt, the target's first 8 greedy tokens), the first 6 all different and none an EOS id."""
    if "ref" not in _BUILT:
        for prompt in PROMPTS:
            tokens = hf_greedy(target_dir, prompt, 8)
            if len(set(tokens[:6])) == 6 and 2 not in tokens:
                _BUILT["ref"] = prompt, tokens
                break
        else:
            pytest.fail("no prompt with 6 distinct greedy tokens")
    return _BUILT["ref"]


def run(runner, body, verifier_id="verdict-unit"):
    """``await body(verifier, store)`` with a started Verifier; stopped afterwards."""

    async def main():
        store = MemorySessionStore(ttl_s=60)
        # fixed verification: each case is a whole block's verdict (an adaptive cut, decided by measured step
        # cost, would verify a prefix of it)
        verifier = Verifier(runner, store, verifier_id=verifier_id, max_num_speculative_tokens=GAMMA,
                            max_batch_wait_ms=0.5, verify_policy="fixed")
        await verifier.start()
        try:
            return await body(verifier, store)
        finally:
            await verifier.stop(1.0)
            verifier.shutdown()

    return asyncio.run(main())


def counters() -> dict[str, float]:
    names = ["specdec_spec_decode_num_drafts_total", "specdec_spec_decode_num_draft_tokens_total",
             "specdec_spec_decode_num_accepted_tokens_total", "specdec_generation_tokens_total"]
    return {n: REGISTRY.get_sample_value(n) or 0.0 for n in names}


def delta(before: dict, after: dict) -> tuple:
    return tuple(after[k] - before[k] for k in before)


# (name, block: "ok" = the target's tokens / "xN" = wrong at N, stopping, expected:
#  (num_accepted, next_token_id index into ref or -1, is_bonus, committed count, finish reason))
CASES = {
    "full block: bonus": ("ok ok ok", {}, (3, 3, True, 4, None)),
    "longest block: bonus": ("ok ok ok ok", {}, (4, 4, True, 5, None)),
    "one-token block: bonus": ("ok", {}, (1, 1, True, 2, None)),
    "rejected at 0": ("x0 ok", {}, (0, 0, False, 1, None)),
    "rejected at 2": ("ok ok x2 ok", {}, (2, 2, False, 3, None)),
    "empty block": ("", {}, (0, 0, False, 1, None)),
    "stop token inside the prefix": ("ok ok ok", {"stop_at": 1}, (2, -1, False, 2, FinishReason.EOS)),
    "stop token at the first draft": ("ok ok ok", {"stop_at": 0}, (1, -1, False, 1, FinishReason.EOS)),
    "stop token is the bonus": ("ok ok ok", {"stop_at": 3}, (3, 3, True, 4, FinishReason.EOS)),
    "stop token is the recovered token": ("ok x1 ok", {"stop_at": 1}, (1, 1, False, 2, FinishReason.EOS)),
    "max_new_tokens inside the prefix": ("ok ok", {"max_new_tokens": 2}, (2, -1, False, 2, FinishReason.LENGTH)),
    "max_new_tokens at the bonus": ("ok ok ok", {"max_new_tokens": 4}, (3, 3, True, 4, FinishReason.LENGTH)),
}


def block_ids(spec: str, tokens: list[int]) -> list[int]:
    out = []
    for i, s in enumerate(spec.split()):
        out.append(tokens[i] if s == "ok" else (tokens[i] + 1) % 49152)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_verdict(runner, ref, name):
    prompt, tokens = ref
    spec, stop, (n, next_index, is_bonus, num_committed, reason) = CASES[name]
    ids = block_ids(spec, tokens)
    stopping = StoppingCriteria(max_new_tokens=stop.get("max_new_tokens", 32), ignore_eos=True,
                                stop_token_ids=(tokens[stop["stop_at"]],) if "stop_at" in stop else ())

    async def body(verifier, store):
        opened = await verifier.open_session(prompt, SamplingParams(), stopping)
        sid = opened.session_id
        before = counters()
        verdict = await verifier.verify(sid, 1, len(prompt), DraftBlock(ids))
        return verdict, delta(before, counters()), store.get(sid), verifier.sessions.held(sid).record

    verdict, counted, stored, held = run(runner, body)
    committed = tokens[:num_committed]
    assert verdict.num_accepted == n
    assert verdict.next_token_id == (tokens[next_index] if next_index >= 0 else -1)
    assert verdict.is_bonus is is_bonus
    assert verdict.committed_token_ids == committed
    assert verdict.committed_length == len(prompt) + num_committed
    assert verdict.finished is (reason is not None) and verdict.finish_reason == reason
    assert verdict.seq == 1 and verdict.batch_size == 1
    assert verdict.forward_ms > 0 and verdict.queue_ms >= 0
    # the commit: the store's record and this replica's copy agree with the verdict
    for record in (stored, held):
        assert record.committed_token_ids == prompt + committed
        assert record.last_seq == 1
        assert record.finished is (reason is not None) and record.finish_reason == reason
    assert stored.verifier_id == "verdict-unit"
    # metrics: one draft of len(ids) tokens, n accepted, num_committed committed
    assert counted == (1, len(ids), n, num_committed)


def test_second_block_extends_the_first(runner, ref):
    """Two verdicts in a row: the second starts where the first's commit ended (its seq, its length)."""
    prompt, tokens = ref

    async def body(verifier, store):
        opened = await verifier.open_session(prompt, SamplingParams(), StoppingCriteria(max_new_tokens=32,
                                                                                        ignore_eos=True))
        first = await verifier.verify(opened.session_id, 1, len(prompt), DraftBlock(tokens[:1]))
        second = await verifier.verify(opened.session_id, 2, first.committed_length, DraftBlock(tokens[2:4]))
        return first, second, store.get(opened.session_id)

    first, second, stored = run(runner, body)
    assert (first.num_accepted, first.next_token_id, first.committed_length) == (1, tokens[1], len(prompt) + 2)
    assert (second.num_accepted, second.next_token_id, second.is_bonus) == (2, tokens[4], True)
    assert second.seq == 2 and second.committed_token_ids == tokens[2:5]
    assert stored.committed_token_ids == prompt + tokens[:5] and stored.last_seq == 2


def test_stale_copy_commits_nothing_and_is_released(runner, ref):
    """The store moved on without this replica (another replica committed): the commit is refused, nothing of
    the block is committed, this replica's copy is dropped and its record left as it was."""
    prompt, tokens = ref

    async def body(verifier, store):
        opened = await verifier.open_session(prompt, SamplingParams(), StoppingCriteria(max_new_tokens=32,
                                                                                        ignore_eos=True))
        sid = opened.session_id
        held = verifier.sessions.held(sid)
        # another replica's commit of one token, straight into the store (this replica's copy is now stale)
        store.append_committed(sid, len(prompt), [tokens[0]], 1, False, None, 0.0, verifier_id="verdict-unit")
        before = counters()
        with pytest.raises(InvalidRequestError, match="committed length"):
            await verifier.batcher.verify(held, 1, len(prompt), DraftBlock(tokens[:2]))
        return store.get(sid), held, verifier.sessions.held(sid), delta(before, counters())

    stored, held, now_held, counted = run(runner, body)
    assert stored.committed_token_ids == prompt + tokens[:1] and stored.last_seq == 1
    assert held.record.committed_token_ids == prompt and held.record.last_seq == 0
    assert now_held is None  # released: the next block resumes from the store
    assert counted == (0, 0, 0, 0)


def test_bonus_drafted_full_block(runner, ref):
    """A bonus_drafted block accepted whole commits its tokens and no bonus token (next_token_id -1,
    is_bonus False)."""
    prompt, tokens = ref
    if "bonus_drafted" not in DraftBlock.__dataclass_fields__:
        pytest.skip("no bonus_drafted blocks in this tree")

    async def body(verifier, store):
        opened = await verifier.open_session(prompt, SamplingParams(), StoppingCriteria(max_new_tokens=32,
                                                                                        ignore_eos=True))
        before = counters()
        verdict = await verifier.verify(opened.session_id, 1, len(prompt), DraftBlock(tokens[:3], bonus_drafted=True))
        return verdict, delta(before, counters())

    verdict, counted = run(runner, body)
    assert (verdict.num_accepted, verdict.next_token_id, verdict.is_bonus) == (3, -1, False)
    assert verdict.committed_token_ids == tokens[:3]
    assert counted == (1, 2, 2, 3)  # metrics count speculative positions: the last token stands for the bonus


def test_sampled_verdict_is_the_rejection_rule_on_the_targets_logits(runner, target_dir, ref):
    """Sampled mode: each verdict equals Algorithm 1 (common.rejection.verify_block) applied to the target's
    logits for the block computed independently (plain HF forward over prompt + block), with the session's seed
    and the block's absolute start position."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt, tokens = ref
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    sampling = SamplingParams(temperature=1.3, top_k=50)

    async def body(verifier, store):
        out = []
        for seed in range(6):
            opened = await verifier.open_session(prompt, SamplingParams(temperature=1.3, top_k=50, seed=seed),
                                                 StoppingCriteria(max_new_tokens=32, ignore_eos=True))
            first = await verifier.verify(opened.session_id, 1, len(prompt), DraftBlock(tokens[:1]))
            committed = list(first.committed_token_ids)
            second = await verifier.verify(opened.session_id, 2, first.committed_length, DraftBlock(tokens[2:5]))
            out.append((opened.seed, committed, second))
        return out

    outcomes = run(runner, body)
    for seed, committed, verdict in outcomes:
        context = prompt + committed
        block = DraftBlock(tokens[2:5])
        with torch.inference_mode():
            logits = model(torch.tensor([context + block.draft_token_ids])).logits[0, len(context) - 1:].numpy()
        expect = verify_block(block, logits, sampling.seeded(seed), len(context), runner.vocab_size)
        assert (verdict.num_accepted, verdict.next_token_id) == (expect.num_accepted, expect.next_token_id), seed
    assert len({c[0] for c in outcomes}) == len(outcomes)  # distinct seeds


def apply_verdict(verifier, held, logits, block, *, seq=1, queue_ms=12.5, forward_ms=3.25, batch_size=7):
    """Batcher._apply_verdict on hand-made logits (what the target thread calls after a forward pass)."""
    work = Work(held, [held.committed[-1], *block.draft_token_ids], held.record.committed_length,
                asyncio.get_running_loop().create_future(), block, seq)
    return verifier.batcher._apply_verdict(work, logits, queue_ms, forward_ms, batch_size)


def queue_wait_sum() -> float:
    return REGISTRY.get_sample_value("specdec_queue_wait_seconds_sum") or 0.0


def test_apply_verdict_on_given_logits(runner, ref):
    """Token id 0 is a token (committed as the recovered token), the timings and batch size given are the
    verdict's, the queue wait is observed in seconds, and the store records the commit's time."""
    prompt, tokens = ref
    vocab = runner.vocab_size

    async def body(verifier, store):
        opened = await verifier.open_session(prompt, SamplingParams(), StoppingCriteria(max_new_tokens=32,
                                                                                        ignore_eos=True))
        held = verifier.sessions.held(opened.session_id)
        logits = np.zeros((3, vocab), np.float32)
        logits[0, 7], logits[1, 0] = 1.0, 1.0  # accept 7, then the target's token is 0 (the draft said 9)
        before = queue_wait_sum()
        t0 = time.time()
        verdict = apply_verdict(verifier, held, logits, DraftBlock([7, 9]))
        return verdict, queue_wait_sum() - before, store.get(opened.session_id), t0

    verdict, waited, stored, t0 = run(runner, body)
    assert (verdict.num_accepted, verdict.next_token_id, verdict.is_bonus) == (1, 0, False)
    assert verdict.committed_token_ids == [7, 0] and stored.committed_token_ids == prompt + [7, 0]
    assert (verdict.queue_ms, verdict.forward_ms, verdict.batch_size) == (12.5, 3.25, 7)
    assert waited == pytest.approx(0.0125, rel=1e-9)
    assert t0 <= stored.last_seen_at <= time.time()


def test_apply_verdict_fault_releases_the_session(runner, ref):
    """NaN logits: TargetOutputError naming the session, nothing committed, this replica's copy released (its
    KV cache is rebuilt from the store before the next block)."""
    prompt, _ = ref

    async def body(verifier, store):
        opened = await verifier.open_session(prompt, SamplingParams(), StoppingCriteria(max_new_tokens=32,
                                                                                        ignore_eos=True))
        sid = opened.session_id
        held = verifier.sessions.held(sid)
        logits = np.full((2, runner.vocab_size), np.nan, np.float32)
        with pytest.raises(TargetOutputError, match=f"for session {sid}: NaN logits"):
            apply_verdict(verifier, held, logits, DraftBlock([7]))
        return store.get(sid), verifier.sessions.held(sid)

    stored, now_held = run(runner, body)
    assert stored.committed_token_ids == prompt and stored.last_seq == 0
    assert now_held is None


def test_commit_refused_when_another_replica_holds_the_session(runner, ref):
    """The store's record names another replica (the session was resumed there): this replica's commit is
    refused even though the committed length still matches."""
    prompt, tokens = ref

    async def body(verifier, store):
        opened = await verifier.open_session(prompt, SamplingParams(), StoppingCriteria(max_new_tokens=32,
                                                                                        ignore_eos=True))
        sid = opened.session_id
        held = verifier.sessions.held(sid)
        assert store.claim(sid, "another-replica", time.time())
        with pytest.raises(StaleSessionError, match="no longer held by replica 'verdict-unit'"):
            await verifier.batcher.verify(held, 1, len(prompt), DraftBlock(tokens[:2]))
        return store.get(sid), verifier.sessions.held(sid)

    stored, now_held = run(runner, body)
    assert stored.committed_token_ids == prompt and stored.verifier_id == "another-replica"
    assert now_held is None
