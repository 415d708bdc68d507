"""Per-session logits processors of a verify row, applied to the raw target logits before the verdict.

The processors that depend on a session's own history (logit_bias, repetition/presence/frequency penalties,
min_tokens, grammar masks) run here, at every position of the block with that position's own history (committed
ids + the block's draft ids before it), before the history-free warpers (temperature, top-k, top-p, min_p) and
the rejection rule run over the whole batch. A session that asks for none of them passes through unchanged.
"""

from __future__ import annotations

import torch

from cloud_verifier.session_state import Session
from common.types import DraftBlock


def prepare_row_logits(
    session: Session,
    block: DraftBlock,
    committed_length: int,  # tokens committed before the block (absolute position of its first draft token)
    logits: torch.Tensor,  # [block.num_scored_positions, vocab_size] float32, owned by the caller (in place ok)
) -> torch.Tensor:  # [block.num_scored_positions, vocab_size]
    """The row's logits after its session's history-dependent processors (none yet: returned as given)."""
    return logits
