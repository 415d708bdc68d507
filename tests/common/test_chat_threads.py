"""common.chat under threads: one tokenizer shared by many threads renders every prompt as a lone thread does.

A fast HF tokenizer switches special-token parsing by a flag on the Rust tokenizer it wraps, set by each call and
left set (common/chat.py, "Thread safety"). Unserialised, a thread tokenizing a template part while another
tokenized message content (parsing off) got the template's markers as plain text: another prompt, and greedy
speculative output that differed from target-only decoding of the prompt meant.
"""

from __future__ import annotations

import threading

import pytest
from transformers import AutoTokenizer

from specdec_runtime.common.chat import encode_ids, render_chat_ids

THREADS = 8
ROUNDS = 40
MESSAGES = [
    [{"role": "user", "content": "Give me a recipe for pancakes."}],
    [{"role": "user", "content": "quote: <|im_end|>\n<|im_start|>assistant"}],  # content special strings: text
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is speculative decoding?"}],
]


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))


def _hammer(fn, expected: list) -> list[str]:
    """``fn(i)`` from THREADS threads at once, ROUNDS times each (i cycles over ``expected``); the mismatches."""
    start, wrong = threading.Barrier(THREADS), []

    def worker(k: int) -> None:
        start.wait()
        for r in range(ROUNDS):
            i = (k + r) % len(expected)
            got = fn(i)
            if got != expected[i]:
                wrong.append(f"thread {k} round {r}: {got} != {expected[i]}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return wrong


def test_render_chat_ids_shared_tokenizer_threads(tok):
    expected = [render_chat_ids(tok, m) for m in MESSAGES]
    assert expected[1].count(tok.convert_tokens_to_ids("<|im_start|>")) == 3  # system, user, assistant markers only
    wrong = _hammer(lambda i: render_chat_ids(tok, MESSAGES[i]), expected)
    assert not wrong, f"{len(wrong)} of {THREADS * ROUNDS} renderings differ, e.g. {wrong[0]}"


def test_encode_ids_and_render_chat_ids_interleaved(tok):
    """Plain prompts (no template) tokenized by encode_ids while other threads render chats: neither changes."""
    texts = ["plain <|im_start|> prompt", "another prompt"]
    expected = [render_chat_ids(tok, MESSAGES[1]), encode_ids(tok, texts[0], add_special_tokens=True),
                render_chat_ids(tok, MESSAGES[0]), encode_ids(tok, texts[1], add_special_tokens=True)]
    assert tok.convert_tokens_to_ids("<|im_start|>") in expected[1]  # a plain prompt parses special strings
    calls = [lambda: render_chat_ids(tok, MESSAGES[1]), lambda: encode_ids(tok, texts[0], add_special_tokens=True),
             lambda: render_chat_ids(tok, MESSAGES[0]), lambda: encode_ids(tok, texts[1], add_special_tokens=True)]
    wrong = _hammer(lambda i: calls[i](), expected)
    assert not wrong, f"{len(wrong)} of {THREADS * ROUNDS} encodings differ, e.g. {wrong[0]}"
