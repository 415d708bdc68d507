"""Grammar-constrained decoding on both sides: the spec, its compiled form, and one matcher per session.

A :class:`GrammarSpec` says what the output must match (a JSON object, a JSON schema — OpenAI's ``strict`` subset and
more —, a regex, a list of choices, an EBNF/Lark grammar). It travels on the wire and in the session record as
JSON (:meth:`GrammarSpec.to_json`). :func:`compile_grammar` turns it into a :class:`CompiledGrammar` for one
tokenizer (cached per (spec, tokenizer)); :meth:`CompiledGrammar.matcher` gives a :class:`GrammarMatcher`, the
session's parser state over its generated ids, which yields the token mask at the current state, the masks along a
block of draft tokens (one per scored position, the verifier's and the draft's), the tokens the grammar forces, and
rolls back to the accepted prefix.

Engine: llguidance (guidance-ai; Earley parser + lazy lexer, token masks by a token trie walk). Chosen over
xgrammar by measurement on the SmolLM2 vocabulary (scripts/grammar_engines.py): no dependencies (xgrammar needs
torch and transformers, which the edge does not install), ~50 vs ~340 MiB, masks well under 0.2 ms per position
(docs/structured-output.md). How masks are used under speculation follows vLLM's structured-output spec decode
(one bitmask per draft position, the matcher rolled back to the accepted prefix).

Lossless: a mask sets the logits of forbidden ids to −inf before any other processing on both sides, so the
target's processed probability of a forbidden draft token is 0 and the rejection rule rejects it by itself.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

__all__ = ["GRAMMAR_KINDS", "GrammarSpec", "GrammarTokenizer", "CompiledGrammar", "GrammarMatcher",
           "compile_grammar", "grammar_tokenizer", "tokenizer_json", "apply_mask"]

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# JSON layout the grammar allows: one space after ':' and ',', no free whitespace. A small model left free
# whitespace can emit newlines forever; fixed separators also make more positions forced (drafted for free).
_JSON_OPTIONS = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
_MAX_SPEC_BYTES = 256 * 1024
_CACHE_SIZE = 64


def _engine():
    import llguidance  # imported on first use: a session without a grammar never loads it

    return llguidance


def _limits():
    # bounded compile and step time: a grammar over these budgets is refused with the engine's message instead of
    # hanging the session (fuel ~50k units/ms for the initial lexer: ~20 ms here)
    return _engine().LLParserLimits(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
                                    max_grammar_size=200_000)


@dataclass(frozen=True)
class GrammarSpec:
    """What the generated text must match.

    ``kind`` is one of :data:`GRAMMAR_KINDS`; ``value``: ``json_object``: "" ; ``json_schema``: the schema as JSON
    text; ``regex``: the pattern (Rust regex syntax, whole-output match); ``choice``: a JSON list of strings;
    ``grammar``: a Lark grammar or a GBNF (llama.cpp) grammar with a ``root`` rule.

    Raises (constructor):
        ValueError: unknown kind, a value too large, a json_schema that is not a JSON object, a choice list that is
            not a non-empty JSON list of strings.
    """

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"unknown grammar kind {self.kind!r} (expected one of {', '.join(GRAMMAR_KINDS)})")
        if not isinstance(self.value, str):
            raise ValueError(f"grammar value must be a string, got {type(self.value).__name__}")
        if len(self.value.encode()) > _MAX_SPEC_BYTES:
            raise ValueError(f"grammar {self.kind} is larger than {_MAX_SPEC_BYTES} bytes")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.value)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError("json_schema must be a JSON object")
        if self.kind == "choice":
            choices = _loads_or_none(self.value)
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
                raise ValueError("choice must be a non-empty JSON list of non-empty strings")
        if self.kind in ("regex", "grammar") and not self.value:
            raise ValueError(f"{self.kind} must not be empty")

    @classmethod
    def json_schema(cls, schema: dict | str) -> "GrammarSpec":
        """A JSON schema given as a dict or as JSON text (compact JSON; key order kept: the grammar emits an
        object's properties in the schema's order)."""
        if isinstance(schema, str):
            schema = _loads_or_raise(schema, "json_schema")
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))

    @classmethod
    def choice(cls, choices: list[str]) -> "GrammarSpec":
        return cls("choice", json.dumps(list(choices)))

    def to_json(self) -> str:
        """The spec as one JSON object ``{"kind": ..., "value": ...}`` (wire and session record)."""
        return json.dumps({"kind": self.kind, "value": self.value}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "GrammarSpec":
        """Inverse of :meth:`to_json`. Raises ValueError on anything else."""
        obj = _loads_or_raise(text, "grammar spec")
        if not isinstance(obj, dict) or set(obj) - {"kind", "value"} or "kind" not in obj:
            raise ValueError('grammar spec must be a JSON object {"kind": ..., "value": ...}')
        return cls(obj["kind"], obj.get("value", ""))

    @property
    def key(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def check(self) -> None:
        """Raise ValueError (the engine's message, one line) when the engine refuses the spec, checked without a
        tokenizer, so a CLI flag is checked before any model loads; what needs the tokenizer (the compiled
        grammar's size budget) is checked by :func:`compile_grammar`."""
        try:
            error = _engine().LLMatcher.validate_grammar(self.engine_grammar())
        except Exception as e:  # noqa: BLE001 - e.g. a GBNF that does not convert
            raise ValueError(f"invalid {self.kind}: {_one_line(str(e))}") from None
        if error:
            raise ValueError(f"invalid {self.kind}: {_one_line(error)}")

    def engine_grammar(self) -> str:
        """The llguidance grammar text for this spec (validated at compile time)."""
        llg = _engine()
        m = llg.LLMatcher
        if self.kind == "json_object":
            return m.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        if self.kind == "json_schema":
            return m.grammar_from_json_schema(self.value, defaults=_JSON_OPTIONS)
        if self.kind == "regex":
            return m.grammar_from_regex(self.value)
        if self.kind == "choice":
            return llg.grammar_from("choice", self.value)
        return llg.grammar_from("grammar", self.value)  # Lark, or GBNF converted to Lark


def _loads_or_none(text: str):
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return None


def _loads_or_raise(text: str, what: str):
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"{what} is not valid JSON: {e}") from None


@dataclass(frozen=True)
class GrammarTokenizer:
    """A tokenizer as the grammar engine sees it (built once per tokenizer: ~0.3 s for 49152 tokens)."""

    engine_tokenizer: object  # llguidance.LLTokenizer
    vocab_size: int  # ids the tokenizer knows; logits may be wider (padded): extra ids are never allowed
    key: str  # sha256 of the tokenizer JSON + EOS ids
    eos_token_ids: tuple[int, ...]


_TOKENIZERS: OrderedDict[str, GrammarTokenizer] = OrderedDict()
_COMPILED: OrderedDict[tuple[str, str], "CompiledGrammar"] = OrderedDict()
_BY_OBJECT: dict[tuple[int, tuple[int, ...]], tuple[object, GrammarTokenizer]] = {}  # id(tokenizer) → it
_LOCK = threading.Lock()


def tokenizer_json(tokenizer) -> str:
    """The ``tokenizer.json`` text of a ``tokenizers.Tokenizer``, a Hugging Face fast tokenizer
    (``backend_tokenizer``) or an :class:`edge_client.drafting.tokenizer.EdgeTokenizer`; a str is returned as given.

    Raises ValueError: none of these (a slow tokenizer)."""
    if isinstance(tokenizer, str):
        return tokenizer
    for attr in ("backend_tokenizer", "_tok"):
        inner = getattr(tokenizer, attr, None)
        if inner is not None and hasattr(inner, "to_str"):
            return inner.to_str()
    if hasattr(tokenizer, "to_str"):
        return tokenizer.to_str()
    raise ValueError(f"structured output needs a fast tokenizer (tokenizer.json), got {type(tokenizer).__name__}")


def grammar_tokenizer(tokenizer, eos_token_ids: list[int] | tuple[int, ...]) -> GrammarTokenizer:
    """The engine's tokenizer for a tokenizer (:func:`tokenizer_json`'s kinds), cached per (tokenizer, EOS ids).

    ``eos_token_ids``: the ids that end the output; the mask allows them once the grammar accepts (and only them
    once it can go no further). Raises ValueError: no EOS id, or a tokenizer the engine cannot read.
    """
    eos = sorted({int(i) for i in eos_token_ids})
    fast_key = (id(tokenizer), tuple(eos))
    with _LOCK:
        hit = _BY_OBJECT.get(fast_key)
    if hit is not None and hit[0] is tokenizer:  # the same object: skip serialising 49152 tokens (~60 ms)
        return hit[1]
    text = tokenizer_json(tokenizer)
    if not eos:
        raise ValueError("a grammar needs at least one EOS token id")
    key = hashlib.sha256(text.encode() + repr(eos).encode()).hexdigest()
    with _LOCK:
        if key in _TOKENIZERS:
            _TOKENIZERS.move_to_end(key)
            if not isinstance(tokenizer, str):
                _BY_OBJECT[fast_key] = (tokenizer, _TOKENIZERS[key])
            return _TOKENIZERS[key]
    try:
        tok = _engine().LLTokenizer(text, eos_token=eos)
    except Exception as e:  # noqa: BLE001 - the engine's own error, as a ValueError
        raise ValueError(f"grammar engine cannot read the tokenizer: {e}") from None
    gt = GrammarTokenizer(tok, int(tok.vocab_size), key, tuple(eos))
    with _LOCK:
        _TOKENIZERS[key] = gt
        if not isinstance(tokenizer, str):
            _BY_OBJECT[fast_key] = (tokenizer, gt)
            while len(_BY_OBJECT) > 8:
                _BY_OBJECT.pop(next(iter(_BY_OBJECT)))
        while len(_TOKENIZERS) > 4:
            _TOKENIZERS.popitem(last=False)
    return gt


class CompiledGrammar:
    """A spec compiled for one tokenizer; :meth:`matcher` gives a fresh per-session matcher (a copy, cheap)."""

    def __init__(self, spec: GrammarSpec, tokenizer: GrammarTokenizer) -> None:
        llg = _engine()
        self.spec, self.tokenizer = spec, tokenizer
        try:
            grammar = spec.engine_grammar()
        except Exception as e:  # noqa: BLE001 - e.g. a GBNF that does not convert
            raise ValueError(f"invalid {spec.kind}: {e}") from None
        template = llg.LLMatcher(tokenizer.engine_tokenizer, grammar, log_level=0, limits=_limits())
        if template.is_error():
            raise ValueError(f"invalid {spec.kind}: {_one_line(template.get_error())}")
        self._template = template

    def matcher(self) -> "GrammarMatcher":
        from specdec_runtime.common.grammar_matcher import GrammarMatcher

        return GrammarMatcher(self._template.deep_copy(), self.tokenizer.vocab_size, self.spec,
                              self.tokenizer.eos_token_ids)


_SOURCE_ECHO = re.compile(r"^\d+ \|")  # "   1 | start: /(/": the engine quoting the grammar it was given


def _one_line(message: str) -> str:
    """The engine's multi-line message on one line (CLI errors, gRPC details). A regex parse error is its own
    ``error: ...`` line (the engine's position and the quoted pattern around it point into the grammar it wraps
    the regex in, not into what the user wrote); otherwise the lines joined with "; ", without the lines that quote
    the source or only point into it with carets."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("error: ") and any("regex parse error" in other for other in lines):
            return ln[len("error: "):]
    return "; ".join(ln for ln in lines if set(ln) - set("^ |0123456789") and not _SOURCE_ECHO.match(ln))


def compile_grammar(spec: GrammarSpec, tokenizer: GrammarTokenizer) -> CompiledGrammar:
    """``spec`` compiled for ``tokenizer``, from the cache when it was compiled before (LRU, 64 entries).

    Raises:
        ValueError: the engine refuses the spec (bad schema, regex, grammar, or over the size/fuel budget); the
            message is the engine's.
    """
    key = (spec.key, tokenizer.key)
    with _LOCK:
        if key in _COMPILED:
            _COMPILED.move_to_end(key)
            return _COMPILED[key]
    compiled = CompiledGrammar(spec, tokenizer)
    with _LOCK:
        _COMPILED[key] = compiled
        while len(_COMPILED) > _CACHE_SIZE:
            _COMPILED.popitem(last=False)
    return compiled


@functools.lru_cache(maxsize=8)
def _neg_inf(dtype) -> np.ndarray:
    return np.array(-np.inf, dtype=dtype)


def apply_mask(logits: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``logits`` with the ids ``mask`` forbids set to −inf, in place (numpy; the edge's path).

    ``logits``: [vocab_size] or [n, vocab_size] float; ``mask``: bool of the same shape (True = allowed).
    """
    np.putmask(logits, ~mask, _neg_inf(logits.dtype))
    return logits


from specdec_runtime.common.grammar_matcher import GrammarMatcher  # noqa: E402  (re-exported; it imports nothing from here)
