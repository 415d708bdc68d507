"""Logprobs of text whose characters are split over tokens, through `specdec edge-serve` and the official `openai`
client: a CJK character and an emoji, each two byte-level BPE tokens (SmolLM2's tokenizer: 日 = 'æĹ' '¥',
' 😀' = 'ĠðŁĺ' 'Ģ'), forced into the output. Chat's ``bytes`` are each token's raw bytes, so their concatenation
decodes to the message content exactly; the completions' ``tokens`` are the token's text, or ``bytes:\\xNN..``
where its bytes are not UTF-8 alone (OpenAI's form), and ``text_offset`` counts characters of the text; streamed
and not. One edge-serve subprocess (embedded verifier) over a flat copy of the tiny target: its final norm zeroed,
every logit is exactly 0, so logit_bias and frequency_penalty alone decide what greedy decoding writes."""

from __future__ import annotations

import pytest

from test_openai_server import _edge_serve  # noqa: E402 - the subprocess fixture of the endpoint's main test

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(600)

KEY = "sk-edge-test-" + "b" * 16
N = 16
# The four tokens get biases 100, 99.5, 99, 98.5 over the flat model's logits of 0; frequency_penalty 2 takes 2
# off a token each time it is generated, so greedy decoding cycles through them in this order: "日 😀日 😀...".
CYCLE = {"23274": 100.0, "115": 99.5, "40303": 99.0, "218": 98.5}
FORCED = dict(temperature=0, max_tokens=N, logit_bias=CYCLE, frequency_penalty=2.0, extra_body={"ignore_eos": True})
EXPECTED = "日 😀" * (N // 4)


@pytest.fixture(scope="module")
def flat_pair(tiny_pair, tmp_path_factory):
    """(target HF dir, ONNX draft dir) of the tiny target with its final norm zeroed: all logits 0."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from specdec.models import export_onnx_draft

    root = tmp_path_factory.mktemp("flat_pair")
    model = AutoModelForCausalLM.from_pretrained(tiny_pair.target_dir)
    with torch.no_grad():
        model.model.norm.weight.zero_()
    model.save_pretrained(root / "hf")
    for f in tiny_pair.target_dir.iterdir():
        if "token" in f.name or f.name.endswith(".jinja"):
            shutil.copy(f, root / "hf" / f.name)
    # torch.onnx: seconds, against ~18 s for GenAI's builder subprocess (the graph builder is not what this checks)
    return root / "hf", export_onnx_draft(root / "hf", root / "onnx", quantize_int8=False, progress=False,
                                          builder="torch")


@pytest.fixture(scope="module")
def client(flat_pair):
    with _edge_serve("--target", str(flat_pair[0]), "--draft", str(flat_pair[1]), key=KEY) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        yield c, c.models.list().data[0].id


def _chat(client, **kw):
    c, model = client
    return c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], logprobs=True,
                                     top_logprobs=2, **FORCED, **kw)


def _completion(client, **kw):
    c, model = client
    return c.completions.create(model=model, prompt="Hi", logprobs=2, **FORCED, **kw)


def _token_bytes(token: str) -> bytes:
    """The bytes a completions ``tokens`` entry stands for (``bytes:\\xe6\\x97`` or the token's text)."""
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in token[len("bytes:"):].split("\\x")[1:])
    return token.encode("utf-8")


def _check_chat(content: str, entries) -> None:
    assert content == EXPECTED
    assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8") == content
    assert [e.token for e in entries[:2]] == ["bytes:\\xe6\\x97", "bytes:\\xa5"]  # neither is text alone
    for e in entries:
        for alt in e.top_logprobs:
            assert bytes(alt.bytes) == _token_bytes(alt.token)


def test_chat_bytes_rebuild_the_content(client):
    out = _chat(client).choices[0]
    _check_chat(out.message.content, out.logprobs.content)


def test_chat_bytes_rebuild_the_content_streamed(client):
    content, entries = "", []
    for chunk in _chat(client, stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            if ch.logprobs is not None and ch.logprobs.content:
                entries.extend(ch.logprobs.content)
    _check_chat(content, entries)


def _check_completion(text: str, tokens: list[str], offsets: list[int]) -> None:
    assert text == EXPECTED
    assert b"".join(_token_bytes(t) for t in tokens).decode("utf-8") == text
    assert tokens[:4] == ["bytes:\\xe6\\x97", "bytes:\\xa5", "bytes:\\x20\\xf0\\x9f\\x98", "bytes:\\x80"]
    # a token's offset: the characters before it (a token inside a character: where that character starts)
    assert offsets == [3 * (i // 4) + (0, 0, 1, 2)[i % 4] for i in range(N)]


def test_completion_tokens_and_offsets(client):
    out = _completion(client).choices[0]
    _check_completion(out.text, out.logprobs.tokens, out.logprobs.text_offset)


def test_completion_tokens_and_offsets_streamed(client):
    text, tokens, offsets = "", [], []
    for chunk in _completion(client, stream=True):
        for ch in chunk.choices:
            text += ch.text
            if ch.logprobs is not None and ch.logprobs.tokens:
                tokens += ch.logprobs.tokens
                offsets += ch.logprobs.text_offset
    _check_completion(text, tokens, offsets)
