"""Structured output on ``/v1/chat/completions``: ``response_format`` (``json_object``, ``json_schema``) and the
grammar a required tool call puts on the answer (:mod:`.tools`), checked on the device before any session opens
(the engine's message as a 400), and the answer turned into an OpenAI message (``tool_calls``, ``finish_reason:
"tool_calls"``), whole or streamed. docs/structured-output.md."""

from __future__ import annotations


from specdec_runtime.common.grammar import GrammarSpec, compile_grammar, grammar_tokenizer

from .errors import ApiError
from .tools import ToolCallStreamer, ToolRequest, parse_tool_calls, parse_tools, tool_grammar, tool_messages

__all__ = ["structured_request", "chat_message", "ChoiceDeltas"]


def response_format_spec(body: dict) -> GrammarSpec | None:
    """The grammar of ``response_format`` (None for none / ``text``).

    ``{"type": "json_object"}``: any JSON object; ``{"type": "json_schema", "json_schema": {"name", "schema",
    "strict"}}``: the schema (``strict`` or not, the output matches it: constrained decoding is always strict).
    Raises ApiError(400, param response_format): another type, a missing or non-object schema."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError(400, "'response_format' must be {'type': 'text' | 'json_object' | 'json_schema', ...}",
                       param="response_format")
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return GrammarSpec("json_object")
    js = rf.get("json_schema")
    schema = js.get("schema") if isinstance(js, dict) else None
    if not isinstance(schema, dict):
        raise ApiError(400, "'response_format.json_schema.schema' must be a JSON schema object",
                       param="response_format")
    return GrammarSpec.json_schema(schema)


def structured_request(body: dict, tokenizer) -> tuple[dict, ToolRequest, list]:
    """The generation options (``{"grammar": spec}`` or none), the tool request and the messages rendered for
    tools (the generic format: :func:`tools.tool_messages`) of a chat body.

    Raises:
        ApiError(400): bad ``response_format``/``tools``/``tool_choice``, both a response format and a required
            tool call, or a grammar the engine refuses (its message; param response_format or tools).
    """
    tools = parse_tools(body)
    spec, param = response_format_spec(body), "response_format"
    tool_spec = tool_grammar(tools)
    if spec is not None and tool_spec is not None:
        raise ApiError(400, "'response_format' and a required tool call (tool_choice) cannot be combined",
                       param="response_format")
    if tool_spec is not None:
        spec, param = tool_spec, "tools"
    if spec is not None:
        eos = getattr(tokenizer, "eos_token_id", None)
        try:
            compile_grammar(spec, grammar_tokenizer(tokenizer, [] if eos is None else [int(eos)]))
        except ValueError as e:
            raise ApiError(400, f"{param}: {e}", param=param, code="invalid_grammar") from None
    messages = tool_messages(body.get("messages"), tools)
    return ({"grammar": spec} if spec is not None else {}), tools, messages


def chat_message(text: str, finish_reason: str, tools: ToolRequest | None) -> tuple[dict, str]:
    """The assistant message of a finished answer and its finish_reason: with tools offered, the call blocks
    become ``tool_calls`` (finish_reason "tool_calls"); ``parallel_tool_calls: false`` keeps the first call.

    A required call (``tool_choice`` "required" or a named function) cut off by the max tokens: finish_reason
    "length", content null, and only the calls that closed before the cut as ``tool_calls`` (none when the first
    was cut). The half call is dropped: it is neither a call (its arguments do not parse) nor an answer (the
    grammar allows nothing but call markup), so neither ``tool_calls`` nor content may carry it; "length" tells
    the client why there is no call, as OpenAI's finish_reason does for any answer cut by the limit."""
    if tools is None or not tools.in_prompt:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = parse_tool_calls(text)
    if tools.constrained and finish_reason == "length":
        message = {"role": "assistant", "content": None}
        calls = calls if tools.parallel else calls[:1]
        return ({**message, "tool_calls": calls} if calls else message), "length"
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    if not tools.parallel:
        calls = calls[:1]
    return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"


class ChoiceDeltas:
    """The streamed deltas of one choice: plain content deltas, or, with tools offered, content and tool-call
    deltas (:class:`tools.ToolCallStreamer`)."""

    def __init__(self, tools: ToolRequest | None) -> None:
        self._streamer = ToolCallStreamer() if tools is not None and tools.in_prompt else None
        self._parallel = tools.parallel if tools is not None else True
        self._constrained = tools is not None and tools.constrained

    def feed(self, text: str) -> list[dict]:
        if self._streamer is None:
            return [{"content": text}]
        return self._keep(self._streamer.feed(text))

    def finish(self, finish_reason: str) -> tuple[list[dict], str]:
        """The held-back deltas and the choice's finish_reason ("tool_calls" when a call was streamed); a required
        call cut off by the max tokens: "length", its held-back half dropped (as :func:`chat_message`)."""
        if self._streamer is None:
            return [], finish_reason
        rest = self._keep(self._streamer.finish())
        if self._constrained and finish_reason == "length":
            return [], "length"
        return rest, ("tool_calls" if self._streamer.num_calls else finish_reason)

    def _keep(self, deltas: list[dict]) -> list[dict]:
        if self._parallel:
            return deltas
        return [d for d in deltas if all(tc["index"] == 0 for tc in d.get("tool_calls", []))]
