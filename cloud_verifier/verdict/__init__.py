"""The verdict stage of a batch step: the raw target logits of the verify rows in, per row a rejection result
and then the :class:`~common.types.Verdict` out. The batcher calls only these three names:

- :func:`rejections`: every verify row of one forward pass at once (per-session logits processors, the guards
  on non-finite logits, then ONE batched rejection sampler over all rows);
- :func:`make_verdict`: a row's Verdict once stopping chose what it commits;
- :func:`committed_logprobs`: the logprobs of the committed tokens, for sessions that asked.

Inside: ``stage`` (the entry), ``row_logits`` (per-session logits processors and logprobs), ``numerics`` (the
guards; the per-row reference ``verify_row`` on :func:`common.rejection.verify_block`), ``sampler`` (the batched
rejection sampler), ``warpers`` (batched top-k/top-p/min-p), and ``scan`` with its ``scan_numpy`` / ``scan_native``
backends (the one pass over the full logits; ``scan_native.c`` is compiled on first use). The counter-based draws
(uniforms, Gumbel-max) live in :mod:`common.draws`: the edge draws the same noise. Rejection rule: Leviathan,
Kalman & Matias 2023, Algorithm 1.
"""

from specdec_runtime.cloud_verifier.verdict.row_logits import committed_logprobs
from specdec_runtime.cloud_verifier.verdict.stage import make_verdict, rejections

__all__ = ["committed_logprobs", "make_verdict", "rejections"]
