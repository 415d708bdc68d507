"""The draft's tokenizer without transformers: ``tokenizers`` + the model directory's files, chat templates in jinja2.

The edge needs a small part of a Hugging Face tokenizer: text ↔ ids (special tokens parsed or kept as text), the
id ↔ token table (:func:`common.vocab.tokenizer_fingerprint`, which must equal the verifier's), the EOS id and the
chat template rendered to a string (:mod:`common.chat` tokenizes the pieces itself). :class:`EdgeTokenizer` is that
part, read from ``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja`` (where transformers >= 4.47
saves the template), so an edge install needs neither torch nor transformers. The template is rendered as
transformers renders it: a sandboxed jinja2 environment with ``trim_blocks``/``lstrip_blocks``, loop controls,
``raise_exception``, ``strftime_now``, a ``tojson`` that does not escape HTML, and the special tokens
(``bos_token``, ``eos_token``, ...) as variables. tests/edge_client/test_tokenizer.py compares it with
``AutoTokenizer`` id for id.
"""

from __future__ import annotations

import functools
import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

from specdec_runtime.common.chat import tokenizer_lock

__all__ = ["EdgeTokenizer", "load_tokenizer"]

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# transformers' clean_up_tokenization (spaces before punctuation and English contractions)
_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
            (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def _token_text(value: Any) -> str | None:
    """A special token of tokenizer_config.json: a string or an AddedToken dict ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_chat_template(model_dir: Path, config: dict) -> str | None:
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class EdgeTokenizer:
    """What the edge uses of a Hugging Face fast tokenizer, on the ``tokenizers`` library alone.

    Attributes:
        chat_template: the Jinja chat template (None when the model has none).
        eos_token_id, bos_token_id, pad_token_id, unk_token_id: ids of the special tokens named in
            tokenizer_config.json (None when not set).
        eos_token, bos_token, pad_token, unk_token: their strings (None when not set).
        added_tokens_decoder: dict[int, str], id → content of every added token.
    """

    def __init__(self, tokenizer, config: dict | None = None, chat_template: str | None = None) -> None:
        self._tok = tokenizer
        self._config = dict(config or {})
        self.chat_template = chat_template
        self.special_tokens_map: dict[str, str] = {}
        for name in _SPECIAL_NAMES:
            text = _token_text(self._config.get(name))
            setattr(self, name, text)
            setattr(self, f"{name}_id", None if text is None else self._tok.token_to_id(text))
            if text is not None:
                self.special_tokens_map[name] = text
        self.clean_up_tokenization_spaces = bool(self._config.get("clean_up_tokenization_spaces", False))
        self.added_tokens_decoder = {int(i): t.content for i, t in self._tok.get_added_tokens_decoder().items()}

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> EdgeTokenizer:
        """The tokenizer saved in ``model_dir`` (``tokenizer.json``; ``tokenizer_config.json`` and
        ``chat_template.jinja`` when present).

        Raises:
            FileNotFoundError: no ``tokenizer.json`` in ``model_dir`` (a slow-only tokenizer needs transformers).
            ValueError: a file that does not parse.
        """
        from tokenizers import Tokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json (the edge reads the fast tokenizer file)")
        try:
            tok = Tokenizer.from_file(str(path))
            cfg_path = model_dir / "tokenizer_config.json"
            config = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise ValueError(f"{model_dir}: cannot read the tokenizer: {e}") from None
        return cls(tok, config, _read_chat_template(model_dir, config))

    @property
    def backend_tokenizer(self):
        """The ``tokenizers.Tokenizer`` underneath (the attribute an HF fast tokenizer has by this name)."""
        return self._tok

    # ------------------------------------------------------------------ ids
    def __len__(self) -> int:
        """Number of ids, added tokens included (``len()`` of an HF tokenizer)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        """token string → id, added tokens included."""
        return self._tok.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids):
        """Token string of one id (an int) or of each id of a list (None for an unknown id)."""
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        return [self._tok.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens):
        """Id of one token string or of each of a list (None for an unknown token)."""
        if isinstance(tokens, str):
            return self._tok.token_to_id(tokens)
        return [self._tok.token_to_id(t) for t in tokens]

    # ------------------------------------------------------------------ text
    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. ``add_special_tokens``: the post-processor's BOS/EOS (as tokenizer.json says);
        ``split_special_tokens``: special-token strings in ``text`` are tokenized as ordinary text."""
        # the flag is the Rust tokenizer's, shared by every thread using this one: set and used under its lock
        with tokenizer_lock(self):
            previous = self._tok.encode_special_tokens
            self._tok.encode_special_tokens = bool(split_special_tokens)
            try:
                return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
            finally:
                self._tok.encode_special_tokens = previous

    def __call__(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> dict:
        """``{"input_ids": list[int]}`` of one string, as an HF tokenizer answers (no tensors, no batching)."""
        if not isinstance(text, str):
            raise TypeError(f"EdgeTokenizer takes one string, got {type(text).__name__}")
        return {"input_ids": self.encode(text, add_special_tokens, split_special_tokens)}

    def decode(self, ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None) -> str:
        """Text of ``ids`` (an int or a sequence of ints); ``clean_up_tokenization_spaces`` None = the model's
        setting (tokenizer_config.json), applied to WordPiece models only, as transformers 5 does."""
        ids = [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]
        text = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None \
            else clean_up_tokenization_spaces
        # transformers >= 5 cleans up WordPiece output only (on byte-level BPE it would strip real spaces)
        if clean and type(self._tok.model).__name__ == "WordPiece":
            for old, new in _CLEANUP:
                text = text.replace(old, new)
        return text

    # ------------------------------------------------------------------ chat
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False, tokenize: bool = True,
                            **kwargs):
        """The chat ``messages`` rendered by the chat template: a string (``tokenize=False``) or its ids, special
        tokens parsed and none added (as transformers tokenizes a rendered chat). ``kwargs`` are template
        variables (they override the special tokens of the same name).

        Raises:
            ValueError: the tokenizer has no chat template.
            jinja2.TemplateError: the template raised (``raise_exception``) or does not render.
        """
        if not self.chat_template:
            raise ValueError("the tokenizer has no chat template")
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {"tools": None, "documents": None, **self.special_tokens_map, **kwargs}
        template = _compile_template(self.chat_template)
        text = template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        return self.encode(text, add_special_tokens=False) if tokenize else text


@functools.lru_cache(maxsize=8)
def _compile_template(template: str):
    """The template in the environment transformers renders chat templates in (utils/chat_template_utils.py)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def load_tokenizer(model_dir: str | os.PathLike) -> EdgeTokenizer:
    """:meth:`EdgeTokenizer.from_dir` (the edge's tokenizer of a model directory). Raises as it does."""
    return EdgeTokenizer.from_dir(model_dir)
