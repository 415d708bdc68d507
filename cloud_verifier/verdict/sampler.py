"""The verdicts of a whole forward pass as tensor ops where the logits are (CPU or CUDA):
:class:`BatchedRejectionSampler`.

Follows Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative Decoding",
Algorithm 1, batched as vLLM's ``v1/sample/rejection_sampler.py`` does (all rows' positions flattened into one
[num_tokens, vocab_size] tensor; only token ids and counts come back to the host). The per-row numpy
:func:`common.rejection.verify_block` (guarded by :func:`cloud_verifier.verdict.numerics.verify_row`) is the reference
it is tested against.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specdec_runtime.cloud_verifier.verdict.scan import NUM_CANDIDATES, Scan, scan_logits
from specdec_runtime.cloud_verifier.verdict.warpers import dense_probs, exact_normaliser, sparse_probs
from specdec_runtime.common.draws import gumbel_argmax, uniform_many
from specdec_runtime.common.rejection import RejectionResult
from specdec_runtime.common.sampling import Stream, normalize_sparse
from specdec_runtime.common.types import NO_TOKEN, DraftBlock, SamplingParams


@dataclass
class VerifyRow:
    """One verify row of a forward pass: a validated block and the target's logits over its positions."""

    block: DraftBlock
    logits: Any  # [block.num_scored_positions, vocab_size] float (numpy or torch, any device)
    sampling: SamplingParams  # its seed keys the row's draws (a session's sampling always has one)
    start_position: int  # committed length: absolute position of the block's first draft token, tokens


_FAULTS = {3: "NaN logits", 2: "+inf logits", 1: "a position with no finite logit"}
_NO_MASS = NO_TOKEN  # the index of a row with no positive weight (a dense row's index is its token id)
_NO_DISTRIBUTION = ("no distribution to sample from after logits processing (cannot sample from a distribution "
                    "with no mass)")


