"""A token's raw bytes (common.token_bytes): their concatenation over any encoding is the UTF-8 of the text, for
byte-level BPE (SmolLM2's tokenizer, through transformers and through the edge's EdgeTokenizer), SentencePiece-style
byte fallback and a plain WordPiece vocabulary."""

from __future__ import annotations

import pytest

from specdec_runtime.common.token_bytes import token_bytes

TEXTS = ["日本語 😀 and 🙂", "naïve café — ok", "<|im_end|> is special", "中文\n\ttabs  spaces", "x"]


@pytest.fixture(scope="module", params=["hf", "edge"])
def byte_level(request, smollm2_tokenizer_dir):
    if request.param == "hf":
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))
    from specdec_runtime.edge_client.drafting.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_tokenizer_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_concatenation_is_the_utf8(byte_level, text):
    ids = byte_level.encode(text, add_special_tokens=False)
    assert b"".join(token_bytes(byte_level, i) for i in ids) == text.encode("utf-8")


def test_byte_level_split_character_is_its_raw_bytes(byte_level):
    ids = byte_level.encode("日", add_special_tokens=False)
    assert len(ids) == 2 and [token_bytes(byte_level, i) for i in ids] == [b"\xe6\x97", b"\xa5"]
    assert byte_level.decode([ids[0]]) == "\ufffd"  # what decoding it alone gives


def _sentencepiece_like():
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "▁hi": 1, "▁": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    from specdec_runtime.edge_client.drafting.tokenizer import EdgeTokenizer

    return EdgeTokenizer(tok)


def test_byte_fallback_tokens_are_their_bytes():
    tok = _sentencepiece_like()
    ids = tok.encode("hi 日", add_special_tokens=False)
    pieces = [token_bytes(tok, i) for i in ids]
    assert tok.convert_ids_to_tokens(ids[-3:]) == ["<0xE6>", "<0x97>", "<0xA5>"]
    assert pieces[-3:] == [b"\xe6", b"\x97", b"\xa5"]
    assert b"".join(pieces) == " hi 日".encode("utf-8")  # ▁ is a space


def test_other_tokenizers_give_the_token_decoded_alone():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from specdec_runtime.edge_client.drafting.tokenizer import EdgeTokenizer

    wp = Tokenizer(models.WordPiece({"[UNK]": 0, "hello": 1, "##s": 2}, unk_token="[UNK]"))
    wp.pre_tokenizer = pre_tokenizers.Whitespace()
    wp.decoder = decoders.WordPiece()
    tok = EdgeTokenizer(wp)
    assert [token_bytes(tok, i) for i in tok.encode("hellos", add_special_tokens=False)] == [b"hello", b"##s"]
