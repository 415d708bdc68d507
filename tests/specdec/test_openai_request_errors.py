"""`specdec edge-serve` given request bodies a new user's client may send, each answered as OpenAI answers it:
a lone UTF-16 surrogate in a prompt or message (JSON may escape one; no tokenizer encodes it), NaN and Infinity
for a number (Python's json reads them), a body whose Content-Type is not application/json: each a 400
``invalid_request_error`` naming the field in ``param``. And a required tool call cut off by ``max_tokens``:
``finish_reason: "length"``, no half call as a tool call or as content, streamed and not.

One edge-serve subprocess over the tiny pair (embedded verifier); raw bodies over http.client (the official
client cannot send them), the rest through the official `openai` client."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import pytest

from test_openai_server import _edge_serve  # noqa: E402 - the subprocess fixture of the endpoint's main test

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(600)

KEY = "sk-edge-test-" + "r" * 16
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# no arguments: the grammar forces the whole call, so a tiny random model writes it in a known number of tokens
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}


@pytest.fixture(scope="module")
def endpoint(tiny_pair):
    with _edge_serve("--target", str(tiny_pair.target_dir), "--draft", str(tiny_pair.draft_dir), key=KEY) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        yield url, c, c.models.list().data[0].id


def _post(url: str, path: str, body: str, content_type: str | None = "application/json") -> tuple[int, dict]:
    """(status, JSON answer) of a raw POST of ``body`` (text as given; no Content-Type when None)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    headers = {"authorization": f"Bearer {KEY}"}
    if content_type is not None:
        headers["content-type"] = content_type
    try:
        conn.request("POST", path, body=body.encode(), headers=headers)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def _assert_bad_request(answer: tuple[int, dict], param: str | None) -> dict:
    status, body = answer
    assert status == 400, body
    error = body["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    return error


@pytest.mark.parametrize("path, field, raw", [
    ("/v1/chat/completions", "messages", '"messages": [{"role": "user", "content": "a\\ud800b"}]'),
    ("/v1/chat/completions", "messages", '"messages": [{"role": "user", "content": [{"type": "text", '
                                         '"text": "\\udfff"}]}]'),
    ("/v1/completions", "prompt", '"prompt": "Once upon \\ud800 a time"'),
    ("/v1/completions", "stop", '"prompt": "Once", "stop": ["\\udc00"]'),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(endpoint, path, field, raw):
    url, _, model = endpoint
    body = '{"model": "%s", "max_tokens": 2, %s}' % (model, raw)
    error = _assert_bad_request(_post(url, path, body), field)
    assert "surrogate" in error["message"] and "TextInputSequence" not in error["message"]


@pytest.mark.parametrize("name", ["temperature", "top_p", "presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_a_number_that_is_not_finite_is_a_400_naming_it(endpoint, name, value):
    url, _, model = endpoint
    for path, text in (("/v1/chat/completions", '"messages": [{"role": "user", "content": "hi"}]'),
                       ("/v1/completions", '"prompt": "hi"')):
        body = '{"model": "%s", "max_tokens": 2, %s, "%s": %s}' % (model, text, name, value)
        error = _assert_bad_request(_post(url, path, body), name)
        assert "finite" in error["message"], error


def test_a_body_that_is_not_declared_json_is_a_400(endpoint):
    url, _, model = endpoint
    body = json.dumps({"model": model, "prompt": "Once upon a time", "max_tokens": 2})
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "text/plain; charset=utf-8"):
        error = _assert_bad_request(_post(url, "/v1/completions", body, content_type), None)
        assert "application/json" in error["message"], error
    for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON", None):
        status, answer = _post(url, "/v1/completions", body, content_type)
        assert status == 200 and answer["usage"]["completion_tokens"] <= 2, (content_type, answer)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_required_tool_call_cut_by_max_tokens_is_length_without_the_half_call(endpoint, tool_choice):
    _, c, model = endpoint
    kw = dict(model=model, messages=MESSAGES, tools=[WEATHER], tool_choice=tool_choice, temperature=0,
              max_tokens=6)  # '<tool_call>\n{"name": "get_weather", "arguments": {}}...' is cut inside
    out = c.chat.completions.create(**kw)
    choice = out.choices[0]
    assert out.usage.completion_tokens == 6
    assert choice.finish_reason == "length"
    assert not choice.message.tool_calls and choice.message.content is None, choice.message
    finish, deltas = None, []
    for chunk in c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            deltas.append(ch.delta)
    assert finish == "length"
    assert not any(d.tool_calls for d in deltas) and "".join(d.content or "" for d in deltas) == "", deltas
    # with room, one call is whole; parallel calls cut by the limit keep the calls that closed, still "length"
    whole = c.chat.completions.create(**{**kw, "max_tokens": 64, "parallel_tool_calls": False})
    assert whole.choices[0].finish_reason == "tool_calls"
    assert [(t.function.name, t.function.arguments) for t in whole.choices[0].message.tool_calls] == [
        ("get_weather", "{}")]
    many = c.chat.completions.create(**{**kw, "max_tokens": 64}).choices[0]
    calls = [(t.function.name, t.function.arguments) for t in many.message.tool_calls or []]
    assert calls and set(calls) == {("get_weather", "{}")} and many.message.content is None, many