class BatchedRejectionSampler:
    """Algorithm 1 for every verify row of one forward pass at once.

    Glossary (the names of the tensors below):

    - num_tokens: all scored positions of all rows, flattened row after row (``token``: one such position).
    - draft token x: the draft's guess at a position (NO_TOKEN at a classic block's bonus position).
    - draft_probs q: the sparse distribution the draft sampled x from ([num_tokens, k] ids and probabilities,
      ``common.types.SparseDraftProbs``; one-hot for greedy drafting), dense q = ``common.sampling.dense_draft_probs``.
    - target_probs p: the target's processed distribution (temperature → top-k → top-p → min-p → softmax,
      :mod:`cloud_verifier.verdict.warpers`), sparse over candidates or dense.
    - accepted token: x with ``u_accept · q(x) < p(x)`` (u_accept = ``uniform(seed, position, ACCEPT)``);
      greedy rows: x equal to the target argmax.
    - num_accepted n: accepted positions before the first rejection (bonus_drafted blocks: up to all γ).
    - recovered token: at the first rejection, the inverse-CDF sample of norm(max(0, p − q)) (p where that has
      no mass) with u_sample = ``uniform(seed, position, TARGET_SAMPLE)``; bonus token: the same from p after a
      fully accepted classic block (q = 0 there); greedy rows: the argmax.
    - drafter-invariant rows (``SamplingParams.drafter_invariant``, :mod:`common.rejection`): x is accepted iff
      it is p's own Gumbel-max draw at its position (:func:`common.draws.gumbel_argmax`, over the candidates
      when they hold p, else the dense row), which is the recovered / bonus token too; q is not read.

    The draws are computed on the host exactly as today (:func:`common.draws.uniform_many`,
    bit-identical to :func:`common.sampling.uniform`), a few numbers per row, and passed in. Per row the
    result is a RejectionResult, or the reason (str) why its logits cannot be verified: NaN, +inf, a
    position with no finite logit, or no distribution to sample from (the guard rules of
    :mod:`cloud_verifier.verdict.numerics`); a faulty row never affects the others.
    """

    def __init__(self, num_candidates: int = NUM_CANDIDATES, scan_backend: str = "auto",
                 scan_threads: int | None = None):
        self.num_candidates = num_candidates  # 1: every sampled position takes the dense path
        self.scan_backend = scan_backend  # scan.scan_logits: "auto", "numpy" (CPU only) or "torch"
        self.scan_threads = scan_threads  # numpy scan's threads; None: torch's intra-op thread count
        self.last_paths: dict = {}  # where the last call's sampled positions were decided (_SampledPart.paths)

    def __call__(self, rows: list[VerifyRow], valid_vocab_size: int) -> list[RejectionResult | str]:
        """Per row its RejectionResult (``next_token_id`` -1 only after a fully accepted bonus_drafted block)
        or the reason its logits cannot be verified.

        Raises:
            ValueError: a row's logits have not ``block.num_scored_positions`` rows, or rows on several devices.
        """
        if not rows:
            return []
        logits = _as_tensors(rows)  # per row [positions, vocab_size] float32, on the logits' device
        threads = self.scan_threads or torch.get_num_threads()
        with _one_intra_op_thread(logits[0].device):
            return self._verdicts(rows, logits, valid_vocab_size, threads)

    def _verdicts(self, rows: list[VerifyRow], logits: list[torch.Tensor], valid_vocab_size: int,
                  threads: int) -> list:
        lay = _Layout(rows)
        sampled = np.repeat([not r.sampling.greedy for r in rows], np.diff(lay.offsets))  # [num_tokens] bool
        temperature = np.repeat([r.sampling.temperature for r in rows], np.diff(lay.offsets))
        scan = scan_logits(logits, valid_vocab_size, sampled, temperature, self.num_candidates, self.scan_backend,
                           threads)
        faults = _row_faults(scan.max_logit.cpu().numpy(), lay)  # the guard, vectorised: one pass, one copy
        ok = [i for i in range(len(rows)) if faults[i] is None]
        accept = np.zeros(lay.num_tokens, dtype=bool)  # [num_tokens]
        greedy_tokens = [t for i in ok if rows[i].sampling.greedy for t in lay.tokens(i)]
        argmax = scan.argmax.cpu().numpy() if greedy_tokens else None  # [num_tokens]
        if greedy_tokens:
            draft = lay.draft[greedy_tokens]
            accept[greedy_tokens] = (draft >= 0) & (draft == argmax[greedy_tokens])
        part = None
        if sampled.any():
            faulty = np.repeat([f is not None for f in faults], np.diff(lay.offsets))
            part = _SampledPart(logits, scan, np.flatnonzero(sampled).tolist(), faulty, lay, valid_vocab_size,
                                accept)
            self.last_paths = part.paths
        results: list[RejectionResult | str] = list(faults)
        chosen_s = []  # (row, token) whose recovered / bonus token is sampled
        for i in ok:
            n, chosen = lay.first_rejection(i, accept)
            results[i] = RejectionResult(n, NO_TOKEN)
            if chosen is not None and rows[i].sampling.greedy:
                results[i] = RejectionResult(n, int(argmax[chosen]))
            elif chosen is not None:
                chosen_s.append((i, chosen))
        if chosen_s:
            for (i, _), tok in zip(chosen_s, part.sample([t for _, t in chosen_s])):
                results[i] = _NO_DISTRIBUTION if tok == NO_TOKEN else RejectionResult(results[i].num_accepted, tok)
        return results


