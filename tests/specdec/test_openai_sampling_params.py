"""`specdec edge-serve` with the sampling parameters apps send, driven by the official `openai` client: logprobs
(chat and completions shapes), presence/frequency penalties, logit_bias, n=3 and the vLLM-named extensions, each
equal to target-only decoding (greedy, the same processors, through the SDK), streamed and not; out-of-range
values answered 400 naming the parameter. One edge-serve subprocess over the tiny pair (embedded verifier)."""

from __future__ import annotations

import pytest

from test_openai_server import _edge_serve  # noqa: E402 - the subprocess fixture of the endpoint's main test

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(600)

KEY = "sk-edge-test-" + "p" * 16
N = 12
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]
COMPETE = {"100": 6.0, "200": 5.5, "300": 5.0, "400": 4.5}  # four tokens compete: the penalties decide


@pytest.fixture(scope="module")
def client(tiny_pair):
    with _edge_serve("--target", str(tiny_pair.target_dir), "--draft", str(tiny_pair.draft_dir), key=KEY) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        yield c, c.models.list().data[0].id


@pytest.fixture(scope="module")
def target_only(tiny_pair):
    """Target-only greedy decoding in-process over the same chat ids: options → GenerationResult."""
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier
    from specdec_runtime.edge_client.client import EdgeClient
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
    from specdec.embedded import LocalBackend
    from specdec.openai_server import render_chat_ids

    backend = LocalBackend(Verifier(TargetRunner(tiny_pair.target_dir)))
    tokenizer = OnnxDraftModel(tiny_pair.draft_dir).tokenizer
    edge = EdgeClient(backend, None, tokenizer)
    ids = render_chat_ids(tokenizer, MESSAGES)

    def run(**kw):
        return edge.generate(list(ids), max_new_tokens=N, temperature=0.0, **kw)

    yield run
    backend.close()


def _chat(client, **kw):
    c, model = client
    return c.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=N, **kw)


def _streamed(client, **kw):
    """(text per choice index, logprobs content per index) of a streamed chat response."""
    texts, content = {}, {}
    for chunk in _chat(client, stream=True, **kw):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.logprobs is not None and ch.logprobs.content:
                content.setdefault(ch.index, []).extend(ch.logprobs.content)
    return texts, content


@pytest.mark.parametrize("options, sdk", [
    (dict(presence_penalty=0.6, logit_bias=COMPETE), dict(presence_penalty=0.6)),
    (dict(frequency_penalty=0.5, logit_bias=COMPETE), dict(frequency_penalty=0.5)),
    (dict(logit_bias=COMPETE), {}),
    (dict(logit_bias=COMPETE, extra_body=dict(repetition_penalty=1.5, min_tokens=3, min_p=0.1)),
     dict(repetition_penalty=1.5, min_tokens=3, min_p=0.1)),
])
def test_processing_equals_target_only_streamed_and_not(client, target_only, options, sdk):
    ref = target_only(logit_bias={int(k): v for k, v in COMPETE.items()}, **sdk)
    out = _chat(client, **options)
    assert out.choices[0].message.content == ref.text
    assert out.usage.completion_tokens == len(ref.token_ids)
    texts, _ = _streamed(client, **options)
    assert texts == {0: ref.text}


def test_chat_logprobs_equal_target_only(client, target_only):
    ref = target_only(logprobs=True, top_logprobs=3)
    out = _chat(client, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == len(ref.token_ids)
    for entry, lp in zip(content, ref.logprobs):
        assert abs(entry.logprob - lp.logprob) < 1e-4
        assert len(entry.top_logprobs) == 3 and abs(entry.top_logprobs[0].logprob - lp.top_logprobs[0]) < 1e-4
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    _, streamed = _streamed(client, logprobs=True, top_logprobs=3)
    assert [e.logprob for e in streamed[0]] == pytest.approx([e.logprob for e in content], abs=1e-4)
    assert [e.token for e in streamed[0]] == [e.token for e in content]
    assert _chat(client).choices[0].logprobs is None  # only when asked


def test_completions_logprobs_shape(client, target_only):
    c, model = client
    out = c.completions.create(model=model, prompt="The sky is", temperature=0, max_tokens=6, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == out.choices[0].text and all(len(t) <= 2 for t in lp.top_logprobs)


def test_n_choices_greedy_and_seeded(client, target_only):
    ref = target_only(logit_bias={int(k): v for k, v in COMPETE.items()}, presence_penalty=0.6)
    out = _chat(client, n=3, presence_penalty=0.6, logit_bias=COMPETE)
    assert [ch.index for ch in out.choices] == [0, 1, 2]
    assert all(ch.message.content == ref.text for ch in out.choices)  # greedy: n equal choices
    assert out.usage.completion_tokens == 3 * len(ref.token_ids)
    texts, _ = _streamed(client, n=3, presence_penalty=0.6, logit_bias=COMPETE)
    assert texts == {0: ref.text, 1: ref.text, 2: ref.text}
    c, model = client
    sampled = c.chat.completions.create(model=model, messages=MESSAGES, temperature=1.0, max_tokens=N, n=3, seed=5)
    one = c.chat.completions.create(model=model, messages=MESSAGES, temperature=1.0, max_tokens=N, seed=6)
    assert sampled.choices[1].message.content == one.choices[0].message.content  # choice i draws with seed + i


@pytest.mark.parametrize("options, param", [
    (dict(presence_penalty=3), "presence_penalty"), (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(logit_bias={"5": 101}), "logit_bias"), (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias={"999999": 1}), "logit_bias"), (dict(top_logprobs=21, logprobs=True), "top_logprobs"),
    (dict(top_logprobs=2), "top_logprobs"), (dict(n=9), "n"), (dict(extra_body=dict(min_p=1.5)), "min_p"),
    (dict(extra_body=dict(repetition_penalty=0)), "repetition_penalty"),
    (dict(extra_body=dict(min_tokens=N + 1)), "min_tokens"),
    (dict(max_completion_tokens=10**9), "max_completion_tokens"),
    (dict(functions=[{"name": "f", "parameters": {"type": "object"}}]), "functions"),
])
def test_out_of_range_is_400_naming_the_parameter(client, options, param):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, **options)
    assert e.value.param == param, e.value.body


