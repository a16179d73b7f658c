"""Tool calling over the chat API: checking `tools` / `tool_choice`, and reading the model's tool
calls back out of its text.

The tools reach the model through its own chat template (`tools=`); the model answers in its
trained call format. The parsed format is Hermes / Qwen2.5's: any number of

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

blocks, after optional text. `ToolCallParser` reads them incrementally (streaming) and whole
(the same code: feeding all the text at once), so a stream assembles to the non-streamed answer.

`tool_choice` `required` or a named function is enforced, not hoped for: the prompt ends with
the call's opening tag and the output is constrained (structured output) to the JSON of one call
of an allowed tool, its arguments following the tool's parameter schema (`forced_call_schema`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
# What the prompt ends with when a call is forced: the model's output is then one call's JSON.
FORCED_CALL_PREFIX = TOOL_CALL_START + "\n"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class ToolError(ValueError):
    """A bad `tools` / `tool_choice` / message tool field; `field` names it as OpenAI's `param`."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


# -- the request's side ----------------------------------------------------------------------------------


@dataclass
class ToolChoice:
    """What the request allows: `mode` "none", "auto", or "forced" (required or a named function,
    then `names` is what may be called)."""

    mode: str
    tools: list[dict]  # the OpenAI tool objects, checked
    names: list[str]


def check_tools(tools: list[dict] | None, tool_choice: str | dict | None) -> ToolChoice | None:
    """Validate `tools` and `tool_choice` (OpenAI's shapes); None when the request has no tools."""
    if not tools:
        if tools is not None:
            raise ToolError("tools", "tools must not be empty (leave it out instead)")
        return None
    names: list[str] = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise ToolError(f"tools.{i}.type", f"tools[{i}].type must be \"function\", got {tool.get('type')!r}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ToolError(f"tools.{i}.function", f"tools[{i}].function must be an object")
        unknown = set(tool) - {"type", "function"} or set(function) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise ToolError(f"tools.{i}", f"tools[{i}]: unknown field {sorted(unknown)[0]!r}")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ToolError(f"tools.{i}.function.name",
                            f"tools[{i}].function.name must be 1-64 letters, digits, _ or -, got {name!r}")
        if name in names:
            raise ToolError(f"tools.{i}.function.name", f"tools[{i}].function.name {name!r} is given twice")
        if not isinstance(function.get("parameters", {}), dict):
            raise ToolError(f"tools.{i}.function.parameters", f"tools[{i}].function.parameters must be a JSON schema object")
        if not isinstance(function.get("description", ""), str):
            raise ToolError(f"tools.{i}.function.description", f"tools[{i}].function.description must be a string")
        names.append(name)
    if tool_choice is None or tool_choice == "auto":
        return ToolChoice("auto", tools, names)
    if tool_choice == "none":
        return ToolChoice("none", tools, [])
    if tool_choice == "required":
        return ToolChoice("forced", tools, names)
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function") if tool_choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise ToolError("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                                           '{"type": "function", "function": {"name": ...}}')
        if name not in names:
            raise ToolError("tool_choice", f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})")
        return ToolChoice("forced", tools, [name])
    raise ToolError("tool_choice", f'tool_choice must be "none", "auto", "required" or a named function, got {tool_choice!r}')


def forced_call_schema(choice: ToolChoice) -> dict:
    """The JSON schema of one call of an allowed tool: {"name": that tool, "arguments": its parameters}."""
    options = []
    for tool in choice.tools:
        function = tool["function"]
        if function["name"] not in choice.names:
            continue
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        options.append({
            "type": "object",
            "properties": {"name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    return options[0] if len(options) == 1 else {"anyOf": options}


def template_tool_calls(index: int, tool_calls: list[dict]) -> list[dict]:
    """An assistant message's OpenAI `tool_calls`, as chat templates take them: arguments as an
    object (templates write them with `tojson`), not OpenAI's JSON text."""
    result = []
    for j, call in enumerate(tool_calls):
        where = f"messages.{index}.tool_calls.{j}"
        function = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            raise ToolError(where, f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError as e:
                raise ToolError(f"{where}.function.arguments", f"{where}.function.arguments is not valid JSON: {e}") from None
        result.append({"id": call.get("id"), "type": "function",
                       "function": {"name": function["name"], "arguments": arguments}})
    return result


# -- the model's side ----------------------------------------------------------------------------------


def parse_call(text: str) -> ToolCall | None:
    """One call's JSON ({"name": str, "arguments": object}), or None if it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class ToolCallParser:
    """Splits a model's output into content and tool calls as it arrives.

    `feed(text)` returns the content that is now certain and the calls completed by this text;
    `finish()` the rest. Held back until certain: a tail that may begin a `<tool_call>` tag, and
    trailing whitespace (dropped before a call). A block that is not a valid call stays in the
    content as it was written; an unterminated last block is parsed as a call if it is one.
    `in_call`: the text starts inside a call (its opening tag ended the prompt)."""

    def __init__(self, in_call: bool = False):
        self._buffer = ""
        self._in_call = in_call
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buffer += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._in_call:
                end = self._buffer.find(TOOL_CALL_END)
                if end < 0:
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end + len(TOOL_CALL_END):]
                self._in_call = False
                call = parse_call(body)
                if call is None:
                    content.append(TOOL_CALL_START + body + TOOL_CALL_END)
                else:
                    calls.append(call)
                continue
            start = self._buffer.find(TOOL_CALL_START)
            if start >= 0:
                content.append(self._buffer[:start].rstrip())
                self._buffer = self._buffer[start + len(TOOL_CALL_START):]
                self._in_call = True
                continue
            keep = _tag_prefix_length(self._buffer)
            certain = self._buffer[: len(self._buffer) - keep]
            stripped = certain.rstrip()
            content.append(stripped)
            self._buffer = self._buffer[len(stripped):]
            break
        self.calls.extend(calls)
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._buffer = self._buffer, ""
        if self._in_call:
            self._in_call = False
            call = parse_call(rest)
            if call is not None:
                self.calls.append(call)
                return "", [call]
            return TOOL_CALL_START + rest, []
        return ("" if self.calls else rest), []


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """The whole output's (content, calls); content None when it is empty beside calls."""
    parser = ToolCallParser()
    content, calls = parser.feed(text)
    more, last = parser.finish()
    content += more
    calls += last
    return (content or None) if calls else content, calls


def _tag_prefix_length(text: str) -> int:
    """The length of the longest tail of text that is a proper prefix of the start tag."""
    for n in range(min(len(text), len(TOOL_CALL_START) - 1), 0, -1):
        if TOOL_CALL_START.startswith(text[-n:]):
            return n
    return 0


def tools_in_template(template: str) -> bool:
    """Whether a chat template reads `tools` (one that does not would drop them silently)."""
    import jinja2
    from jinja2 import meta

    return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))

