"""common.detok.IncrementalDetokenizer with the real SmolLM2 tokenizer (byte-level BPE: emoji and CJK
characters are split across tokens).

Invariant: the concatenation of all deltas (push() results + finish()) equals
common.stopping.generated_text_for_output for the same tokens, however the tokens are split into push() calls;
no delta carries a broken character; nothing at or after a stop string is ever streamed.
"""

from __future__ import annotations

import random

import pytest

from _tokenizer import load_smollm2_tokenizer
from specdec_runtime.common.detok import IncrementalDetokenizer, find_stop_string, stop_prefix_length
from specdec_runtime.common.stopping import StopChecker, generated_text_for_output
from specdec_runtime.common.types import FinishReason, StoppingCriteria

EOS = 2
REPLACEMENT = "\ufffd"

TEXTS = [
    "¿Qué tal? ½ cup, naïve café ☕ — 中文字符 and 🤖🚀 emojis. The end.\nUser: next",
    "日本語のテキストです。Hello, world! 😀😃😄 42 + 17 = 59\n\nAssistant: sure",
    "def f(x):\n    return x ** 2  # 平方\nprint(f(3))  ✅ done 👩‍👩‍👧",
]


@pytest.fixture(scope="module")
def tok():
    return load_smollm2_tokenizer()


def stream(tok, ids, splits, stop_strings=(), finish_reason=None):
    """Push ``ids`` in chunks of the given sizes; return (deltas, detokenizer)."""
    detok = IncrementalDetokenizer(tok, stop_strings)
    deltas, i = [], 0
    for size in splits:
        deltas.append(detok.push(ids[i : i + size]))
        i += size
    assert i == len(ids)
    deltas.append(detok.finish(finish_reason))
    return deltas, detok


def random_splits(rng, n, max_chunk=6):
    splits = []
    while n > 0:
        splits.append(min(n, rng.randint(1, max_chunk)))
        n -= splits[-1]
    return splits


def test_multibyte_characters_are_never_streamed_broken(tok):
    ids = tok.encode("Hi 😀!")  # ['Hi', ' \xf0\x9f', '\x98\x80', '!']
    deltas, detok = stream(tok, ids, [1, 1, 1, 1])
    assert deltas == ["Hi", " ", "😀", "!", ""]
    ids = tok.encode("日本語 text")  # 日 and 語 are each split over two or three tokens
    deltas, _ = stream(tok, ids, [1] * len(ids))
    assert [d for d in deltas if d] == ["日", "本", "語", " text"]
    assert all(REPLACEMENT not in d for d in deltas)


def test_every_split_concatenates_to_the_final_text(tok):
    rng = random.Random(1)
    for text in TEXTS:
        ids = tok.encode(text)
        expected = generated_text_for_output(tok, ids, None, ())
        assert expected == text
        for splits in ([1] * len(ids), [len(ids)], *(random_splits(rng, len(ids)) for _ in range(30))):
            deltas, detok = stream(tok, ids, splits)
            assert "".join(deltas) == expected == detok.text
            assert all(REPLACEMENT not in d for d in deltas)


def test_stop_string_prefix_is_held_then_released(tok):
    ids = tok.encode("I will Use it")  # ['I', ' will', ' Use', ' it']
    detok = IncrementalDetokenizer(tok, ["User:"])
    assert detok.push(ids[:3]) == "I will "  # "Use" could begin "User:": held back
    assert detok.push(ids[3:]) == "Use it"  # "Use " cannot: released
    assert detok.finish(FinishReason.LENGTH) == ""
    assert detok.text == "I will Use it"


def test_nothing_after_a_stop_string_is_streamed(tok):
    ids = tok.encode("Hi\nUser: ok")  # ['Hi', '\n', 'User', ':', ' ok']
    detok = IncrementalDetokenizer(tok, ["\nUser:"])
    assert detok.push(ids[:1]) == "Hi"
    assert detok.push(ids[1:3]) == ""  # "\nUser" is a prefix of the stop string
    assert detok.push(ids[3:]) == ""  # the stop string completed: nothing more
    assert detok.finish(FinishReason.STOP_STRING) == ""
    assert detok.text == "Hi"
    # All at once, and with a stop string wholly inside one push.
    deltas, _ = stream(tok, ids, [len(ids)], ["\nUser:"], FinishReason.STOP_STRING)
    assert "".join(deltas) == "Hi"


def test_finish_flushes_held_text_and_incomplete_characters(tok):
    ids = tok.encode("I will Use")
    deltas, _ = stream(tok, ids, [len(ids)], ["User:"], FinishReason.LENGTH)
    assert deltas == ["I will ", "Use"]  # a held stop prefix is released at a non-stop finish
    ids = tok.encode("Hi 😀")[:-1]  # ends with half an emoji
    deltas, _ = stream(tok, ids, [1, 1], (), FinishReason.LENGTH)
    assert deltas == ["Hi", " ", REPLACEMENT]  # as the full decode renders it, only at finish
    assert "".join(deltas) == generated_text_for_output(tok, ids, FinishReason.LENGTH, ())


def test_special_tokens_are_skipped(tok):
    hello = tok.encode("Hello")[0]
    deltas, _ = stream(tok, [hello, EOS], [1, 1], (), FinishReason.EOS)
    assert deltas == ["Hello", "", ""]
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert detok.push([hello, EOS]) == "Hello<|im_end|>"


