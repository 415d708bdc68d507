"""bonus_drafted blocks (common.rejection, ``DraftBlock.bonus_drafted``): certain outcomes, independence of the
output from where blocks end, and statistical losslessness under top-k and top-p.

Model. A Markov "language" over SV = 8 tokens: raw target and draft logits depend on the previous token only;
both sides process them with the same SamplingParams (temperature → top-k → top-p, common.sampling), so the
target's processed law is P0 / P[prev] and target-only sampling gives (c0, c1) ~ P0 · P[c0]. The edge drafts
with top-k drafting (k = 3: q is the draft's processed top 3, renormalised) and the real counter-based streams
(``uniform(seed, t, DRAFT_SAMPLE)``); the verifier is :func:`common.rejection.verify_block` on raw logits rows
[last committed, x_1..x_{n-1}] (bonus_drafted) or [last committed, x_1..x_γ] (classic). The loop commits
accepted + next token (when not -1), as the client does.

Checked:
- boundary independence: each seed gives the same tokens with γ = 1, 2, 4 and a random γ per block, and with
  blocks truncated at random (confidence truncation, proactive drafting) — and the classic bonus rule does NOT
  (negative control: its outputs depend on the schedule);
- losslessness (Leviathan et al. 2023, Appendix A.1 per position): c0 ~ P0, (c0, c1) ~ P0·P, c2 ~ P0·P·P by
  total-variation distance under a multinomial-noise bound and chi-square (helpers of test_rejection.py), with
  γ alternating 1 and 2 per seed so the bonus_drafted position falls on c1 or c2 and a second block follows;
  for a top-k and a top-p SamplingParams;
- negative controls fail the same checks: accepting every draft token (output ~ q), resampling from p after a
  rejection, and committing the bonus_drafted token without its acceptance test (the bug this rule must avoid).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from specdec_runtime.common.rejection import RejectionResult, verify_block, verify_greedy, verify_sampled
from specdec_runtime.common.sampling import Stream, dense_draft_probs, logits_to_probs, normalize_sparse, sample_from, uniform
from specdec_runtime.common.sampling import draft_topk_from_probs
from specdec_runtime.common.types import DraftBlock, SamplingParams, SparseDraftProbs
from test_rejection import check

SV = 8
K = 3  # top-k drafting
PARAMS = {
    "top_k": SamplingParams(temperature=0.9, top_k=5),
    "top_p": SamplingParams(temperature=0.9, top_p=0.75),
}


# --------------------------------------------------------------------------------------- certain outcomes


def test_greedy_bonus_drafted_full_block_has_no_bonus_token():
    logits = np.full((3, 6), -5.0, dtype=np.float32)
    for i, a in enumerate([1, 2, 3]):
        logits[i, a] = 5.0
    assert verify_greedy([1, 2, 3], logits, bonus_drafted=True) == RejectionResult(3, -1)
    assert RejectionResult(3, -1).committed == 3
    assert verify_greedy([1, 2, 4], logits, bonus_drafted=True) == RejectionResult(2, 3)  # last position rejected
    assert verify_greedy([1, 2], logits) == RejectionResult(2, 3)  # classic: the same rows give a bonus token


def test_sampled_bonus_drafted_certain_outcomes():
    p = np.zeros((2, 4))
    p[0, 1] = p[1, 2] = 1.0  # the target is certain at both positions
    ok = verify_sampled([1, 2], None, p, seed=5, start_position=10, bonus_drafted=True)
    assert ok == RejectionResult(2, -1)
    bad = verify_sampled([1, 3], None, p, seed=5, start_position=10, bonus_drafted=True)
    assert bad == RejectionResult(1, 2)  # the bonus_drafted token is tested like any other: rejected, recovered


def test_verify_block_checks_the_rows_of_a_bonus_drafted_block():
    sp = SamplingParams(temperature=1.0)
    block = DraftBlock([1, 2, 3], bonus_drafted=True)
    assert DraftBlock([1, 2, 3], bonus_drafted=True).num_scored_positions == 3
    assert DraftBlock([1, 2, 3]).num_scored_positions == 4
    with pytest.raises(ValueError):
        verify_block(block, np.zeros((4, 6), np.float32), sp.seeded(0), 10)  # classic rows for a bonus_drafted block
    res = verify_block(block, np.zeros((3, 6), np.float32), sp.seeded(0), 10)
    assert 0 <= res.num_accepted <= 3


# --------------------------------------------------------------------------------------- the model


def _logits():
    rng = np.random.default_rng(20251130)
    target = rng.normal(scale=1.3, size=(SV + 1, SV))  # row 0: after an empty prefix, row 1 + s: after token s
    draft = target + rng.normal(scale=1.1, size=(SV + 1, SV))  # a related but different draft
    return target.astype(np.float32), draft.astype(np.float32)


TARGET_LOGITS, DRAFT_LOGITS = _logits()


def _row(state: int) -> int:
    return 0 if state < 0 else state + 1


@functools.lru_cache(maxsize=None)
def target_probs(mode: str, state: int) -> np.ndarray:
    return logits_to_probs(TARGET_LOGITS[_row(state)], PARAMS[mode])[0]


@functools.lru_cache(maxsize=None)
def draft_q(mode: str, state: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Top-k drafting after ``state``: ids [k'], wire probs [k'] float32, the float64 q the edge samples from."""
    ids, probs = draft_topk_from_probs(logits_to_probs(DRAFT_LOGITS[_row(state)], PARAMS[mode])[0], K)
    return ids, probs, normalize_sparse(probs)


