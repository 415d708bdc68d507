"""common.stopping at its edges, with the real SmolLM2 tokenizer: the state of a fresh checker, the errors'
messages, stop strings matched only in generated text (never in text the checker made up, never in a special
token's text: the output text skips special tokens), and the output text independent of the tokenizer's
``clean_up_tokenization_spaces`` default. test_stopping.py holds the rule itself (earliest stop wins, ...).
"""

from __future__ import annotations

import pytest

from _tokenizer import load_smollm2_tokenizer
from specdec_runtime.common.stopping import StopChecker, generated_text_for_output
from specdec_runtime.common.types import FinishReason, StoppingCriteria


@pytest.fixture(scope="module")
def tok():
    return load_smollm2_tokenizer()


def checker(tok, prompt_length=10, max_context_tokens=2048, eos=(), **criteria) -> StopChecker:
    return StopChecker(tok, StoppingCriteria(**criteria), eos, prompt_length, max_context_tokens)


def test_fresh_checker_state(tok):
    for sc in (checker(tok), checker(tok, stop_strings=("x",))):
        assert sc.finished is False and sc.finish_reason is None
        assert sc.generated_token_ids == [] and sc.num_generated == 0
        assert sc.num_remaining == 256  # max_new_tokens (the default) before the context's 2038


def test_error_messages(tok):
    with pytest.raises(ValueError, match=r"^prompt_length must be >= 0, got -1$"):
        checker(tok, prompt_length=-1)
    with pytest.raises(ValueError, match=r"^prompt of 5 tokens leaves no room in a context of 5 tokens$"):
        checker(tok, prompt_length=5, max_context_tokens=5)
    checker(tok, prompt_length=0, max_context_tokens=5)  # the boundaries themselves are fine
    checker(tok, prompt_length=4, max_context_tokens=5)
    sc = checker(tok, max_new_tokens=1)
    sc.append([5])
    with pytest.raises(RuntimeError, match=r"^append\(\) after the session finished \(length\)$"):
        sc.append([6])


@pytest.mark.parametrize("stop", ["X", "Xh", "XXXXhello"])
def test_stop_string_is_matched_in_generated_text_only(tok, stop):
    """Text that was never generated (no 'X' anywhere in 'hello world, hello there') never matches, however
    the stop strings' lengths set the look-back window (1 character: none kept; longer: a tail kept)."""
    ids = tok.encode("hello world, hello there")
    sc = checker(tok, stop_strings=(stop,))
    for t in ids:
        assert sc.append([t]) == (1, None)
    assert not sc.finished and sc.num_generated == len(ids)


def test_single_character_stop_string_across_tokens(tok):
    """Stop strings of one character keep no tail: each new piece of text alone is searched."""
    ids = tok.encode("ab cd, ef")
    sc = checker(tok, stop_strings=(",",))
    n = 0
    while sc.append([ids[n]]) == (1, None):
        n += 1
    assert sc.finish_reason is FinishReason.STOP_STRING and sc.num_generated == n + 1
    assert "," in tok.decode(ids[: n + 1]) and "," not in tok.decode(ids[:n])


def test_special_token_text_is_not_generated_text(tok):
    """A stop string spelled like a special token does not match that token: the output text skips special
    tokens (generated_text_for_output), so the stop-string check does too."""
    special = "<|im_end|>"
    special_id = tok.convert_tokens_to_ids(special)
    assert special_id in tok.all_special_ids
    hello = tok.encode("Hello")
    sc = checker(tok, stop_strings=(special,))
    assert sc.append(hello + [special_id] + hello) == (len(hello) * 2 + 1, None)
    text = generated_text_for_output(tok, sc.generated_token_ids, None, (special,))
    assert text == "HelloHello"


def wordpiece_tokenizer():
    """A small WordPiece tokenizer (BERT-style) whose default IS to clean up tokenization spaces (transformers 5
    ignores the clean-up for BPE tokenizers such as SmolLM2's, so only a WordPiece one shows the difference)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "a", "b", ",", ".", "c", "?"])}
    backend = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", clean_up_tokenization_spaces=True)


def test_output_text_keeps_tokenization_spaces(tok):
    """No clean-up of tokenization spaces (" ," stays " ,"), whatever the tokenizer's own default is."""
    wp = wordpiece_tokenizer()
    ids = wp.encode("a , b . c ?")
    assert wp.decode(ids) == "a, b. c?"  # this tokenizer's default clean-up changes the text
    assert generated_text_for_output(wp, ids, None, ()) == "a , b . c ?"
    assert generated_text_for_output(wp, ids, FinishReason.STOP_STRING, ("b .",)) == "a , "
    smol = tok.encode("a , b . c ?")
    assert generated_text_for_output(tok, smol, None, ()) == "a , b . c ?"
