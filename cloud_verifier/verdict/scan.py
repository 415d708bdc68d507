"""The one pass of the batched verdict over the full logits (:func:`scan_logits`): per position the guard's input
(the max logit), the greedy argmax, the ``num_candidates`` most likely tokens and bounds on the softmax
normaliser. Everything after it (:mod:`cloud_verifier.verdict.warpers`, :mod:`cloud_verifier.verdict.sampler`)
works on [num_tokens, num_candidates] tensors, except the few positions the candidates cannot decide.

Three backends with one contract (tests/cloud_verifier/test_batched_rejection.py runs them all here):

- ``torch`` (CUDA, and any device): ``argmax``, a two-level top-k (:func:`top_candidates`) and an exact float32
  normaliser, all rows in one chunk on a GPU.
- ``native`` (the default for CPU tensors where a C compiler is found; :mod:`cloud_verifier.verdict.scan_native`):
  the numpy backend's computation, compiled: one pass from memory and one in cache per position.
- ``numpy`` (CPU tensors without a compiler, zero-copy views of them; :mod:`cloud_verifier.verdict.scan_numpy`):
  the max, two comparison passes, and a gather of the few hundred tokens within a gap of the max; the
  normaliser is summed over those and bounded over the rest, so no pass of exp over the vocabulary is made,
  and the candidates (at most c) are taken from the gathered tokens. A top-p decision the bounds leave open
  is decided with the exact normaliser; one the candidates cannot decide goes to the dense path.

Every token left out of the candidates has a logit at most ``outside_logit``, itself at most the least
candidate's (torch: the block argument, at most c blocks hold a token above the c-th largest value; numpy: the
candidates are every gathered token above a cut, and the tokens not gathered are below the gap's threshold).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec_runtime.cloud_verifier.verdict.scan_native import available as native_available, scan_native
from specdec_runtime.cloud_verifier.verdict.scan_numpy import scan_numpy

NUM_CANDIDATES = 64  # tokens the fast path keeps per position: real nuclei at top-p 0.9, T 0.7 have 1-57


@dataclass
class Scan:
    """Per position, from the one pass over the full logits."""

    max_logit: torch.Tensor  # [num_tokens] float32 (NaN: some NaN logit; +inf; -inf: no finite logit)
    argmax: torch.Tensor  # [num_tokens] int64 (lowest id among ties; meaningful for greedy positions)
    cand_logits: torch.Tensor  # [num_sampled, c] float32, descending
    cand_ids: torch.Tensor  # [num_sampled, c] int64
    z_low: torch.Tensor  # [num_sampled] float64 <= sum(exp((logits - max) / T)) over the vocabulary
    z_high: torch.Tensor  # [num_sampled] float64 >= that sum (up to float rounding)
    outside_logit: torch.Tensor  # [num_sampled] float32 >= the logit of every token that is not a candidate


def scan_logits(
    rows: list[torch.Tensor],  # per verify row [positions, vocab_size] float32, one device
    valid_vocab_size: int,
    sampled: np.ndarray,  # [num_tokens] bool: positions of sampled (not greedy) rows
    temperature: np.ndarray,  # [num_tokens] float64 (used where sampled)
    num_candidates: int = NUM_CANDIDATES,
    backend: str = "auto",  # "auto": native (else numpy) for CPU tensors, torch otherwise
    threads: int = 1,  # native and numpy backends: the passes on this many threads
) -> Scan:
    """The Scan of all rows, one verify row at a time on a CPU (no copy of the logits, temporaries in cache;
    :mod:`cloud_verifier.verdict.scan_numpy`), all rows in one chunk on a GPU."""
    dev = rows[0].device
    c = min(num_candidates, valid_vocab_size)
    if backend == "auto" and dev.type == "cpu":
        backend = "native" if native_available() else "numpy"
    if dev.type != "cpu" and len(rows) > 1:  # one chunk: a few kernels for the whole batch
        rows = [torch.cat(rows)]
    if backend in ("native", "numpy"):
        scan = scan_native if backend == "native" else scan_numpy
        fields = scan(rows, valid_vocab_size, sampled, temperature, c, threads)
        return Scan(*[torch.from_numpy(np.ascontiguousarray(f)).to(dev) for f in fields])
    parts: list[tuple] = []
    start = 0
    for x in rows:
        n = x.shape[0]
        chunk = (x[:, :valid_vocab_size], sampled[start:start + n], temperature[start:start + n], c)
        parts.append(_scan_torch(*chunk))
        start += n
    fields = [torch.cat([torch.as_tensor(p[j]) for p in parts]).to(dev) for j in range(7)]
    return Scan(*fields)


def _scan_torch(x: torch.Tensor, sampled: np.ndarray, temperature: np.ndarray, c: int) -> tuple:
    dev = x.device
    n = x.shape[0]
    max_logit = torch.empty(n, device=dev)  # [n] NaN and +inf propagate through argmax and topk (NaN first)
    argmax = torch.zeros(n, dtype=torch.int64, device=dev)
    if not sampled.all():
        greedy = torch.from_numpy(np.flatnonzero(~sampled)).to(dev)
        x_g = x.index_select(0, greedy) if sampled.any() else x
        argmax[greedy] = x_g.argmax(-1)
        max_logit[greedy] = x_g.gather(1, argmax[greedy][:, None])[:, 0]
    if not sampled.any():
        empty = torch.empty((0, c), device=dev)
        none = torch.empty(0, dtype=torch.float64, device=dev)
        return max_logit, argmax, empty, empty.long(), none, none, torch.empty(0, device=dev)
    at = torch.from_numpy(np.flatnonzero(sampled)).to(dev)
    if not sampled.all():
        x = x.index_select(0, at)
    cand_logits, cand_ids = top_candidates(x, c)  # [s, c] descending by logit (ties: any order)
    m = cand_logits[:, 0]  # [s] the max logit (NaN when there is one, torch sorts NaN above everything)
    max_logit[at] = m
    t32 = torch.from_numpy(temperature[sampled]).to(dev).float()[:, None]
    z = torch.exp((x - m[:, None]) / t32).sum(-1).double()  # [s] float32 exp and sum (relative error ~1e-6)
    return max_logit, argmax, cand_logits, cand_ids, z * (1 - 1e-5), z * (1 + 1e-5), cand_logits[:, -1]


def top_candidates(
    x: torch.Tensor,  # [n, vocab_size] float32
    c: int,  # 1 <= c <= vocab_size
) -> tuple[torch.Tensor, torch.Tensor]:  # ([n, c] values descending, [n, c] int64 ids)
    """The c largest logits of each row (as ``torch.topk``; which of several tied values is taken may differ)
    by a two-level selection: the maxima of chunks of b consecutive tokens (one vectorised pass), the c chunks
    with the largest maxima (every token above the c-th largest value lies in one of them: at most c chunks
    hold a token that large), then ``topk`` over those c·b tokens and the tail that fills no chunk. Every token
    left out is at most the smallest one taken. NaN and +inf propagate (chunk maxima and topk put NaN first).
    On a CPU this costs about 0.7× of ``torch.topk`` over the whole row (CPU time, 320 rows of 49,152 tokens:
    37 vs 50 ms here)."""
    n, vocab = x.shape
    b = max(8, min(64, vocab // (4 * c)))  # tokens per chunk: 64 at 49,152 tokens and c = 64
    num_chunks = vocab // b
    if num_chunks <= c:
        return torch.topk(x, c, dim=-1)
    chunk_max = x[:, : num_chunks * b].unflatten(1, (num_chunks, b)).amax(-1)  # [n, num_chunks]
    chunks = torch.topk(chunk_max, c, dim=-1).indices  # [n, c]
    cols = (chunks[:, :, None] * b + torch.arange(b, device=x.device)).reshape(n, c * b)  # [n, c·b]
    if num_chunks * b < vocab:  # the tail
        tail = torch.arange(num_chunks * b, vocab, device=x.device).expand(n, -1)
        cols = torch.cat([cols, tail], dim=1)
    values, at = torch.topk(x.gather(1, cols), c, dim=-1)
    return values, cols.gather(1, at)