def draft(out: list[int], n: int, mode: str, seed: int) -> DraftBlock:
    """n draft tokens after the committed ``out``, each from its q with the DRAFT_SAMPLE draw of its position."""
    if n == 0:
        return DraftBlock([])  # classic γ = 0: plain decoding (the token is sampled from p)
    tokens, rows_ids, rows_q = [], [], []
    for i in range(n):
        state = (out + tokens)[-1] if out or tokens else -1
        ids, probs, q = draft_q(mode, state)
        tokens.append(int(ids[sample_from(q, uniform(seed, len(out) + i, Stream.DRAFT_SAMPLE))]))
        pad = np.array([t for t in range(SV) if t not in set(ids.tolist())][: K - len(ids)], dtype=np.int64)
        rows_ids.append(np.concatenate([ids, pad]))
        rows_q.append(np.concatenate([probs, np.zeros(len(pad), np.float32)]))
    return DraftBlock(tokens, SparseDraftProbs(np.stack(rows_ids), np.stack(rows_q)))


def scored_logits(out: list[int], block: DraftBlock) -> np.ndarray:
    """The target's raw logits rows for the block: [last committed, x_1, ...] (block.num_scored_positions rows)."""
    fed = ([out[-1]] if out else [-1]) + list(block.draft_token_ids)
    fed = fed[: block.num_scored_positions]
    return np.stack([TARGET_LOGITS[_row(s)] for s in fed])


def generate(seed: int, mode: str, n_tokens: int, schedule, bonus_drafted: bool, verify=verify_block) -> list[int]:
    """The edge/verifier loop until ``n_tokens`` are committed; ``schedule(step)`` gives γ (speculative tokens)."""
    out: list[int] = []
    sp = dataclass_seeded(mode, seed)
    step = 0
    while len(out) < n_tokens:
        gamma = schedule(step)
        block = draft(out, gamma + 1 if bonus_drafted else gamma, mode, seed)
        block.bonus_drafted = bonus_drafted
        res = verify(block, scored_logits(out, block), sp, len(out))  # sp carries the seed
        out += list(block.draft_token_ids[: res.num_accepted]) + ([res.next_token_id] if res.next_token_id >= 0 else [])
        step += 1
    return out[:n_tokens]


def dataclass_seeded(mode: str, seed: int) -> SamplingParams:
    p = PARAMS[mode]
    return SamplingParams(p.temperature, p.top_k, p.top_p, seed)


def test_model_is_nontrivial():
    for mode in PARAMS:
        p0 = target_probs(mode, -1)
        ids, _, q = draft_q(mode, -1)
        q0 = np.zeros(SV)
        q0[ids] = q
        assert 0.2 < 0.5 * np.abs(p0 - q0).sum() < 0.9  # rejections and acceptances both common
        assert (p0 == 0).sum() >= 2  # the processing cut tokens
    assert (target_probs("top_p", -1) > 0).sum() < SV - 2  # top-p is the one cutting here


# --------------------------------------------------------------------------------------- boundary independence

N_SEEDS, N_OUT = 150, 12


def _schedules(seed: int) -> dict:
    rng = np.random.default_rng(seed + 7)
    random_gammas = rng.integers(0, 5, size=64)  # γ = 0 (only the bonus_drafted token) up to 4
    return {
        "γ=1": lambda step: 1,
        "γ=2": lambda step: 2,
        "γ=4": lambda step: 4,
        "random γ": lambda step: int(random_gammas[step]),
    }


