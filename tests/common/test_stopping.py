"""common.stopping.StopChecker and generated_text_for_output, with the real SmolLM2 tokenizer (byte-level BPE:
emoji and CJK characters are split across tokens).

The rule under test is target-only decoding's: tokens are committed up to and including the earliest stopping
token of an offered block; EOS / stop token ids → EOS, a stop string in the decoded text → STOP_STRING,
max_new_tokens → LENGTH, prompt + generated == context → CONTEXT.
"""

from __future__ import annotations

import random

import pytest

from _tokenizer import load_smollm2_tokenizer
from specdec_runtime.common.stopping import StopChecker, generated_text_for_output
from specdec_runtime.common.types import FinishReason, StoppingCriteria

EOS = 2  # <|im_end|>, SmolLM2-Instruct's EOS


@pytest.fixture(scope="module")
def tok():
    return load_smollm2_tokenizer()


def checker(tok, prompt_length=10, max_context_tokens=2048, eos=(EOS,), **criteria) -> StopChecker:
    return StopChecker(tok, StoppingCriteria(**criteria), eos, prompt_length, max_context_tokens)


def test_eos_in_the_middle_of_a_block(tok):
    hello, world = tok.encode("Hello world")
    sc = checker(tok)
    assert sc.append([hello]) == (1, None)
    block = [world, EOS, hello, world]
    assert sc.append(block) == (2, FinishReason.EOS)
    assert sc.generated_token_ids == [hello, world, EOS] and sc.num_generated == 3
    assert sc.finished and sc.finish_reason is FinishReason.EOS and sc.num_remaining == 0
    assert generated_text_for_output(tok, sc.generated_token_ids, sc.finish_reason, ()) == "Hello world"


def test_stop_string_spanning_two_tokens(tok):
    ids = tok.encode("Hello world war")  # ['Hello', ' world', ' war']
    assert len(ids) == 3
    sc = checker(tok, stop_strings=("lo wo",))  # 'lo' ends token 0, ' wo' starts token 1
    assert sc.append(ids) == (2, FinishReason.STOP_STRING)
    assert sc.generated_token_ids == ids[:2]
    assert generated_text_for_output(tok, ids[:2], FinishReason.STOP_STRING, ("lo wo",)) == "Hel"
    # Same tokens offered one per verify step.
    sc = checker(tok, stop_strings=("lo wo",))
    assert sc.append(ids[:1]) == (1, None)
    assert sc.append(ids[1:]) == (1, FinishReason.STOP_STRING)


def test_stop_string_completed_by_the_last_byte_of_a_character(tok):
    ids = tok.encode("Hi 😀!")  # ['Hi', ' \xf0\x9f', '\x98\x80', '!']
    assert len(ids) == 4
    sc = checker(tok, stop_strings=("😀",))
    assert sc.append(ids[:2]) == (2, None)  # half an emoji: no match yet
    assert sc.append(ids[2:]) == (1, FinishReason.STOP_STRING)
    assert generated_text_for_output(tok, ids[:3], FinishReason.STOP_STRING, ("😀",)) == "Hi "


def test_earliest_stop_wins_and_partial_stop_strings_do_not_stop(tok):
    ids = tok.encode("I will Use it now")
    sc = checker(tok, stop_strings=("User:", "it", "will"))
    assert sc.append(ids) == (2, FinishReason.STOP_STRING)  # "will" completes at token 1, before "it"
    sc = checker(tok, stop_strings=("User:", "Use it now!"))
    assert sc.append(ids) == (len(ids), None)  # prefixes of stop strings only


@pytest.mark.parametrize("max_new_tokens", [1, 2])
def test_max_new_tokens_with_a_five_token_offer(tok, max_new_tokens):
    ids = tok.encode("one two three four five")
    assert len(ids) == 5
    sc = checker(tok, max_new_tokens=max_new_tokens)
    assert sc.num_remaining == max_new_tokens
    assert sc.append(ids) == (max_new_tokens, FinishReason.LENGTH)
    assert sc.generated_token_ids == ids[:max_new_tokens]


def test_length_across_blocks(tok):
    ids = tok.encode("one two three four five")
    sc = checker(tok, max_new_tokens=3)
    assert sc.append(ids[:2]) == (2, None)
    assert sc.num_remaining == 1
    assert sc.append(ids[2:]) == (1, FinishReason.LENGTH)


def test_context_limit(tok):
    ids = tok.encode("one two three four five")
    sc = checker(tok, prompt_length=10, max_context_tokens=13)
    assert sc.num_remaining == 3
    assert sc.append(ids) == (3, FinishReason.CONTEXT)
    assert sc.prompt_length + sc.num_generated == 13


def test_eos_wins_over_length_on_the_same_token(tok):
    sc = checker(tok, max_new_tokens=2)
    assert sc.append([tok.encode("Hi")[0], EOS, 5]) == (2, FinishReason.EOS)


