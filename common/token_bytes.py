"""The raw bytes of one token: what OpenAI's logprobs ``bytes`` field carries, so a client can rebuild text whose
characters are split over several tokens.

Decoding a token alone loses that: byte-level BPE (GPT-2 family, SmolLM2, Llama 3, Qwen) splits a CJK character
or an emoji over two or three tokens, and each one decoded alone is U+FFFD. The bytes come from the token's
*string* in the vocabulary instead, by the tokenizer's decoder:

- ``ByteLevel``: each character of the token string stands for one byte (GPT-2's ``bytes_to_unicode`` alphabet:
  printable bytes as themselves, the others shifted to U+0100 and up); the table is inverted here.
- ``ByteFallback`` (SentencePiece-style, Llama 2, Mistral): a ``<0xHH>`` token is that byte; other tokens are
  text with ``▁`` for a space.
- anything else (WordPiece, ...): the UTF-8 of the token decoded alone.

Added tokens (``<|im_end|>``, ...) are their content in UTF-8. Concatenating the bytes of a generation's tokens
gives exactly the UTF-8 of its text (byte-level decoding is that concatenation followed by UTF-8 decoding).
"""

from __future__ import annotations

import json
import re
import weakref
from typing import Any

__all__ = ["token_bytes"]

_HEX_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_KINDS: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the character that stands for each byte → the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, shift = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + shift)] = b
            shift += 1
    return chars


_BYTE_OF_CHAR = _byte_level_alphabet()


def _decoder_types(state: dict) -> list[str]:
    """The types of a ``tokenizers`` decoder and of its parts (a Sequence lists them)."""
    return [state.get("type", ""), *(t for d in state.get("decoders") or () for t in _decoder_types(d))]


def _kind(tokenizer: Any) -> str:
    """"byte_level", "byte_fallback" or "text": how ``tokenizer``'s token strings map to bytes (cached)."""
    try:
        return _KINDS[tokenizer]
    except (KeyError, TypeError):
        pass
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a tokenizers.Tokenizer (HF fast, EdgeTokenizer)
    decoder = getattr(backend, "decoder", None)
    types = _decoder_types(json.loads(decoder.__getstate__())) if decoder is not None else []
    kind = "byte_level" if "ByteLevel" in types else "byte_fallback" if "ByteFallback" in types else "text"
    try:
        _KINDS[tokenizer] = kind
    except TypeError:  # not weak-referenceable: recomputed next time
        pass
    return kind


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The raw bytes of token ``token_id`` of ``tokenizer`` (an HF tokenizer or
    :class:`edge_client.drafting.tokenizer.EdgeTokenizer`); see the module docstring for the rules. An id with no token
    string gives the UTF-8 of its decoded text."""
    token_id = int(token_id)
    added = (getattr(tokenizer, "added_tokens_decoder", None) or {}).get(token_id)
    if added is not None:
        return str(added).encode("utf-8")
    piece = tokenizer.convert_ids_to_tokens(token_id)
    kind = _kind(tokenizer) if piece is not None else "text"
    if kind == "byte_level" and all(c in _BYTE_OF_CHAR for c in piece):
        return bytes(_BYTE_OF_CHAR[c] for c in piece)
    if kind == "byte_fallback":
        hex_byte = _HEX_BYTE.fullmatch(piece)
        return bytes([int(hex_byte.group(1), 16)]) if hex_byte else piece.replace("▁", " ").encode("utf-8")
    return tokenizer.decode([token_id]).encode("utf-8")