@pytest.mark.parametrize("mode", list(PARAMS))
def test_bonus_drafted_output_does_not_depend_on_block_boundaries(mode):
    differs = 0
    for seed in range(N_SEEDS):
        outs = {name: generate(seed, mode, N_OUT, sched, bonus_drafted=True) for name, sched in _schedules(seed).items()}
        assert len({tuple(o) for o in outs.values()}) == 1, (seed, outs)
        differs += len({tuple(generate(seed, mode, N_OUT, s, bonus_drafted=False)) for s in _schedules(seed).values()}) > 1
    # negative control: the classic bonus token (sampled straight from p at the end of a full block) makes
    # the same seeds depend on the schedule
    assert differs > N_SEEDS // 3, differs


# --------------------------------------------------------------------------------------- losslessness

N_SMALL, N_LARGE = 1_000, 16_000


def verify_accept_all(block, logits, sp, start):
    """Negative control (a): every draft token accepted (output ~ q)."""
    return RejectionResult(len(block), -1)


def verify_resample_from_p(block, logits, sp, start):
    """Negative control (b): the bonus_drafted rule, but after a rejection the token is drawn from p, not from
    the residual norm(max(0, p − q))."""
    probs = logits_to_probs(logits, sp)
    for i, x in enumerate(block.draft_token_ids):
        q = dense_draft_probs(block.draft_token_ids, block.draft_probs, i, probs.shape[-1])
        if uniform(sp.seed, start + i, Stream.ACCEPT) * q[x] < probs[i, x]:
            continue
        return RejectionResult(i, sample_from(probs[i], uniform(sp.seed, start + i, Stream.TARGET_SAMPLE)))
    return RejectionResult(len(block), -1)


def verify_last_unchecked(block, logits, sp, start):
    """Negative control (c): the bonus_drafted token committed without its acceptance test (as if it were a
    bonus token the target had sampled)."""
    n = len(block)
    res = verify_block(DraftBlock(block.draft_token_ids[:-1], _rows(block.draft_probs, n - 1), bonus_drafted=False),
                       logits, sp, start)
    if res.num_accepted == n - 1:
        return RejectionResult(n, -1)
    return res


def _rows(dp: SparseDraftProbs, n: int) -> SparseDraftProbs:
    return SparseDraftProbs(dp.token_ids[:n], dp.probs[:n])


VERIFIERS = {"verify_block": verify_block, "accept_all": verify_accept_all,
             "resample_from_p": verify_resample_from_p, "last_unchecked": verify_last_unchecked}


@functools.lru_cache(maxsize=None)
def runs(verify_name: str, mode: str, n: int) -> np.ndarray:
    """[n, 3] committed tokens of seeds 0..n-1; γ = 1 for even seeds, 2 for odd ones (the bonus_drafted
    position is c1 or c2; a second block follows a first one accepted whole)."""
    verify = VERIFIERS[verify_name]
    return np.array([generate(seed, mode, 3, lambda step, g=1 + seed % 2: g, True, verify) for seed in range(n)])


def laws(mode: str) -> dict[str, np.ndarray]:
    p0 = target_probs(mode, -1)
    p = np.stack([target_probs(mode, s) for s in range(SV)])
    joint = p0[:, None] * p
    return {"first": p0, "pair": joint, "third": joint.sum(axis=0) @ p}


def checks(c: np.ndarray, mode: str) -> dict:
    law = laws(mode)
    return {"first": check(c[:, 0], law["first"]), "pair": check(c[:, 0] * SV + c[:, 1], law["pair"]),
            "third": check(c[:, 2], law["third"])}


@pytest.mark.parametrize("mode", list(PARAMS))
def test_bonus_drafted_is_lossless(mode):
    c = runs("verify_block", mode, N_LARGE)
    small, large = checks(c[:N_SMALL], mode), checks(c, mode)
    for name, res in large.items():
        assert res.passed, (mode, name, res)
        assert small[name].impossible == 0
    # TV shrinks with N (summed over the three laws: one law alone can fluctuate the other way)
    assert sum(r.tv for r in small.values()) > sum(r.tv for r in large.values()), (small, large)


@pytest.mark.parametrize("control", ["accept_all", "resample_from_p", "last_unchecked"])
def test_negative_controls_fail_the_same_check(control):
    mode = "top_p"
    large = checks(runs(control, mode, 8_000), mode)
    failed = [name for name, res in large.items() if not res.passed and res.tv > 2 * res.tv_bound]
    assert failed, (control, large)
    if control == "last_unchecked":  # c0 is never a bonus_drafted token here: the error is where it should be
        assert large["first"].passed and not large["pair"].passed, large
