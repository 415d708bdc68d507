"""Vocabulary identity between the draft (edge) and the target (cloud).

Speculative decoding exchanges token *ids*: a draft token id must name the same token string on both sides,
or the verifier checks a different token than the draft proposed. Size alone proves nothing (two tokenizers
of 49152 tokens can differ everywhere), so both checks here compare the (token string, id) tables,
added/special tokens included.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["VocabMismatchError", "tokenizer_fingerprint", "check_vocab_compatible", "vocab_table"]


class VocabMismatchError(ValueError):
    """Draft and target vocabularies differ (the message names the first differing id)."""


def vocab_table(tokenizer: Any) -> list[str | None]:
    """Token string of every id, added tokens included: ``table[id]`` (None for an id with no token).

    Works with any HF tokenizer (``get_vocab()`` includes added tokens in transformers >= 4).
    """
    vocab: dict[str, int] = dict(tokenizer.get_vocab())
    for idx, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        vocab.setdefault(str(added), int(idx))
    size = max(vocab.values(), default=-1) + 1
    table: list[str | None] = [None] * size
    for token, idx in vocab.items():
        table[int(idx)] = token
    return table


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """16-hex-digit sha256 of the tokenizer's sorted (token string, id) vocabulary, added tokens included.

    Equal fingerprints mean the same id ↔ token table (what the wire needs); normalisation / pre-tokenisation
    rules are not part of it (only the edge turns text into ids).
    """
    table = vocab_table(tokenizer)
    pairs = [[tok, idx] for idx, tok in enumerate(table) if tok is not None]
    blob = json.dumps(pairs, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:16]


def check_vocab_compatible(
    draft_tokenizer: Any,
    target_tokenizer: Any,
    draft_vocab_size: int,
    target_vocab_size: int,
) -> int:
    """Check that draft and target name the same token with the same id; return the valid vocabulary size.

    Args:
        draft_tokenizer / target_tokenizer: HF tokenizers of the two models.
        draft_vocab_size / target_vocab_size: width of each model's logits (embedding rows; may be padded
            past the tokenizer, e.g. to a multiple of 64).

    Returns:
        n: number of valid token ids (ids 0..n-1 are real tokens shared by both sides, and both models have
        a logit for each). Logit columns at or past n are padding: pass ``valid_vocab_size=n`` to
        ``common.sampling.logits_to_probs`` so they get probability 0.

    Raises:
        VocabMismatchError: a one-line message naming the first id whose token differs (or exists on one side
        only), or a model whose logits are narrower than its tokenizer.
    """
    draft = vocab_table(draft_tokenizer)
    target = vocab_table(target_tokenizer)
    for idx in range(max(len(draft), len(target))):
        d = draft[idx] if idx < len(draft) else None
        t = target[idx] if idx < len(target) else None
        if d != t:
            raise VocabMismatchError(
                f"draft and target vocabularies differ at token id {idx}: draft {d!r} vs target {t!r} "
                f"(draft tokenizer has {len(draft)} ids, target {len(target)}); the draft must use the "
                "target's tokenizer"
            )
    n = len(target)
    for side, size in (("draft", draft_vocab_size), ("target", target_vocab_size)):
        if size < n:
            raise VocabMismatchError(
                f"{side} model has {size} logits but its tokenizer has {n} tokens (ids {size}..{n - 1} "
                "cannot be scored)"
            )
    return n
