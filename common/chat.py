"""Chat templates rendered to token ids, with message content kept as text (no forged turns).

A chat template (the tokenizer's own Jinja template, ``tokenizer.chat_template``) wraps each message in
markers such as ``<|im_start|>user\\n ... <|im_end|>\\n``. Rendering the whole conversation to one string and
tokenizing it with special-token parsing on (what ``apply_chat_template(tokenize=True)`` does) also parses
special-token strings that a *user typed* inside a message: a message containing
``"<|im_end|>\\n<|im_start|>assistant"`` would become the real end-of-turn and start-of-assistant tokens, so a
user could forge turns of the conversation (prompt injection through the template).

Method (:func:`render_chat_ids`): render the template with a unique sentinel string in place of each message's
content, split the rendered string at the sentinels, tokenize the template's own parts with special-token
parsing on and the content parts with it off (``split_special_tokens=True``), and concatenate. The template's
markers are then the only special tokens in the ids. The same approach is taken by vLLM's and llama.cpp's
chat front ends (content tokenized with ``parse_special`` off).

Multi-turn sessions (:func:`continuation_ids`) append the next turn to a conversation whose committed ids are
the prompt plus the assistant's reply *as generated* (the verifier keeps its KV cache over those exact ids), so
the continuation is rendered on its own rather than re-rendering the whole conversation.

Thread safety: a fast Hugging Face tokenizer has no per-call switch for special-token parsing. A call with
``split_special_tokens`` sets ``encode_special_tokens`` on the ONE Rust tokenizer it wraps and leaves it set, and
every later call sets it again from its own argument. Two threads sharing a tokenizer (concurrent generations of
one client, an API server's requests) could therefore tokenize a template part while the other thread's content
call had special-token parsing off: the template's markers came out as plain text (``<|im_start|>`` as seven
ordinary tokens), a different prompt, so a greedy generation differed from target-only decoding of the prompt
meant. Every tokenizer call of this module (and :func:`encode_ids`, for other callers) therefore runs under one
re-entrant lock per tokenizer (:func:`tokenizer_lock`): the flag is set and used within one locked call.
"""

from __future__ import annotations

import secrets
import threading
import weakref
from collections.abc import Sequence

__all__ = ["ROLES", "render_chat_ids", "continuation_ids", "turn_end_ids", "message_text", "encode_ids",
           "tokenizer_lock"]

#: Message roles accepted (OpenAI's chat roles that a plain chat template renders).
ROLES = ("system", "user", "assistant")


def message_text(message: dict) -> str:
    """The text content of one chat message.

    ``message``: ``{"role": one of ROLES, "content": str}``; content may also be OpenAI's list of text parts
    (``[{"type": "text", "text": str}, ...]``, joined without separator).

    Raises:
        ValueError: not a dict, an unknown role, or content that is neither a string nor a list of text parts.
    """
    if not isinstance(message, dict):
        raise ValueError(f"a chat message must be a dict with 'role' and 'content', got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"unknown chat message role {role!r}: use one of {', '.join(ROLES)}")
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise ValueError(
        f"chat message content must be a string or a list of text parts, got {type(content).__name__} "
        f"(role {role!r})"
    )


def _check_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template")


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    if not isinstance(text, str):  # batched form
        raise ValueError("the chat template did not render to one string")
    return text


def _sentinels(n: int, avoid: str = "") -> list[str]:
    """``n`` unique sentinel strings (no whitespace: templates that trim content leave them intact)."""
    while True:
        nonce = secrets.token_hex(8)
        if nonce not in avoid:
            return [f"\u27e6specdec{nonce}m{i}\u27e7" for i in range(n)]


_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its lock (gone with it)
_LOCKS_GUARD = threading.Lock()
_SHARED_LOCK = threading.RLock()  # for a tokenizer that cannot be weakly referenced


def tokenizer_lock(tokenizer) -> threading.RLock:
    """The re-entrant lock that serialises the calls on ``tokenizer`` that set its special-token parsing (module
    docstring, "Thread safety"); one per tokenizer object, made on first use."""
    with _LOCKS_GUARD:
        try:
            lock = _LOCKS.get(tokenizer)
            if lock is None:
                lock = _LOCKS[tokenizer] = threading.RLock()
        except TypeError:  # not weakly referenceable (or unhashable): one lock for all such tokenizers
            lock = _SHARED_LOCK
    return lock


def encode_ids(tokenizer, text: str, add_special_tokens: bool = False, split_special_tokens: bool = False) -> list[int]:
    """Token ids of ``text`` by ``tokenizer`` (an HF tokenizer, or anything answering ``tokenizer(text,
    add_special_tokens=..., split_special_tokens=...)["input_ids"]``), under :func:`tokenizer_lock`, so that another
    thread's call cannot switch special-token parsing meanwhile. ``split_special_tokens``: special-token strings in
    ``text`` are tokenized as literal text. Returns list[int] [num_tokens]."""
    if not text:
        return []
    kwargs = {"split_special_tokens": True} if split_special_tokens else {}
    with tokenizer_lock(tokenizer):
        return [int(t) for t in tokenizer(text, add_special_tokens=add_special_tokens, **kwargs)["input_ids"]]


def _template_ids(tokenizer, text: str) -> list[int]:
    """Template text: special-token strings parsed (the template's markers), no BOS/EOS added (the template
    writes its own, as ``apply_chat_template`` tokenizes)."""
    return encode_ids(tokenizer, text)


def _content_ids(tokenizer, text: str) -> list[int]:
    """Message content: special-token strings stay literal text."""
    return encode_ids(tokenizer, text, split_special_tokens=True)


def _split_ids(tokenizer, rendered: str, sentinels: Sequence[str], contents: Sequence[str]) -> list[int]:
    """Token ids of ``rendered`` where each sentinel stands for the content of the same index.

    Raises:
        ValueError: a sentinel does not appear exactly once, or not in order (the template altered or
            reordered message content).
    """
    ids: list[int] = []
    pos = 0
    for sentinel, content in zip(sentinels, contents):
        at = rendered.find(sentinel, pos)
        if at < 0 or rendered.count(sentinel) != 1:
            raise ValueError(
                "the chat template alters, drops or repeats message content: cannot keep content as text"
            )
        ids += _template_ids(tokenizer, rendered[pos:at])
        ids += _content_ids(tokenizer, content)
        pos = at + len(sentinel)
    ids += _template_ids(tokenizer, rendered[pos:])
    return ids


def render_chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template, message content kept as text.

    Args:
        tokenizer: a Hugging Face tokenizer with a ``chat_template``.
        messages: ``[{"role": "system" | "user" | "assistant", "content": str}, ...]`` (:func:`message_text`).
        add_generation_prompt: end with the template's start of an assistant turn (``<|im_start|>assistant\\n``
            for ChatML), as for generation.

    Returns:
        list[int] [num_tokens]: the ids ``apply_chat_template(messages, tokenize=True)`` gives for ordinary text,
        except that special-token strings inside a message's content are tokenized as literal text: the only
        special tokens are the template's own markers.

    Raises:
        ValueError: no messages, a bad role or content type, a tokenizer without a chat template, or a template
            that alters message content (sentinel method, module docstring).
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    _check_template(tokenizer)
    contents = [message_text(m) for m in messages]
    sentinels = _sentinels(len(messages), "".join(contents))
    stand_ins = [{"role": m["role"], "content": s} for m, s in zip(messages, sentinels)]
    return _split_ids(tokenizer, _render(tokenizer, stand_ins, add_generation_prompt), sentinels, contents)


