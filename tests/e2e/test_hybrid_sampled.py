"""Seeded sampled speculative decoding on a hybrid target (tiny LFM2: a short-conv layer whose state the verifier
keeps per session) follows the target's own sampling distribution.

Setting: the real :class:`EdgeClient` with a tiny Llama ONNX draft sharing the target's embeddings
(tests/_architectures.py ``make_sibling_draft``; top-k drafting) against an in-process :class:`Verifier`; N seeded
sessions each sample 4 tokens after a fixed prompt with γ = 3, temperature 1 and top-k 6. Tokens 2..4 are verified
after blocks that were partly rejected, so their law depends on the recurrent state being restored exactly.

Reference: the plain HF model (no cache) gives p(· | prefix) for every prefix that occurs, through transformers'
own ``TopKLogitsWarper``. Check: randomized probability integral transforms v_j = F_j(t_j−) + w_j p_j(t_j) (token-id
order) are i.i.d. U(0, 1) exactly when every token follows the target's conditional law; chi-square of each v_j on
10 bins and of (v1, v2) on a 4×4 grid, critical values at significance 1e-4 (Wilson–Hilferty). Negative control:
the same samples against the draft's distribution (the sibling draft agrees with the target on about half the
argmaxes, not on the law) must be rejected.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, TopKLogitsWarper

from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.edge_client.client import EdgeClient
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
from specdec.embedded import LocalBackend

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPT = [1, 504, 3458, 314, 253, 1789, 30, 357]
N = 240  # sessions
NEW = 4  # tokens sampled per session
GAMMA = 3
TOP_K = 6
Z = 3.719  # one-sided normal quantile of 1e-4


def chi2_critical(df: int) -> float:
    """Wilson–Hilferty approximation of the chi-square quantile at significance 1e-4."""
    return df * (1 - 2 / (9 * df) + Z * math.sqrt(2 / (9 * df))) ** 3


@pytest.fixture(scope="module")
def pair(arch_models):
    """(tiny LFM2 target dir, its sibling Llama draft's HF dir, that draft in ONNX): tests/e2e/conftest.py."""
    target, onnx_dir = arch_models("lfm2")
    return target, arch_models.sibling("lfm2"), onnx_dir


@pytest.fixture(scope="module")
def samples(pair):
    target, _, onnx_dir = pair
    backend = LocalBackend(Verifier(TargetRunner(target), max_num_speculative_tokens=GAMMA, max_batch_wait_ms=0.0))
    rows, drafted, accepted = [], 0, 0
    try:
        model = OnnxDraftModel(onnx_dir)
        client = EdgeClient(backend, ModelDrafter(model, draft_top_k=TOP_K), model.tokenizer,
                            num_speculative_tokens=GAMMA, timeout_s=60.0)
        for seed in range(N):
            res = client.generate(PROMPT, max_new_tokens=NEW, temperature=1.0, top_k=TOP_K, seed=seed,
                                  ignore_eos=True, chat=False)
            rows.append(list(res.token_ids))
            drafted += res.stats.num_draft_tokens
            accepted += res.stats.num_accepted_tokens
    finally:
        backend.close()
    return np.array(rows), drafted, accepted


def _conditional(model_dir):
    """prefix -> probabilities [vocab] of the top-k-warped softmax of the HF model's logits (memoised)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    warp, memo = TopKLogitsWarper(TOP_K), {}

    def cond(prefix: list[int]) -> np.ndarray:
        key = tuple(prefix)
        if key not in memo:
            with torch.inference_mode():
                logits = model(input_ids=torch.tensor([prefix])).logits[:, -1].float()
                memo[key] = torch.softmax(warp(None, logits), dim=-1)[0].double().numpy()
        return memo[key]

    return cond


def _pit(tokens: np.ndarray, cond) -> np.ndarray:
    """Randomized PITs [N, NEW] of the sampled tokens under ``cond`` (NaN: a token of probability 0)."""
    w = np.random.default_rng(12345).random(tokens.shape)
    v = np.full(tokens.shape, np.nan)
    for r, row in enumerate(tokens):
        for j, t in enumerate(row):
            p = cond(PROMPT + row[:j].tolist())
            if p[t] > 0:
                v[r, j] = p[:t].sum() + w[r, j] * p[t]
    return v


def _chi2(v: np.ndarray, bins: int) -> tuple[float, int]:
    """Chi-square of points v [N, d] against the uniform law on bins^d cells: (statistic, degrees of freedom)."""
    n, d = v.shape
    cells = np.ravel_multi_index(np.clip((v * bins).astype(int), 0, bins - 1).T, (bins,) * d)
    counts = np.bincount(cells, minlength=bins**d)
    e = n / bins**d
    return float(((counts - e) ** 2 / e).sum()), bins**d - 1


def test_sampled_tokens_follow_the_hybrid_targets_law(pair, samples):
    tokens, drafted, accepted = samples
    assert drafted - accepted > N and accepted > N // 4, (drafted, accepted)  # rejections and acceptances both
    v = _pit(tokens, _conditional(pair[0]))
    assert not np.isnan(v).any(), "a sampled token is outside the target's top-k"
    for j in range(NEW):
        stat, df = _chi2(v[:, j : j + 1], 10)
        assert stat < chi2_critical(df), f"token {j + 1}: chi2 {stat:.1f} >= {chi2_critical(df):.1f}"
    stat, df = _chi2(v[:, :2], 4)
    assert stat < chi2_critical(df), f"(t1, t2): chi2 {stat:.1f}"


def test_negative_control_against_the_drafts_law_rejected(pair, samples):
    tokens, _, _ = samples
    v = _pit(tokens, _conditional(pair[1]))
    failed = int(np.isnan(v).sum())  # tokens the draft's top-k does not even contain
    stats = [_chi2(np.nan_to_num(v[:, j : j + 1], nan=0.0), 10) for j in range(NEW)]
    assert failed > 0 or any(s >= chi2_critical(df) for s, df in stats), stats
