"""specdec.openai_server.tools: tool request checks, the generic prompt format, the required-call grammar (walked
with the real tokenizer: every path it allows is a call whose arguments validate), parsing and streamed deltas."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from specdec_runtime.common.grammar import compile_grammar, grammar_tokenizer
from specdec.openai_server.errors import ApiError
from specdec.openai_server.tools import (ToolCallStreamer, parse_tool_calls, parse_tools, tool_grammar,
                                         tool_messages)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "integer", "minimum": -12,
                                                                               "maximum": 14}},
                                       "required": ["tz"], "additionalProperties": False}}}
PARAMS = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}


def test_parse_tools_choices_and_refusals():
    assert parse_tools({}).choice == "none"
    req = parse_tools({"tools": [WEATHER, TIME]})
    assert (req.choice, req.parallel, req.constrained) == ("auto", True, False)
    named = parse_tools({"tools": [WEATHER, TIME], "tool_choice": {"type": "function",
                                                                   "function": {"name": "get_time"}},
                         "parallel_tool_calls": False})
    assert (named.choice, named.name, named.parallel, named.constrained) == ("function", "get_time", False, True)
    for body, param in (({"tools": {"a": 1}}, "tools"), ({"tools": [{"type": "web"}]}, "tools"),
                        ({"tools": [WEATHER, WEATHER]}, "tools"),
                        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
                        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
                         "tool_choice"),
                        ({"tool_choice": "required"}, "tool_choice"),
                        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls")):
        with pytest.raises(ApiError) as e:
            parse_tools(body)
        assert e.value.status == 400 and e.value.param == param, body


def test_tool_messages_generic_format():
    req = parse_tools({"tools": [WEATHER], "tool_choice": "auto"})
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'}]
    out = tool_messages(history, req)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.") and '"name": "get_weather"' in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n' \
                                "</tool_call>"
    assert out[3]["content"] == '<tool_response>\n{"temp": 3}\n</tool_response>'
    # tool_choice none: the tools stay out of the prompt
    assert tool_messages(history[:2], parse_tools({"tools": [WEATHER], "tool_choice": "none"})) == history[:2]
    with pytest.raises(ApiError):
        tool_messages([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}], req)


def test_parse_tool_calls():
    text = 'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {"tz": 2}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Sure." and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Rome", "unit": "C"}
    assert len({c["id"] for c in calls}) == 2 and all(c["type"] == "function" for c in calls)
    assert parse_tool_calls("no calls here") == ("no calls here", [])
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert parse_tool_calls(broken) == (broken, [])


@pytest.mark.parametrize("cut", [1, 3, 7])
def test_streamer_deltas_join_to_the_parsed_answer(cut):
    text = 'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {"tz": 2}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}\n</tool_call>'
    s = ToolCallStreamer()
    deltas = [d for i in range(0, len(text), cut) for d in s.feed(text[i:i + cut])] + s.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            c = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            c["name"] += tc.get("function", {}).get("name", "")
            c["arguments"] += tc.get("function", {}).get("arguments", "")
            assert ("id" in tc) == (tc.get("function", {}).get("name") is not None)
    ref_content, ref_calls = parse_tool_calls(text)
    assert content.strip() == ref_content and s.num_calls == 2
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
           [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in ref_calls]
    plain = ToolCallStreamer()
    assert "".join(d["content"] for d in plain.feed("a <tool") + plain.feed("kit") + plain.finish()) == "a <toolkit"


@pytest.fixture(scope="module")
def gtok(smollm2_tokenizer_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smollm2_tokenizer_dir / "tokenizer.json"))
    return tok, grammar_tokenizer(tok, [2])


def _walk(tok, matcher, rng, limit=400) -> str:
    out = []
    for _ in range(limit):
        allowed = np.flatnonzero(matcher.mask())
        short = [t for t in allowed[:4000] if len(tok.id_to_token(int(t))) <= 2] or allowed
        t = int(rng.choice(short if rng.random() < 0.9 else allowed))
        if 2 in allowed and rng.random() < 0.5:
            t = 2  # end after a call or two (the walk would add calls forever)
        matcher.advance([t])
        if t == 2:
            return tok.decode(out)
        out.append(t)
    raise AssertionError("no EOS within the limit: " + tok.decode(out))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("body", [
    {"tools": [WEATHER, TIME], "tool_choice": "required"},
    {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False},
    {"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
])
def test_required_call_grammar_yields_calls_that_validate(gtok, body, seed):
    tok, gt = gtok
    req = parse_tools(body)
    matcher = compile_grammar(tool_grammar(req), gt).matcher()
    content, calls = parse_tool_calls(_walk(tok, matcher, np.random.default_rng(seed)))
    assert content is None and calls
    if not req.parallel:
        assert len(calls) == 1
    for c in calls:
        if req.name:
            assert c["function"]["name"] == req.name
        jsonschema.validate(json.loads(c["function"]["arguments"]), PARAMS[c["function"]["name"]])


def test_named_call_grammar_forces_the_prefix(gtok):
    tok, gt = gtok
    req = parse_tools({"tools": [WEATHER, TIME], "tool_choice": {"type": "function",
                                                                 "function": {"name": "get_time"}}})
    forced = compile_grammar(tool_grammar(req), gt).matcher().forced_tokens(64)
    assert tok.decode(forced) == '<tool_call>\n{"name": "get_time", "arguments": {"tz":'
    assert tool_grammar(parse_tools({"tools": [WEATHER]})) is None  # auto: not constrained
