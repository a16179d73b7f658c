"""The tool-call parser and the tools / tool_choice checks on their own (no model): Hermes /
Qwen2.5 `<tool_call>` blocks read whole and streamed a character at a time give the same
content and calls. Then the chat templates on the default model's tokenizer: the shipped
`hermes` template stands in for a ChatML model's own when tools come, rendering exactly what the
reference Qwen2.5 template (data/hermes_tools.jinja) does; a template given to the server, or one
that renders otherwise, gets no stand-in (a 400); `--chat-template` takes a name or a file."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.entrypoints.schema_check import SchemaError, _check, validate
from tokenmill.entrypoints.openai.args import add_server_args
from tokenmill.entrypoints.openai.chat import ChatTemplate
from tokenmill.entrypoints.openai.protocol import ChatMessage, RequestFieldError
from tokenmill.entrypoints.openai.templates import TEMPLATES_DIR, read_template
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


# -- chat templates -----------------------------------------------------------------------------------

REFERENCE = (Path(__file__).parent / "data" / "hermes_tools.jinja").read_text()
CONVERSATIONS = {
    "one-question": [{"role": "user", "content": "Weather in Paris?"}],
    "system-prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}],
    "tool-results": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"celsius": 21}'},
        {"role": "tool", "tool_call_id": "c2", "content": '{"celsius": 25}'},
        {"role": "assistant", "content": "Paris 21, Rome 25."},
        {"role": "user", "content": "And Berlin?"}],
}


def _messages(conversation: list[dict]) -> list[ChatMessage]:
    return [ChatMessage(**m) for m in conversation]


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("tool_choice", [None, "auto", "none", "required",
                                         {"type": "function", "function": {"name": "get_time"}}],
                         ids=["no-tools", "auto", "none", "required", "named"])
def test_shipped_template_stands_in_for_the_default_models_own(test_tokenizer, name, tool_choice):
    own = ChatTemplate(test_tokenizer, None, "smollm2-135m")
    assert not own.supports_tools and own.tools_template == read_template("hermes")
    reference = ChatTemplate(test_tokenizer, REFERENCE, "smollm2-135m")  # SmolLM2's system prompt written in
    by_name = ChatTemplate(test_tokenizer, read_template("hermes"), "smollm2-135m")  # --chat-template hermes
    messages = _messages(CONVERSATIONS[name])
    choice = None if tool_choice is None else check_tools([WEATHER, TIME], tool_choice)
    prompt = reference.render(messages, choice)
    assert own.render(messages, choice) == prompt and by_name.render(messages, choice) == prompt
    if choice is not None and choice.mode != "none":
        assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
    if name != "tool-results" and (choice is None or choice.mode == "none"):  # the model's own template, as it is
        assert prompt == test_tokenizer.apply_chat_template(CONVERSATIONS[name], tokenize=False,
                                                            add_generation_prompt=True)


def test_the_stand_in_is_logged_once(test_tokenizer, caplog):
    with caplog.at_level(logging.INFO, logger="tokenmill.entrypoints.openai.chat"):
        ChatTemplate(test_tokenizer, None, "smollm2-135m")
        ChatTemplate(test_tokenizer, REFERENCE, "smollm2-135m")
    (record,) = caplog.records
    assert "smollm2-135m's chat template ignores tools" in record.getMessage() and "'hermes'" in record.getMessage()


BOS_CHATML = "{{ bos_token }}" + "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
PLAIN = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"


@pytest.mark.parametrize("given, own", [
    ("own", None),  # the model's own template, given to the server: used as it is
    (None, PLAIN),  # not ChatML
    (None, BOS_CHATML),  # ChatML after a BOS token the shipped template does not write
], ids=["given", "plain", "bos-chatml"])
def test_without_a_stand_in_tools_are_a_400(test_tokenizer, caplog, given, own):
    tokenizer = SimpleNamespace(chat_template=own or test_tokenizer.chat_template,
                                apply_chat_template=test_tokenizer.apply_chat_template)
    with caplog.at_level(logging.INFO, logger="tokenmill.entrypoints.openai.chat"):
        template = ChatTemplate(tokenizer, test_tokenizer.chat_template if given else None, "m")
    assert template.tools_template is None and not caplog.records
    with pytest.raises(RequestFieldError) as e:
        template.render(_messages(CONVERSATIONS["one-question"]), check_tools([WEATHER], "auto"))
    assert e.value.field == "tools" and "--chat-template" in str(e.value) and "hermes" in str(e.value)
    with pytest.raises(RequestFieldError) as e:
        template.render(_messages(CONVERSATIONS["tool-results"]))
    assert e.value.field == "messages.1"
    assert template.render(_messages(CONVERSATIONS["one-question"]), check_tools([WEATHER], "none"))


def test_chat_template_flag_takes_a_shipped_name_or_a_file(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    assert parser.parse_args(["--chat-template", "hermes"]).chat_template == str(TEMPLATES_DIR / "hermes.jinja")
    mine = tmp_path / "mine.jinja"
    mine.write_text(PLAIN)
    assert parser.parse_args(["--chat-template", str(mine)]).chat_template == str(mine)
    with pytest.raises(SystemExit):
        parser.parse_args(["--chat-template", "hermes2"])
    assert "no file 'hermes2', and not a shipped template (hermes)" in capsys.readouterr().err
