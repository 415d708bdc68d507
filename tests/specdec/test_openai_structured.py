"""`specdec edge-serve` structured output with the official `openai` client: response_format json_object and
json_schema (valid JSON, equal to target-only decoding under the same grammar through the SDK), tools with a named
or required tool_choice (tool_calls whose arguments validate, streamed and not; parallel_tool_calls false: one
call), tool messages in the history, an invalid schema as openai.BadRequestError with the engine's message. One
edge-serve subprocess over the tiny pair (embedded verifier)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from test_openai_server import _edge_serve  # noqa: E402 - the subprocess fixture of the endpoint's main test

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(600)

KEY = "sk-edge-test-" + "s" * 16
MESSAGES = [{"role": "user", "content": "Give me a record as JSON."}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "kind": {"enum": ["cat", "dog"]},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 30}},
          "required": ["name", "kind", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "integer", "minimum": -12,
                                                                               "maximum": 14}},
                                       "required": ["tz"], "additionalProperties": False}}}
PARAMS = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}


@pytest.fixture(scope="module")
def client(tiny_pair):
    with _edge_serve("--target", str(tiny_pair.target_dir), "--draft", str(tiny_pair.draft_dir), key=KEY) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        yield c, c.models.list().data[0].id


@pytest.fixture(scope="module")
def target_only(tiny_pair):
    """Target-only greedy decoding in-process over the same chat ids, with a grammar."""
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
    yield lambda spec, n: edge.generate(list(ids), max_new_tokens=n, temperature=0.0, grammar=spec)
    backend.close()


def _chat(client, messages=MESSAGES, **kw):
    c, model = client
    return c.chat.completions.create(model=model, messages=messages, temperature=0, **kw)


def _streamed_calls(client, **kw):
    """(content, {index: (name, arguments text)}, finish_reason) of a streamed chat response."""
    content, calls, finish = "", {}, None
    for chunk in _chat(client, stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                name, args = calls.get(tc.index, ("", ""))
                calls[tc.index] = (name + (tc.function.name or ""), args + (tc.function.arguments or ""))
            finish = ch.finish_reason or finish
    return content, calls, finish


def test_json_schema_is_valid_and_equals_target_only(client, target_only):
    from specdec_runtime.common.grammar import GrammarSpec

    rf = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    out = _chat(client, max_tokens=60, response_format=rf)
    text = out.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert out.choices[0].finish_reason == "stop"
    assert text == target_only(GrammarSpec.json_schema(SCHEMA), 60).text
    streamed, _, _ = _streamed_calls(client, max_tokens=60, response_format=rf)
    assert streamed == text


def test_json_object_is_a_json_object(client):
    out = _chat(client, max_tokens=120, response_format={"type": "json_object"}, extra_body={"top_k": 1})
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    else:  # the tiny random model may fill max_tokens inside a string: what it wrote still opens an object
        assert out.choices[0].message.content.startswith("{")


def test_named_tool_call_validates_streamed_and_not(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = _chat(client, max_tokens=80, tools=[WEATHER, TIME], tool_choice=choice)
    ch = out.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls
    call = ch.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), PARAMS["get_weather"])
    content, calls, finish = _streamed_calls(client, max_tokens=80, tools=[WEATHER, TIME], tool_choice=choice)
    assert finish == "tool_calls" and not content.strip()
    assert [(n, json.loads(a)) for n, a in calls.values()] == \
           [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls]


def test_required_single_call_and_tool_messages_in_history(client):
    out = _chat(client, max_tokens=80, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    calls = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    jsonschema.validate(json.loads(calls[0].function.arguments), PARAMS[calls[0].function.name])
    history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": calls[0].id, "type": "function",
         "function": {"name": calls[0].function.name, "arguments": calls[0].function.arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": '{"ok": true}'}]
    again = _chat(client, messages=history, max_tokens=8, tools=[WEATHER, TIME], tool_choice="none")
    assert again.choices[0].finish_reason in ("stop", "length") and again.choices[0].message.tool_calls is None


def test_invalid_schema_and_bad_tool_choice_are_400(client):
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}
    with pytest.raises(openai.BadRequestError, match="frob"):
        _chat(client, max_tokens=4, response_format=rf)
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        _chat(client, max_tokens=4, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        _chat(client, max_tokens=4, tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})