@contextlib.contextmanager
def _one_intra_op_thread(device: torch.device):
    """On a CPU, torch's intra-op parallelism off while the verdict runs (restored after): its tensors are
    [num_tokens, num_candidates] and smaller, and a parallel region costs more than such an op (an index of a
    [320, 64] tensor: 8 µs on one thread, ms on two when the other core is busy); the passes over the full
    logits are numpy's (:mod:`cloud_verifier.verdict.scan`), single-threaded anyway."""
    before = torch.get_num_threads()
    if device.type != "cpu" or before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _as_tensors(rows: list[VerifyRow]) -> list[torch.Tensor]:
    """Each row's logits as a float32 tensor (numpy: zero-copy), all on one device."""
    tensors = [torch.as_tensor(r.logits) for r in rows]
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"verify rows' logits on several devices: {sorted(map(str, devices))}")
    for r, t in zip(rows, tensors):
        if t.ndim != 2 or t.shape[0] != r.block.num_scored_positions:
            raise ValueError(f"target logits of shape {tuple(t.shape)} for a block scoring "
                             f"{r.block.num_scored_positions} positions")
    return [t if t.dtype == torch.float32 else t.float() for t in tensors]


class _Layout:
    """Host-side bookkeeping: which flattened token belongs to which row and position, its draft token and q."""

    def __init__(self, rows: list[VerifyRow]):
        self.rows = rows
        self.offsets = [0]
        draft: list[int] = []
        for r in rows:
            n = r.block.num_scored_positions
            ids = list(r.block.draft_token_ids)
            draft.extend(ids[:n] + [NO_TOKEN] * (n - len(ids[:n])))  # a classic block's bonus position
            self.offsets.append(self.offsets[-1] + n)
        self.num_tokens = self.offsets[-1]
        self.draft = np.asarray(draft, dtype=np.int64)  # [num_tokens]

    def tokens(self, i: int) -> range:
        return range(self.offsets[i], self.offsets[i + 1])

    def first_rejection(self, i: int, accept: np.ndarray) -> tuple[int, int | None]:
        """(n, the token whose next token is drawn, or None after a fully accepted bonus_drafted block)."""
        lo, hi = self.offsets[i], self.offsets[i + 1]
        rejected = np.flatnonzero(~accept[lo:hi])
        if rejected.size == 0:
            return hi - lo, None
        return int(rejected[0]), lo + int(rejected[0])

    def positions(self, tokens: list[int]) -> np.ndarray:  # [len(tokens)] absolute positions
        row = np.searchsorted(self.offsets, tokens, side="right") - 1
        starts = np.asarray([self.rows[i].start_position for i in row], dtype=np.int64)
        return starts + np.asarray(tokens) - np.asarray(self.offsets)[row]

    def row_of(self, tokens: list[int]) -> np.ndarray:
        return np.searchsorted(self.offsets, tokens, side="right") - 1

    def draft_probs(self, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Sparse q of the given tokens (whole rows, in order): ([len, k] ids, NO_TOKEN padded; [len, k] float64, 0
        padded); a bonus position has none, greedy drafting is one-hot at the draft token."""
        rows = sorted(set(self.row_of(tokens).tolist()))
        k = max([1] + [np.shape(self.rows[i].block.draft_probs.token_ids)[-1] for i in rows
                       if self.rows[i].block.draft_probs is not None])
        ids = np.full((self.num_tokens, k), NO_TOKEN, dtype=np.int64)
        probs = np.zeros((self.num_tokens, k), dtype=np.float64)
        sparse: dict[int, list] = {}  # width -> [(destination rows, ids, wire probs)]: one renormalisation each
        for i in rows:
            block, lo = self.rows[i].block, self.offsets[i]
            num_drafted = len(block.draft_token_ids)
            if num_drafted == 0:
                continue
            if block.draft_probs is None:  # greedy drafting: q is one-hot at the draft token
                ids[lo:lo + num_drafted, 0] = block.draft_token_ids
                probs[lo:lo + num_drafted, 0] = 1.0
            else:
                q_ids = np.asarray(block.draft_probs.token_ids)[:num_drafted]
                sparse.setdefault(q_ids.shape[-1], []).append(
                    (np.arange(lo, lo + num_drafted), q_ids, np.asarray(block.draft_probs.probs)[:num_drafted]))
        for width, parts in sparse.items():  # row-wise, so the same values as one call per row
            at = np.concatenate([d for d, _, _ in parts])
            ids[at, :width] = np.concatenate([q for _, q, _ in parts])
            probs[at, :width] = normalize_sparse(np.concatenate([p for _, _, p in parts]))
        return ids[tokens], probs[tokens]


def _row_faults(max_logit: np.ndarray, lay: _Layout) -> list[str | None]:
    """Per row the guard's reason (numerics.logits_fault's order: NaN, then +inf, then an all -inf position)."""
    code = np.where(np.isnan(max_logit), 3, np.where(max_logit == np.inf, 2,
                                                     np.where(max_logit == -np.inf, 1, 0)))
    return [_FAULTS.get(int(code[lay.offsets[i]:lay.offsets[i + 1]].max(initial=0))) for i in range(len(lay.rows))]


class _SampledPart:
    """Sampled rows: target_probs, the acceptance test, and later the recovered / bonus draws.

    ``tokens``: every sampled position, in the order of the Scan's candidates (faulty rows' ones included, never
    used)."""

    def __init__(self, logits: list[torch.Tensor], scan: Scan, tokens: list[int], faulty: np.ndarray,
                 lay: _Layout, vocab: int, accept: np.ndarray):
        dev = scan.cand_ids.device
        self.index = {t: j for j, t in enumerate(tokens)}
        row_of = lay.row_of(tokens)
        params = [lay.rows[i].sampling for i in row_of]
        f64 = dict(dtype=torch.float64, device=dev)
        temperature = torch.tensor([p.temperature for p in params], **f64)  # [n]
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev)  # [n]
        top_p = torch.tensor([p.top_p for p in params], **f64)  # [n]
        min_p = torch.tensor([getattr(p, "min_p", 0.0) for p in params], **f64)  # [n]
        seeds = [lay.rows[i].sampling.seed for i in row_of]
        positions = lay.positions(tokens)
        u_accept = torch.from_numpy(uniform_many(seeds, positions, [Stream.ACCEPT] * len(tokens))).to(dev)
        self.seeds, self.positions = seeds, positions  # u_sample: drawn in sample(), for the chosen tokens only
        q_ids, q_probs = lay.draft_probs(tokens)
        self.q_ids, self.q_probs = torch.from_numpy(q_ids).to(dev), torch.from_numpy(q_probs).to(dev)  # [n, k]
        x = torch.from_numpy(lay.draft[tokens]).to(dev)  # [n] draft token (NO_TOKEN: bonus position)
        # a position whose scaled logits overflow (e.g. temperature 1e-310) has no distribution: never accepted
        max_logit = scan.max_logit.index_select(0, torch.as_tensor(tokens, device=dev))
        bad = ~torch.isfinite(max_logit.double() / temperature) | torch.from_numpy(faulty[tokens]).to(dev)
        warpers = (vocab, temperature, top_k, top_p, min_p)
        self.ids, self.probs, decided, z_open = sparse_probs(scan, *warpers)  # [n, c]
        z_open_at = torch.nonzero(z_open & ~bad)[:, 0]
        if len(z_open_at):  # the normaliser's bounds left a top-p decision open: sum it exactly there, again
            full = torch.stack([logits[row_of[j]][tokens[j] - lay.offsets[row_of[j]], :vocab]
                                for j in z_open_at.tolist()])  # [z, vocab_size]
            z = exact_normaliser(full, max_logit[z_open_at], temperature[z_open_at])
            scan.z_low[z_open_at], scan.z_high[z_open_at] = z * (1 - 1e-12), z * (1 + 1e-12)
            self.ids, self.probs, decided, _ = sparse_probs(scan, *warpers)
        p_x = (self.probs * (self.ids == x[:, None])).sum(-1)  # [n] p(x) (0 outside the candidates)
        dense_at = torch.nonzero(~decided & ~bad)[:, 0]
        self.dense_row = {j: r for r, j in enumerate(dense_at.tolist())}  # local position -> row of dense
        self.dense = None
        if self.dense_row:
            full = torch.stack([logits[row_of[j]][tokens[j] - lay.offsets[row_of[j]], :vocab]
                                for j in self.dense_row])  # [d, vocab_size]
            self.dense = dense_probs(full, temperature[dense_at], top_k[dense_at], top_p[dense_at],
                                     min_p[dense_at])  # [d, vocab_size]
            x_d = x[dense_at]
            p_dense = self.dense.gather(1, x_d.clamp(min=0, max=vocab - 1)[:, None])[:, 0]
            p_x[dense_at] = torch.where(x_d < vocab, p_dense, 0.0)  # ids past the valid vocabulary: p = 0
        q_x = (self.q_probs * (self.q_ids == x[:, None])).sum(-1)  # [n] q(x)
        accepted = ((u_accept * q_x < p_x) & (x >= 0) & ~bad).cpu().numpy()  # accept iff u < p/q <=> u·q < p
        self.bad = bad.cpu().numpy()
        self.dev = dev
        # drafter-invariant rows: x accepted iff it is p's own draw, which is also their recovered / bonus token
        invariant = np.flatnonzero([bool(params[j].drafter_invariant) for j in range(len(tokens))])
        self.own = self._own_draws(invariant.tolist())  # local position -> token (NO_TOKEN: bad)
        if invariant.size:
            own = np.asarray([self.own[int(j)] for j in invariant])
            accepted[invariant] = (own == lay.draft[np.asarray(tokens)[invariant]]) & ~self.bad[invariant]
        accept[tokens] = accepted
        # where the sampled positions were decided (the benchmark reports it): fast path, the exact normaliser
        # (the scan's bounds left a top-p decision open), the dense path
        self.paths = {"positions": len(tokens), "exact_normaliser": len(z_open_at), "dense": len(dense_at)}

    def _own_draws(self, local: list[int]) -> dict[int, int]:
        """p's Gumbel-max draw at each local position (common.rejection.own_draw; NO_TOKEN at a bad one): over
        the candidates when they hold p, else over the dense row. One host copy of each kind of row per step."""
        own = {j: NO_TOKEN for j in local if self.bad[j]}
        dense = [j for j in local if not self.bad[j] and j in self.dense_row]
        sparse = [j for j in local if not self.bad[j] and j not in self.dense_row]
        if dense:
            rows = self.dense[torch.as_tensor([self.dense_row[j] for j in dense], device=self.dev)].cpu().numpy()
            vocab_ids = np.arange(rows.shape[1])
            own.update({j: gumbel_argmax(vocab_ids, p, self.seeds[j], int(self.positions[j]), Stream.GUMBEL)
                        for j, p in zip(dense, rows)})
        if sparse:
            at = torch.as_tensor(sparse, device=self.dev)
            ids, probs = self.ids[at].cpu().numpy(), self.probs[at].cpu().numpy()
            own.update({j: gumbel_argmax(i, p, self.seeds[j], int(self.positions[j]), Stream.GUMBEL)
                        for j, i, p in zip(sparse, ids, probs)})
        return {j: NO_TOKEN if t < 0 else int(t) for j, t in own.items()}

    def sample(self, tokens: list[int]) -> list[int]:
        """Recovered / bonus token at each given token's position (NO_TOKEN: no distribution to sample from)."""
        local = [self.index[t] for t in tokens]
        out = np.full(len(local), NO_TOKEN, dtype=np.int64)
        for j, t in enumerate(local):
            if t in self.own:
                out[j] = self.own[t]
        dev = self.dev
        rest = [t not in self.own for t in local]
        sparse = [j for j, t in enumerate(local) if rest[j] and t not in self.dense_row and not self.bad[t]]
        dense = [j for j, t in enumerate(local) if rest[j] and t in self.dense_row]
        u = uniform_many([self.seeds[j] for j in local], self.positions[local],
                         [Stream.TARGET_SAMPLE] * len(local))  # [len(tokens)] host
        if sparse:
            at = torch.as_tensor([local[j] for j in sparse], device=dev)
            out[sparse] = _residual_sample_sparse(self.ids[at], self.probs[at], self.q_ids[at], self.q_probs[at],
                                                  torch.from_numpy(u[sparse]).to(dev))
        if dense:
            at = torch.as_tensor([self.dense_row[local[j]] for j in dense], device=dev)
            q_at = torch.as_tensor([local[j] for j in dense], device=dev)
            out[dense] = _residual_sample_dense(self.dense[at], self.q_ids[q_at], self.q_probs[q_at],
                                                torch.from_numpy(u[dense]).to(dev))
        return out.tolist()


