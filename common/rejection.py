"""The rejection rule of speculative decoding (lossless verification of one draft block).

Follows Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative Decoding",
Algorithm 1 (also Chen et al. 2023, Algorithm 2). Names map to the paper as follows:

- ``draft_token_ids[i]``  x_i, the i-th guess of M_q (i = 0..γ-1; the paper counts from 1)
- ``draft_probs``         q_i(x), the distribution the draft sampled x_i from (sparse: greedy/top-k drafting)
- ``target_probs[i]``     p_i(x), the target's processed distribution at the same position; row γ is
                          p_{γ+1}, used for the bonus token
- ``num_accepted``        n in Algorithm 1
- recovered token         sample of norm(max(0, p_{n+1} − q_{n+1})) after the first rejection
- bonus token             sample of p_{γ+1} when all γ guesses are accepted

Departures from the paper:

- uniform draws come from a counter-based stream (common.sampling.uniform) keyed by the session seed and the
  absolute token position, instead of a global RNG, so a session's output does not depend on batching or on
  which replica verifies it.
- **bonus_drafted blocks** (``DraftBlock.bonus_drafted``): the last of the n draft tokens was
  drafted for the position Algorithm 1 fills with its bonus token. The target scores n positions
  ([last committed token, x_1..x_{n-1}] gives p_1..p_n: the forward pass of a classic block of n − 1 drafts),
  and the rejection rule runs over ALL n draft tokens; there is no bonus token: a full block commits the n
  draft tokens (``next_token_id = -1``), a rejection at i the recovered token as usual. Then the token at
  every absolute position t is the same function of (p_t, q_t, the draws at t) —
  ``uniform(seed, t, ACCEPT)``, ``uniform(seed, t, TARGET_SAMPLE)``, the draft's ``uniform(seed, t,
  DRAFT_SAMPLE)`` — wherever blocks begin and end, whereas in Algorithm 1 a position is filled by the
  rejection rule inside a block but sampled straight from p_{γ+1} at the end of a full one. Each position is
  still exactly Algorithm 1's law: given the prefix, the token is accepted x ~ q with probability
  min(1, p/q) or drawn from norm(max(0, p − q)), whose mixture is p (Leviathan et al. 2023, Appendix A.1);
  the position that was the bonus position still yields exactly one token per forward pass.

- **drafter-invariant sessions** (``SamplingParams.drafter_invariant``; Daliri, Musco & Suresh 2024, "Coupling
  without Communication and Drafter-Invariant Speculative Decoding"): the token at every position t is p_t's own
  Gumbel-max draw y_t = argmax_x log p_t(x) + G_t(x), the noise G_t(x) a counter draw of (seed, t, x)
  (:func:`own_draw`; what a cloud decode of the session commits there, as an empty block's bonus token); a draft
  token is accepted iff it equals y_t, the first that does not is replaced by y_t (the recovered token), and the
  bonus token is y_t. Lossless trivially (every token is a draw from p), and the output is a function of (p, the
  seed) alone: the same for any draft, γ, block boundary, verify length or switch point between cloud decode and
  speculation. The draft draws its tokens from its own q with the same noise (:func:`common.sampling.draft_token`),
  so x_t = y_t with probability at least (1 − TV)/(1 + TV) (the paper's bound; Algorithm 1 accepts 1 − TV).

:func:`verify_block` is the rule for one verify row (one session's block) in numpy; :func:`verify_greedy` and
:func:`verify_sampled` are its two cases. It is the reference, not what the verifier runs: a batch step's
verdicts come from :class:`cloud_verifier.verdict.sampler.BatchedRejectionSampler` (every row of a forward pass
at once, as tensor ops where the logits are), tested against :func:`verify_block` row for row
(:func:`cloud_verifier.verdict.numerics.verify_row` is its guarded per-row form).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdec_runtime.common.draws import gumbel_argmax
from specdec_runtime.common.sampling import Stream, dense_draft_probs, logits_to_probs, sample_from, uniform
from specdec_runtime.common.types import NO_TOKEN, DraftBlock, SamplingParams, SparseDraftProbs


@dataclass(frozen=True)
class RejectionResult:
    num_accepted: int  # n: accepted prefix length, 0..γ
    # recovered token (n < γ) or bonus token (n == γ); NO_TOKEN when a bonus_drafted block is accepted whole
    next_token_id: int

    @property
    def committed(self) -> int:
        """Tokens this verdict commits before stopping: the accepted prefix and the next token (if any)."""
        return self.num_accepted + (1 if self.next_token_id >= 0 else 0)


def verify_greedy(
    draft_token_ids: list[int],  # [γ]
    target_logits: np.ndarray,  # [γ + 1, vocab_size] ([γ, vocab_size] when bonus_drafted)
    valid_vocab_size: int | None = None,
    bonus_drafted: bool = False,
) -> RejectionResult:
    """Greedy (temperature 0) verification: accept while the draft token is the target argmax.

    The next token is the target argmax at the first mismatch (recovered) or after the block (bonus), so the
    output is token-identical to target-only greedy decoding. Columns at or past ``valid_vocab_size`` (padded
    embedding rows) are never chosen. ``bonus_drafted``: the last draft token stands for the bonus position
    (see the module docstring): a full block has no bonus token (``next_token_id = -1``).
    """
    target_logits = np.asarray(target_logits)
    if valid_vocab_size is not None and valid_vocab_size < target_logits.shape[-1]:
        target_logits = target_logits[..., :valid_vocab_size]
    target_argmax = target_logits.argmax(axis=-1)
    gamma = len(draft_token_ids)
    for i in range(gamma):
        if int(draft_token_ids[i]) != int(target_argmax[i]):
            return RejectionResult(i, int(target_argmax[i]))
    if bonus_drafted:
        return RejectionResult(gamma, NO_TOKEN)
    return RejectionResult(gamma, int(target_argmax[gamma]))


def verify_sampled(
    draft_token_ids: list[int],  # [γ]
    draft_probs: SparseDraftProbs | None,  # None: greedy drafting (q one-hot); else sparse [γ, k]
    target_probs: np.ndarray,  # [γ + 1, vocab_size] float64, processed (common.sampling.logits_to_probs)
    seed: int,
    start_position: int,  # absolute position of draft_token_ids[0] (= committed length)
    bonus_drafted: bool = False,  # the last draft token stands for the bonus position: target_probs [γ, vocab]
    drafter_invariant: bool = False,  # the drafter-invariant rule (module docstring): q is not read
) -> RejectionResult:
    """Speculative sampling (Leviathan et al. 2023, Algorithm 1): lossless w.r.t. target_probs.

    Accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection sample the recovered token
    from norm(max(0, p_i − q_i)); after a full block sample the bonus token from p_γ. With ``bonus_drafted``
    (the bonus_drafted departure of the module docstring) every one of the γ draft tokens goes through the
    acceptance test, ``target_probs`` has γ rows, and a full block returns ``next_token_id = -1`` (no bonus
    token): the token at absolute position t is then a function of (p_t, q_t, the draws at t) alone. With
    ``drafter_invariant`` a draft token is accepted iff it equals p_i's own draw, which is the recovered token
    otherwise (module docstring).
    """
    gamma = len(draft_token_ids)
    vocab = target_probs.shape[-1]
    if drafter_invariant:
        return _verify_drafter_invariant(draft_token_ids, target_probs, seed, start_position, bonus_drafted)
    for i in range(gamma):
        x = int(draft_token_ids[i])
        position = start_position + i
        q = dense_draft_probs(draft_token_ids, draft_probs, i, vocab)
        p_x, q_x = float(target_probs[i, x]), float(q[x])
        # accept iff u < p/q  <=>  u * q < p   (q_x > 0 is checked by block validation)
        if uniform(seed, position, Stream.ACCEPT) * q_x < p_x:
            continue
        residual = np.maximum(target_probs[i] - q, 0.0)
        if not residual.sum() > 0:  # p == q up to rounding: rejection had ~0 probability; p is exact then
            residual = target_probs[i]
        return RejectionResult(i, sample_from(residual, uniform(seed, position, Stream.TARGET_SAMPLE)))
    if bonus_drafted:
        return RejectionResult(gamma, NO_TOKEN)
    bonus = sample_from(target_probs[gamma], uniform(seed, start_position + gamma, Stream.TARGET_SAMPLE))
    return RejectionResult(gamma, bonus)


def own_draw(target_probs: np.ndarray, seed: int, position: int) -> int:
    """A drafter-invariant session's token at ``position``: the Gumbel-max draw of target_probs [vocab_size]
    (:func:`common.draws.gumbel_argmax`, ``Stream.GUMBEL``; module docstring).

    Raises:
        ValueError: ``target_probs`` has no positive mass."""
    token = gumbel_argmax(np.arange(len(target_probs)), target_probs, seed, position, Stream.GUMBEL)
    if token < 0:
        raise ValueError("cannot sample from a distribution with no mass")
    return token


def _verify_drafter_invariant(draft_token_ids, target_probs, seed, start_position, bonus_drafted) -> RejectionResult:
    """The drafter-invariant rule (module docstring): accepted while a draft token is p's own draw there."""
    gamma = len(draft_token_ids)
    for i in range(gamma):
        own = own_draw(target_probs[i], seed, start_position + i)
        if int(draft_token_ids[i]) != own:
            return RejectionResult(i, own)
    if bonus_drafted:
        return RejectionResult(gamma, NO_TOKEN)
    return RejectionResult(gamma, own_draw(target_probs[gamma], seed, start_position + gamma))


