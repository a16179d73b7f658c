"""The tool-call parser and the tools / tool_choice checks on their own (no model): Hermes /
Qwen2.5 `<tool_call>` blocks read whole and streamed a character at a time give the same
content and calls."""

from __future__ import annotations

import json

import pytest

from tests.entrypoints.schema_check import SchemaError, _check, validate
from tokenmill.entrypoints.openai.tool_calls import (
    ToolCallParser,
    ToolError,
    check_tools,
    forced_call_schema,
    parse_tool_calls,
    template_tool_calls,
    tools_in_template,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}

CASES = {
    "one-call": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                 None, [("get_weather", {"city": "Paris"})]),
    "text-then-two-calls": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
                            "Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    "no-call": ("The weather is <b>fine</b> and 3 < 4.\n", "The weather is <b>fine</b> and 3 < 4.\n", []),
    "ends-in-partial-tag": ("a <tool", "a <tool", []),
    "invalid-json-stays-text": ("<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    "not-a-call-object": ('<tool_call>["x"]</tool_call>', '<tool_call>["x"]</tool_call>', []),
    "unterminated-valid": ('<tool_call>\n{"name": "get_time", "arguments": {}}\n', None, [("get_time", {})]),
    "unterminated-invalid": ('<tool_call>\n{"name": "get_ti', '<tool_call>\n{"name": "get_ti', []),
    "unicode-arguments": ('<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>',
                          None, [("get_weather", {"city": "Zürich"})]),
}


@pytest.mark.parametrize("text, content, calls", list(CASES.values()), ids=list(CASES))
def test_parse_whole_and_streamed(text, content, calls):
    got_content, got_calls = parse_tool_calls(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert all(c.id.startswith("call_") for c in got_calls) and len({c.id for c in got_calls}) == len(got_calls)

    parser = ToolCallParser()  # a character at a time, as a stream may split it
    pieces, streamed = [], []
    for ch in text:
        piece, new = parser.feed(ch)
        pieces.append(piece)
        streamed += new
    piece, new = parser.finish()
    pieces.append(piece)
    streamed += new
    assert ("".join(pieces) or None if calls else "".join(pieces)) == content
    assert [(c.name, json.loads(c.arguments)) for c in streamed] == calls


def test_stream_releases_content_before_the_end():
    parser = ToolCallParser()
    assert parser.feed("Hello wor") == ("Hello wor", [])
    assert parser.feed("ld <tool") == ("ld", [])  # " <tool" may open a call
    assert parser.feed("box>") == (" <toolbox>", [])


@pytest.mark.parametrize("tools, choice, field", [
    ([], None, "tools"),
    ([{"type": "retrieval"}], None, "tools.0.type"),
    ([{"type": "function", "function": {"name": "has space"}}], None, "tools.0.function.name"),
    ([WEATHER, WEATHER], None, "tools.1.function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "strict": True, "examples": []}}], None, "tools.0"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, "tool_choice"),
    ([WEATHER], {"type": "function"}, "tool_choice"),
    ([WEATHER], {"type": "function", "function": "get_weather"}, "tool_choice"),
    ([WEATHER], {"type": "function", "function": [None, None]}, "tool_choice"),
])
def test_bad_tools_name_the_field(tools, choice, field):
    with pytest.raises(ToolError) as e:
        check_tools(tools, choice)
    assert e.value.field == field


def test_tool_choice_modes():
    assert check_tools(None, None) is None
    assert check_tools([WEATHER, TIME], None).mode == "auto"
    assert check_tools([WEATHER, TIME], "none").mode == "none"
    required = check_tools([WEATHER, TIME], "required")
    assert (required.mode, required.names) == ("forced", ["get_weather", "get_time"])
    named = check_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert (named.mode, named.names) == ("forced", ["get_time"])


def test_forced_call_schema_admits_exactly_the_allowed_calls():
    schema = forced_call_schema(check_tools([WEATHER, TIME], "required"))
    validate({"name": "get_weather", "arguments": {"city": "Paris"}}, schema)
    validate({"name": "get_time", "arguments": {}}, schema)
    for bad in ({"name": "get_weather", "arguments": {}}, {"name": "other", "arguments": {}}, {"name": "get_time"}):
        with pytest.raises(SchemaError):
            validate(bad, schema)
    named = forced_call_schema(check_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}))
    with pytest.raises(SchemaError):
        validate({"name": "get_time", "arguments": {}}, named)


def test_schema_check_without_jsonschema():
    """The subset validator the tests fall back on where jsonschema is not installed."""
    schema = forced_call_schema(check_tools([WEATHER, TIME], "required"))
    _check({"name": "get_weather", "arguments": {"city": "Paris"}}, schema, "$")
    for bad in ({"name": "get_weather", "arguments": {}}, {"name": "other", "arguments": {}}, {"name": "get_time"},
                {"name": "get_time", "arguments": {}, "extra": 1}, {"name": "get_weather", "arguments": {"city": 5}}):
        with pytest.raises(SchemaError):
            _check(bad, schema, "$")
    with pytest.raises(SchemaError):
        _check({"c": "x" * 13}, {"type": "object", "properties": {"c": {"type": "string", "maxLength": 12}}}, "$")
    with pytest.raises(SchemaError):
        _check({"c": "teal"}, {"type": "object", "properties": {"c": {"enum": ["red"]}}}, "$")


def test_template_tool_calls_parse_arguments():
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]
    assert template_tool_calls(2, calls) == [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]
    with pytest.raises(ToolError) as e:
        template_tool_calls(2, [{"type": "function", "function": {"name": "f", "arguments": "{oops"}}])
    assert e.value.field == "messages.2.tool_calls.0.function.arguments"


def test_tools_in_template():
    assert tools_in_template("{% if tools %}{{ tools | tojson }}{% endif %}{{ messages }}")
    assert not tools_in_template("{% for m in messages %}{{ m.content }}{% endfor %}")