def _residual_sample_sparse(ids, probs, q_ids, q_probs, u) -> np.ndarray:
    """Inverse-CDF samples of norm(max(0, p − q)) (p where it has no mass) with p over candidates.

    ids/probs [r, c] (p is 0 outside them, so the cumulative sum over the vocabulary in id order is the one over
    the candidates sorted by id, exactly), q_ids/q_probs [r, k], u [r]. Returns [r] token ids (NO_TOKEN: no mass)."""
    order = torch.argsort(ids, dim=-1)
    ids, probs = ids.gather(1, order), probs.gather(1, order)  # ascending id, as sample_from walks the vocabulary
    q_on = (q_probs[:, None, :] * (ids[:, :, None] == q_ids[:, None, :])).sum(-1)  # [r, c] q at the candidates
    residual = (probs - q_on).clamp(min=0.0)
    residual = torch.where((residual.sum(-1) > 0)[:, None], residual, probs)
    index = _inverse_cdf(residual, u)
    return torch.where(index != _NO_MASS, ids.gather(1, index.clamp(min=0)[:, None])[:, 0], NO_TOKEN).cpu().numpy()


def _residual_sample_dense(probs, q_ids, q_probs, u) -> np.ndarray:
    """As :func:`_residual_sample_sparse` with p dense: probs [r, vocab_size], q [r, k], u [r] → [r] ids."""
    residual = probs.clone()
    rows = torch.arange(probs.shape[0], device=probs.device)[:, None].expand_as(q_ids)
    real = (q_ids >= 0) & (q_ids < probs.shape[1])  # q past the valid vocabulary meets p = 0: residual 0 there
    r, j = rows[real], q_ids[real]
    residual[r, j] = (probs[r, j] - q_probs[real]).clamp(min=0.0)  # max(p − q, 0) where q > 0, p elsewhere
    residual = torch.where((residual.sum(-1) > 0)[:, None], residual, probs)
    return _inverse_cdf(residual, u).cpu().numpy()


def _inverse_cdf(
    weights: torch.Tensor,  # [r, w] float64, non-negative, unnormalised, in token-id order
    u: torch.Tensor,  # [r] float64 in [0, 1)
) -> torch.Tensor:  # [r] int64 index into w (_NO_MASS: no positive mass)
    """common.sampling.sample_from for many rows: the first index whose float64 running sum exceeds u · total
    (searchsorted, side right), clamped to the last index, moved back to the closest positive weight."""
    cum = torch.cumsum(weights, dim=-1)  # sequential on CPU, as np.cumsum
    total = cum[:, -1]
    index = torch.searchsorted(cum, (u * total)[:, None].contiguous(), right=True)[:, 0]
    index = index.clamp(max=weights.shape[1] - 1)
    positions = torch.arange(weights.shape[1], device=weights.device).expand_as(weights)
    last_positive = torch.cummax(torch.where(weights > 0, positions, -1), dim=-1).values  # [r, w]
    index = last_positive.gather(1, index[:, None])[:, 0]
    return torch.where(total > 0, index, _NO_MASS)