def verify_block(
    block: DraftBlock,  # γ draft token ids (+ sparse draft_probs [γ, k], or None for greedy drafting)
    target_logits: np.ndarray,  # [γ + 1, vocab_size] raw logits ([γ, vocab_size] when block.bonus_drafted)
    sampling: SamplingParams,  # its seed keys the draws (set for a sampled session)
    start_position: int,  # absolute position of the first draft token (= committed length), tokens
    valid_vocab_size: int | None = None,  # logits columns at or past it (padding) are never chosen
) -> RejectionResult:
    """One row's verdict: the accepted prefix length n and the token after it (recovered or bonus; -1 after a
    full ``bonus_drafted`` block).

    Greedy sampling (temperature 0) uses :func:`verify_greedy` on the raw logits; otherwise the logits are
    processed exactly as the draft processed its own (:func:`common.sampling.logits_to_probs`: temperature →
    top-k → top-p) into target_probs [γ + 1, vocab_size] and :func:`verify_sampled` applies Algorithm 1.
    ``block.bonus_drafted`` selects the bonus_drafted rule (module docstring; logits have γ rows then).
    Block validation (cloud_verifier.session.validation) must have run: every draft token has q(x) > 0, and a
    bonus_drafted block is not empty.

    Raises:
        ValueError: ``target_logits`` has not ``block.num_scored_positions`` rows.
    """
    rows = block.num_scored_positions
    if np.shape(target_logits)[0] != rows:
        raise ValueError(f"target logits have {np.shape(target_logits)[0]} rows for a block scoring {rows} positions")
    if sampling.greedy:
        return verify_greedy(block.draft_token_ids, target_logits, valid_vocab_size, block.bonus_drafted)
    target_probs = logits_to_probs(target_logits, sampling, valid_vocab_size)  # [rows, vocab_size]
    if sampling.seed is None:
        raise ValueError("sampled verification needs sampling.seed (the verifier picks one at session open)")
    return verify_sampled(block.draft_token_ids, block.draft_probs, target_probs, sampling.seed, start_position,
                          block.bonus_drafted, bool(sampling.drafter_invariant))