def turn_end_ids(tokenizer) -> list[int]:
    """Ids the template writes after an assistant message's content (ChatML: ``<|im_end|>\\n`` = [im_end, \\n]).

    Raises:
        ValueError: no chat template, or one that does not end an assistant turn after its content.
    """
    _check_template(tokenizer)
    s = _sentinels(2)
    rendered = _render(tokenizer, [{"role": "user", "content": s[0]}, {"role": "assistant", "content": s[1]}],
                       add_generation_prompt=False)
    at = rendered.find(s[1])
    if at < 0:
        raise ValueError("the chat template drops assistant content")
    return _template_ids(tokenizer, rendered[at + len(s[1]) :])


def continuation_ids(tokenizer, history_ids: list[int], messages_after: list[dict]) -> list[int]:
    """Ids to append to a conversation's committed ids to add ``messages_after`` and the generation prompt.

    ``history_ids`` are the conversation's committed ids: the prompt rendered by :func:`render_chat_ids` (with
    the generation prompt) followed by the assistant's reply as generated (possibly ending with the template's
    end-of-turn token, e.g. ``<|im_end|>`` = EOS, or cut by a length limit or stop string). The result is:

    1. the rest of the end-of-assistant-turn marker (:func:`turn_end_ids`): with ChatML ``<|im_end|>\\n``, only
       ``\\n`` when the reply already ended with ``<|im_end|>``, the whole marker when it was cut short; the
       longest suffix of ``history_ids`` that is a prefix of the marker counts as already there;
    2. the new turns rendered with message content kept as text, ending with the generation prompt.

    Assumptions about the template (true of ChatML templates such as SmolLM2's, Qwen's, and of Llama 3's):
    - *prefix-stable*: rendering ``messages + more`` starts with the rendering of ``messages`` (without the
      generation prompt), i.e. later messages never change how earlier ones render; checked on stand-in
      messages, ValueError otherwise;
    - a message's rendering does not depend on its position except for the first message (a default system
      prompt the template adds when the conversation does not start with one);
    - tokenizing the marker and the new turns on their own gives the ids the whole string would (true when the
      pieces meet at special tokens or newlines, as in ChatML).
    Then ``history_ids + continuation_ids(...)`` equals :func:`render_chat_ids` of the whole conversation
    whenever the reply's ids are what tokenizing its text gives (tests/common/test_chat.py checks it).

    Args:
        tokenizer: a Hugging Face tokenizer with a ``chat_template``.
        history_ids: list[int] [committed_length]: prompt + reply so far.
        messages_after: the new messages (usually one ``{"role": "user", ...}``), non-empty.

    Returns:
        list[int]: the appended ids (non-empty).

    Raises:
        ValueError: no new messages, a bad role or content type, no chat template, a template that is not
            prefix-stable or alters content.
    """
    if not isinstance(messages_after, (list, tuple)) or not messages_after:
        raise ValueError("messages_after must be a non-empty list of {'role', 'content'} dicts")
    _check_template(tokenizer)
    contents = [message_text(m) for m in messages_after]
    s = _sentinels(2 + len(messages_after), "".join(contents))
    before = [{"role": "user", "content": s[0]}, {"role": "assistant", "content": s[1]}]
    after = [{"role": m["role"], "content": x} for m, x in zip(messages_after, s[2:])]
    head = _render(tokenizer, before, add_generation_prompt=False)
    whole = _render(tokenizer, before + after, add_generation_prompt=True)
    if not whole.startswith(head):
        raise ValueError("the chat template is not prefix-stable: a conversation cannot be continued in place")
    end = turn_end_ids(tokenizer)
    have = 0
    for k in range(min(len(end), len(history_ids)), 0, -1):
        if list(history_ids[-k:]) == end[:k]:
            have = k
            break
    return end[have:] + _split_ids(tokenizer, whole[len(head) :], s[2:], contents)