def test_stop_token_ids(tok):
    ids = tok.encode("The answer is 42. Next")
    period = tok.convert_tokens_to_ids(".")
    sc = checker(tok, stop_token_ids=(period,))
    n, reason = sc.append(ids)
    assert reason is FinishReason.EOS and n == ids.index(period) + 1
    # The stop token's text is kept (HF generate's behaviour); only STOP_STRING truncates.
    assert generated_text_for_output(tok, ids[:n], reason, ()) == "The answer is 42."


def test_ignore_eos(tok):
    hello = tok.encode("Hello")[0]
    period = tok.convert_tokens_to_ids(".")
    sc = checker(tok, ignore_eos=True, max_new_tokens=6)
    assert sc.append([hello, EOS, hello]) == (3, None)
    assert sc.append([EOS, EOS, EOS, EOS]) == (3, FinishReason.LENGTH)
    sc = checker(tok, ignore_eos=True, stop_token_ids=(period,))  # stop token ids still stop
    assert sc.append([EOS, hello, period, hello]) == (3, FinishReason.EOS)
    text = generated_text_for_output(tok, [hello, EOS, hello], FinishReason.LENGTH, ())
    assert text == "HelloHello"  # EOS is a special token: skipped in the text


def test_append_after_finish_raises(tok):
    sc = checker(tok, max_new_tokens=1)
    sc.append([5, 6])
    with pytest.raises(RuntimeError):
        sc.append([7])
    assert sc.generated_token_ids == [5]


def test_invalid_arguments(tok):
    with pytest.raises(ValueError):
        checker(tok, prompt_length=100, max_context_tokens=100)
    with pytest.raises(ValueError):
        checker(tok, max_new_tokens=0)
    with pytest.raises(ValueError):
        checker(tok, stop_strings=("",))


def test_empty_offer(tok):
    sc = checker(tok)
    assert sc.append([]) == (0, None) and not sc.finished


TEXTS = [
    "¿Qué tal? ½ cup, naïve café ☕ — 中文字符 and 🤖🚀 emojis. The end.\nUser: next",
    "日本語のテキストです。Hello, world! 😀😃😄 42 + 17 = 59\n\nAssistant: sure",
    "def f(x):\n    return x ** 2  # 平方\nprint(f(3))  ✅ done",
]


def _first_stop_reference(tok, ids, stop_strings):
    """Brute force: the smallest k such that decode(ids[:k]) contains a stop string (None if none)."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k], skip_special_tokens=True)
        if any(s in text for s in stop_strings):
            return k
    return None


def test_stop_strings_match_brute_force_on_random_blocks(tok):
    rng = random.Random(0)
    for text in TEXTS:
        ids = tok.encode(text)
        for _ in range(25):
            # stop strings: random substrings of the text (1–6 characters), so they often span tokens
            stops = []
            for _ in range(rng.randint(1, 3)):
                a = rng.randrange(len(text))
                stops.append(text[a : a + rng.randint(1, 6)])
            expected = _first_stop_reference(tok, ids, stops)
            sc = checker(tok, stop_strings=tuple(stops))
            i, committed = 0, 0
            while i < len(ids) and not sc.finished:
                block = ids[i : i + rng.randint(1, 5)]
                n, _ = sc.append(block)
                committed += n
                i += len(block)
            if expected is None:
                assert not sc.finished and committed == len(ids), stops
            else:
                assert sc.finish_reason is FinishReason.STOP_STRING and committed == expected, (stops, expected)
                out = generated_text_for_output(tok, ids[:committed], sc.finish_reason, stops)
                assert not any(s in out for s in stops)
                assert text.startswith(out)


class CountingTokenizer:
    """Wraps a tokenizer and records the length of every decode() call."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decoded_lengths: list[int] = []

    def decode(self, ids, **kwargs):
        self.decoded_lengths.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_stop_string_check_decodes_a_short_window_only(tok):
    ids = tok.encode(" ".join(TEXTS) * 4)
    assert len(ids) > 300
    counting = CountingTokenizer(tok)
    criteria = StoppingCriteria(max_new_tokens=10_000, stop_strings=("never appears",))
    sc = StopChecker(counting, criteria, [EOS], 0, 10**6)
    for i in range(0, len(ids), 3):
        sc.append(ids[i : i + 3])
    assert not sc.finished and sc.num_generated == len(ids)
    assert max(counting.decoded_lengths) <= 12  # never the whole output
    assert len(counting.decoded_lengths) <= 2 * len(ids)
    no_strings = CountingTokenizer(tok)
    sc = StopChecker(no_strings, StoppingCriteria(max_new_tokens=10_000), [EOS], 0, 10**6)
    sc.append(ids)
    assert no_strings.decoded_lengths == []  # without stop strings nothing is decoded