def test_finish_and_push_after_finish_raise(tok):
    detok = IncrementalDetokenizer(tok)
    detok.finish(None)
    with pytest.raises(RuntimeError):
        detok.push([5])
    with pytest.raises(RuntimeError):
        detok.finish(None)
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tok, [""])


def test_stop_helpers():
    assert find_stop_string("abcabd", ["bd", "ca"]) == 2
    assert find_stop_string("abc", ["x"]) == -1
    assert stop_prefix_length("hello Use", ["User:", "se!"]) == 3
    assert stop_prefix_length("hello U", ["User:"]) == 1
    assert stop_prefix_length("hello User:", ["User:"]) == 0  # complete, not a proper prefix
    assert stop_prefix_length("abc", []) == 0


def test_stop_checker_and_detokenizer_together_on_random_blocks(tok):
    """The edge's loop: offer blocks to the StopChecker, push what it commits, finish with its reason.
    Every delta is a prefix-extension of the final text, which equals generated_text_for_output."""
    rng = random.Random(2)
    for text in TEXTS:
        ids = tok.encode(text) + [EOS] + tok.encode(" after EOS")
        for _ in range(40):
            starts = [rng.randrange(len(text)) for _ in range(rng.randint(0, 2))]
            stops = [text[a : a + rng.randint(1, 6)] for a in starts]
            criteria = StoppingCriteria(max_new_tokens=rng.randint(5, len(ids) + 5), stop_strings=tuple(stops))
            sc = StopChecker(tok, criteria, [EOS], 20, 4096)
            detok = IncrementalDetokenizer(tok, stops)
            streamed, i = "", 0
            while not sc.finished and i < len(ids):
                block = ids[i : i + rng.randint(1, 5)]
                n, _ = sc.append(block)
                streamed += detok.push(block[:n])
                i += len(block)
            streamed += detok.finish(sc.finish_reason)
            expected = generated_text_for_output(tok, sc.generated_token_ids, sc.finish_reason, stops)
            assert streamed == expected == detok.text, (stops, criteria)
            assert not any(s in streamed for s in stops) or sc.finish_reason is not FinishReason.STOP_STRING
            assert "after EOS" not in streamed


class CountingTokenizer:
    """Wraps a tokenizer and records the length of every decode() call."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decoded_lengths: list[int] = []

    def decode(self, ids, **kwargs):
        self.decoded_lengths.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_decodes_a_short_window_only(tok):
    """Work per push does not grow with the output: the decode window stays bounded (it only grows over a run
    of pushes that all end inside a character, as CJK text split 4 tokens at a time does) and the total
    decoded length is linear in the output."""
    maxima = []
    for repeats in (2, 8):
        ids = tok.encode(" ".join(TEXTS) * repeats)
        counting = CountingTokenizer(tok)
        detok = IncrementalDetokenizer(counting, ["never appears"])
        for i in range(0, len(ids), 4):
            detok.push(ids[i : i + 4])
        detok.finish(None)
        assert detok.text == tok.decode(ids)
        assert len(counting.decoded_lengths) <= len(ids)
        assert sum(counting.decoded_lengths) <= 12 * len(ids)
        maxima.append(max(counting.decoded_lengths))
    assert maxima[1] == maxima[0] <= 40, maxima  # 4x more output, same largest window


def test_random_tokens_with_broken_utf8(tok):
    """Arbitrary model output: random ids, half of them single-byte tokens that make invalid UTF-8 runs, EOS
    inside. StopChecker agrees with a brute-force prefix decode, and the streamed text with the full decode."""
    byte_tokens = [i for i in range(300) if tok.decode([i]) == REPLACEMENT]  # the byte-level alphabet's tail
    assert len(byte_tokens) > 50
    rng = random.Random(3)
    for _ in range(150):
        ids = [rng.choice(byte_tokens) if rng.random() < 0.5 else rng.randrange(49152)
               for _ in range(rng.randint(1, 40))]
        if rng.random() < 0.2:
            ids.insert(rng.randrange(len(ids) + 1), EOS)
        full = tok.decode(ids, skip_special_tokens=True)
        starts = [rng.randrange(len(full) or 1) for _ in range(rng.randint(0, 2))]
        stops = [full[a : a + rng.randint(1, 4)] for a in starts]
        stops = [s for s in stops if s and REPLACEMENT not in s]
        criteria = StoppingCriteria(max_new_tokens=1000, stop_strings=tuple(stops), ignore_eos=True)
        sc = StopChecker(tok, criteria, [EOS], 0, 10**6)
        i = 0
        while i < len(ids) and not sc.finished:
            block = ids[i : i + rng.randint(1, 5)]
            sc.append(block)
            i += len(block)
        prefixes = (tok.decode(ids[:k], skip_special_tokens=True) for k in range(1, len(ids) + 1))
        expected_stop = next((k for k, text in enumerate(prefixes, 1) if any(s in text for s in stops)), None)
        assert (sc.num_generated if sc.finished else None) == expected_stop, (ids, stops)
        committed = sc.generated_token_ids
        deltas, _ = stream(tok, committed, random_splits(rng, len(committed)), stops, sc.finish_reason)
        assert "".join(deltas) == generated_text_for_output(tok, committed, sc.finish_reason, stops), (ids, stops)
        if not stops:  # (with stop strings a held stop prefix may follow a final U+FFFD of garbage bytes)
            assert not any(d.endswith(REPLACEMENT) for d in deltas[:-1])  # possibly incomplete: held