def test_completions_logit_bias_out_of_the_vocabulary_names_it(client):
    c, model = client
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=model, prompt="Hi", max_tokens=2, logit_bias={"49152": 1})
    assert e.value.param == "logit_bias" and "[0, 49152)" in e.value.message


def test_streamed_logprobs_arrive_with_their_chunks(client):
    """OpenAI streams each chunk's tokens' logprobs with that chunk: more than one chunk carries them, and
    together they equal the non-streamed response's, chat and completions."""
    whole = _chat(client, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    per_chunk = [ch.logprobs.content for chunk in _chat(client, stream=True, logprobs=True, top_logprobs=2)
                 for ch in chunk.choices if ch.logprobs is not None and ch.logprobs.content]
    assert len(per_chunk) > 1
    streamed = [e for content in per_chunk for e in content]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in whole]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole], abs=1e-4)
    assert [[t.token for t in e.top_logprobs] for e in streamed] == [[t.token for t in e.top_logprobs] for e in whole]

    c, model = client
    kw = dict(model=model, prompt="The sky is", temperature=0, max_tokens=N, logprobs=2)
    ref = c.completions.create(**kw).choices[0].logprobs
    parts = [ch.logprobs for chunk in c.completions.create(stream=True, **kw) for ch in chunk.choices
             if ch.logprobs is not None and ch.logprobs.tokens]
    assert len(parts) > 1
    assert [t for p in parts for t in p.tokens] == ref.tokens
    assert [v for p in parts for v in p.token_logprobs] == pytest.approx(ref.token_logprobs, abs=1e-4)
    assert [o for p in parts for o in p.text_offset] == ref.text_offset


# a value that is not neutral for each parameter docs/openai.md may list as refused or as supported
_DOC_SAMPLES = {
    "functions": [{"name": "f", "parameters": {"type": "object"}}], "function_call": "auto", "echo": True,
    "best_of": 2, "suffix": "!", "modalities": ["audio"], "audio": {"voice": "x"}, "prediction": {"type": "content"},
    "reasoning_effort": "low", "web_search_options": {}, "response_format": {"type": "json_object"},
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
}


def _doc_row(title: str) -> str:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "openai.md").read_text()
    return next(line for line in text.splitlines() if line.startswith(f"| {title} |"))


def _named(text: str) -> list[str]:
    import re

    return [n for n in re.findall(r"`(\w+)`", text) if n in _DOC_SAMPLES]


def test_docs_refused_and_supported_parameters_are_so(client):
    """docs/openai.md's 'refused with 400' row names what the endpoint refuses (chat, then `/v1/completions`
    after 'on `/v1/completions`'), and its structured-output row what chat accepts."""
    c, model = client
    chat_part, completions_part = _doc_row("refused with 400").split("on `/v1/completions`", 1)
    refused = [("chat", n) for n in _named(chat_part)] + [("completions", n) for n in _named(completions_part)]
    assert len(refused) >= 10, refused
    for api, name in refused:
        extra = {name: _DOC_SAMPLES[name]}
        with pytest.raises(openai.BadRequestError) as e:
            if api == "chat":
                c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, extra_body=extra)
            else:
                c.completions.create(model=model, prompt="Hi", max_tokens=2, extra_body=extra)
        assert e.value.param == name, (api, name, e.value.body)
    supported = _named(_doc_row("structured output and tools (chat)"))
    assert set(supported) == {"response_format", "tools"}
    for name in supported:
        out = c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4,
                                        extra_body={name: _DOC_SAMPLES[name]})
        assert out.choices[0].finish_reason
