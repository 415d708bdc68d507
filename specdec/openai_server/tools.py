"""Tool calls on ``/v1/chat/completions``: ``tools`` + ``tool_choice`` checked, the tools put in the prompt, the
grammar a required call is constrained by, and the output parsed into OpenAI ``tool_calls`` (whole or streamed).

The generic format (models whose chat template does not render tools, SmolLM2's among them) is the Hermes/Qwen
one: the tool definitions go into the system message inside ``<tools></tools>``, one JSON object a line; a call
is emitted as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; a ``tool`` role message goes back
to the model as a user turn ``<tool_response>\\n...\\n</tool_response>``; an assistant message with ``tool_calls``
is rendered as the calls in that format. ``tool_choice``:

- ``"none"``: the tools are left out of the prompt, nothing is parsed: a plain answer.
- ``"auto"`` (the default with tools): the model chooses; ``<tool_call>`` blocks in its answer that parse become
  ``tool_calls`` (``finish_reason: "tool_calls"``), the rest stays content. Not constrained.
- ``"required"`` / ``{"type": "function", "function": {"name": ...}}``: constrained by :func:`tool_grammar`: the
  answer is one call (``parallel_tool_calls: false``) or one or more calls (true, OpenAI's default), each of a
  tool allowed, its ``arguments`` matching the tool's ``parameters`` schema. Cut off by the max tokens, such an
  answer has ``finish_reason: "length"``, content null and no half call (:func:`.structured.chat_message`).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from specdec_runtime.common.grammar import GrammarSpec

from .errors import ApiError

__all__ = ["ToolRequest", "parse_tools", "tool_messages", "tool_grammar", "parse_tool_calls", "ToolCallStreamer",
           "CALL_OPEN", "CALL_CLOSE"]

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
_SYSTEM = (
    "You are a function calling AI model. You may call one or more functions to assist with the user query. "
    "Don't make assumptions about what values to plug into functions. Here are the available tools: <tools>\n"
    "{tools}\n</tools>\nFor each function call return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-dict>}}\n"
    "</tool_call>"
)


@dataclass
class ToolRequest:
    """The checked ``tools``/``tool_choice``/``parallel_tool_calls`` of one request.

    ``choice``: "none" | "auto" | "required" | "function"; ``name``: the function named by ``tool_choice``
    (choice "function"); ``tools``: [{"name", "description", "parameters"}] in request order.
    """

    tools: list[dict] = field(default_factory=list)
    choice: str = "none"
    name: str | None = None
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "function")

    @property
    def in_prompt(self) -> bool:
        return bool(self.tools) and self.choice != "none"


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param)


def _parse_tool(i: int, tool) -> dict:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise _bad(f"tools[{i}] must be an object of type 'function'", "tools")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise _bad(f"tools[{i}].function must be an object", "tools")
    name = fn.get("name")
    if not isinstance(name, str) or not name or len(name) > 64 or not all(c.isalnum() or c in "_-" for c in name):
        raise _bad(f"tools[{i}].function.name must be 1-64 characters of a-z, A-Z, 0-9, '_' and '-'", "tools")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise _bad(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    desc = fn.get("description", "")
    if not isinstance(desc, str):
        raise _bad(f"tools[{i}].function.description must be a string", "tools")
    return {"name": name, "description": desc, "parameters": params}


def parse_tools(body: dict) -> ToolRequest:
    """The tool part of a chat request body.

    Raises:
        ApiError(400): malformed ``tools``, duplicate names, a ``tool_choice`` that is not none/auto/required or a
            function of ``tools``, ``tool_choice`` other than none without tools, a non-boolean
            ``parallel_tool_calls``.
    """
    raw = body.get("tools") or []
    if not isinstance(raw, list):
        raise _bad("'tools' must be a list", "tools")
    tools = [_parse_tool(i, t) for i, t in enumerate(raw)]
    names = [t["name"] for t in tools]
    if len(set(names)) != len(names):
        raise _bad("tools: function names must be unique", "tools")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise _bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise _bad(f"tool_choice names a function not in 'tools': {name!r}", "tool_choice")
        return ToolRequest(tools, "function", name, parallel)
    if choice not in ("none", "auto", "required"):
        raise _bad("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                   "{'name': ...}}", "tool_choice")
    if choice != "none" and not tools:
        raise _bad(f"tool_choice {choice!r} needs 'tools'", "tool_choice")
    return ToolRequest(tools, choice, None, parallel)


def _call_text(call: dict, i: int) -> str:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise _bad(f"tool_calls[{i}] must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}",
                   "messages")
    args = fn.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        raise _bad(f"tool_calls[{i}].function.arguments is not valid JSON", "messages") from None
    return f"{CALL_OPEN}\n{json.dumps({'name': fn['name'], 'arguments': args}, ensure_ascii=False)}\n{CALL_CLOSE}"


def tool_messages(messages: list, req: ToolRequest) -> list:
    """OpenAI messages with tools → messages of system/user/assistant/developer roles in the generic format
    (the tools in the system message, calls and tool results as text), for the ordinary chat-template path.

    Messages without tool fields pass through unchanged. Raises ApiError(400): a malformed ``tool_calls`` entry or
    ``tool`` message."""
    out: list = []
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        if not isinstance(m, dict):
            out.append(m)
            continue
        if m.get("role") == "tool":
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            if not isinstance(content, str):
                raise _bad(f"messages[{i}].content of a tool message must be a string", "messages")
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        elif m.get("role") == "assistant" and m.get("tool_calls"):
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                raise _bad(f"messages[{i}].tool_calls must be a list", "messages")
            text = "\n".join(_call_text(c, j) for j, c in enumerate(calls))
            prefix = m.get("content") or ""
            out.append({"role": "assistant", "content": f"{prefix}\n{text}" if prefix else text})
        else:
            out.append(m)
    if req.in_prompt:
        system = _SYSTEM.format(tools="\n".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False)
                                                for t in req.tools))
        if out and isinstance(out[0], dict) and out[0].get("role") in ("system", "developer") \
                and isinstance(out[0].get("content"), str):
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _call_schema(tool: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": tool["name"]}, "arguments": tool["parameters"]},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_grammar(req: ToolRequest) -> GrammarSpec | None:
    """The grammar of a required call (None when the choice does not constrain): Lark with llguidance's ``%json``,
    ``<tool_call>\\n{"name": <a tool>, "arguments": <its parameters>}\\n</tool_call>``, one or (parallel) more,
    newline-separated."""
    if not req.constrained:
        return None
    tools = [t for t in req.tools if req.choice != "function" or t["name"] == req.name]
    schema = _call_schema(tools[0]) if len(tools) == 1 else {"anyOf": [_call_schema(t) for t in tools]}
    schema["x-guidance"] = _JSON_LAYOUT
    repeat = ' ("\\n" call)*' if req.parallel else ""
    lark = (f"start: call{repeat}\n"
            f'call: "{CALL_OPEN}\\n" body "\\n{CALL_CLOSE}"\n'
            f"body: %json {json.dumps(schema)}\n")
    return GrammarSpec("grammar", lark)


def _new_id() -> str:
    return "call_" + secrets.token_hex(12)


def _openai_call(obj) -> dict | None:
    """``{"name", "arguments"}`` → an OpenAI tool call, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {"id": _new_id(), "type": "function", "function": {"name": obj["name"], "arguments": args_text}}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """Split an answer into content and OpenAI ``tool_calls``.

    Returns ``(content, calls)``: content is the text outside the call blocks (stripped; None when empty and there
    are calls), calls are the ``<tool_call>`` blocks whose JSON is a call. A block that does not parse is left in
    the content, as the model wrote it.
    """
    calls, content, pos = [], [], 0
    while True:
        at = text.find(CALL_OPEN, pos)
        end = text.find(CALL_CLOSE, at + len(CALL_OPEN)) if at >= 0 else -1
        if at < 0 or end < 0:
            content.append(text[pos:])
            break
        try:
            call = _openai_call(json.loads(text[at + len(CALL_OPEN):end]))
        except json.JSONDecodeError:
            call = None
        if call is None:
            content.append(text[pos:end + len(CALL_CLOSE)])
        else:
            content.append(text[pos:at])
            calls.append(call)
        pos = end + len(CALL_CLOSE)
    rest = "".join(content)
    if calls:
        rest = rest.strip()
        return (rest or None), calls
    return text, calls


class ToolCallStreamer:
    """Streamed deltas of an answer with tool calls (OpenAI's chunk format).

    :meth:`feed` takes the answer's text chunks and returns deltas: ``{"content": ...}`` for text outside call
    blocks (a possible start of ``<tool_call>`` is held back until it is decided), and for each call that closed
    two deltas ``{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments": ""}}]}`` then
    ``{"tool_calls": [{"index", "function": {"arguments": ...}}]}``. :meth:`finish` flushes what is held back.
    ``num_calls`` > 0 means the finish_reason is "tool_calls".
    """

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self.num_calls = 0

    def _content(self, text: str) -> list[dict]:
        return [{"content": text}] if text else []

    def _call_deltas(self, body: str) -> list[dict]:
        try:
            call = _openai_call(json.loads(body))
        except json.JSONDecodeError:
            call = None
        if call is None:  # not a call: the model's text, as written
            return self._content(f"{CALL_OPEN}{body}{CALL_CLOSE}")
        i = self.num_calls
        self.num_calls += 1
        fn = call["function"]
        return [{"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                 "function": {"name": fn["name"], "arguments": ""}}]},
                {"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]}]

    def feed(self, text: str) -> list[dict]:
        self._buf += text
        out: list[dict] = []
        while True:
            if self._in_call:
                end = self._buf.find(CALL_CLOSE)
                if end < 0:
                    return out
                out += self._call_deltas(self._buf[:end])
                self._buf, self._in_call = self._buf[end + len(CALL_CLOSE):], False
                continue
            at = self._buf.find(CALL_OPEN)
            if at >= 0:
                out += self._content(self._buf[:at] if not self.num_calls else self._buf[:at].strip())
                self._buf, self._in_call = self._buf[at + len(CALL_OPEN):], True
                continue
            keep = next((k for k in range(min(len(CALL_OPEN) - 1, len(self._buf)), 0, -1)
                         if CALL_OPEN.startswith(self._buf[-k:])), 0)
            emit, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
            if self.num_calls:
                emit = emit.strip()  # the newline between parallel calls is not content
            out += self._content(emit)
            return out

    def finish(self) -> list[dict]:
        """Deltas of what is held back at the end (an unclosed call block is the model's text)."""
        rest = (CALL_OPEN if self._in_call else "") + self._buf
        self._buf, self._in_call = "", False
        return self._content(rest.strip() if self.num_calls else rest)
