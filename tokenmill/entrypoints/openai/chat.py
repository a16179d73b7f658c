"""Chat requests to prompt text and model text back to chat messages: the chat template (the
model's own, or the server's `--chat-template`), tools in and tool calls out."""

from __future__ import annotations

import logging
import re

from tokenmill.entrypoints.openai.protocol import ChatMessage, RequestFieldError
from tokenmill.entrypoints.openai.templates import TOOLS_TEMPLATE, read_template
from tokenmill.entrypoints.openai.tool_calls import (
    FORCED_CALL_PREFIX,
    ToolCall,
    ToolCallParser,
    ToolChoice,
    template_tool_calls,
    tools_in_template,
)

logger = logging.getLogger(__name__)

# Conversations the model's own template and the shipped tools template must render alike for
# the latter to stand in for the former (only the model's default system prompt is carried over).
_PROBES = ([{"role": "user", "content": "U"}],
           [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
            {"role": "assistant", "content": "A"}, {"role": "user", "content": "V"}])
_CHATML_DEFAULT_SYSTEM = re.compile(r"<\|im_start\|>system\n(.*)<\|im_end\|>\n"
                                    r"<\|im_start\|>user\nU<\|im_end\|>\n", re.S)


class ChatTemplate:
    """Renders conversations with one template, and with the shipped tools template (`hermes`)
    those that carry tools when the model's own template ignores them but renders conversations as
    that one does. Contract: `render` raises RequestFieldError (a 400 naming the field) for what
    it cannot take, never an internal error.

    Every template is given `default_system_message`: the system prompt the model's own template
    adds to a conversation without one (None where it adds none or is not ChatML)."""

    def __init__(self, tokenizer, template: str | None, model_name: str):
        self.tokenizer = tokenizer
        own = getattr(tokenizer, "chat_template", None)
        self.template = template or own
        self.model_name = model_name
        self.supports_tools = bool(self.template) and tools_in_template(self.template)
        self.default_system_message = _default_system_message(tokenizer, own) if own else None
        # Used for conversations with tools; None: they are a 400. Only in place of the model's own
        # template: one the server was given is used as it is.
        self.tools_template = self.template if self.supports_tools else None
        if template is None and own and not self.supports_tools:
            self.tools_template = self._stand_in(read_template(TOOLS_TEMPLATE))
            if self.tools_template is not None:
                logger.info("%s's chat template ignores tools: requests with tools are rendered with the shipped "
                            "%r template (Hermes-style tool calls)", model_name, TOOLS_TEMPLATE)

    def render(self, messages: list[ChatMessage], tool_choice: ToolChoice | None = None) -> str:
        if not self.template:
            raise RequestFieldError("messages", f"model {self.model_name} has no chat template "
                                                "(serve it with --chat-template NAME|FILE)")
        conversation = [message_dict(i, m) for i, m in enumerate(messages)]
        kwargs = {"default_system_message": self.default_system_message}
        template = self.template
        use_tools = tool_choice is not None and tool_choice.mode != "none"
        if use_tools or any("tool_calls" in m or m["role"] == "tool" for m in conversation):
            if self.tools_template is None:
                field = "tools" if use_tools else next(
                    f"messages.{i}" for i, m in enumerate(conversation) if "tool_calls" in m or m["role"] == "tool")
                raise RequestFieldError(field, "this model's chat template does not support tools: serve it with "
                                               "--chat-template FILE, a template that does (the shipped "
                                               f"{TOOLS_TEMPLATE!r} is one for ChatML models)")
            template = self.tools_template
        if use_tools:
            kwargs["tools"] = tool_choice.tools
        try:
            text = self._apply(conversation, template, **kwargs)
        except Exception as e:  # noqa: BLE001  # a template that refuses the conversation (e.g. role order)
            raise RequestFieldError("messages", f"the chat template rejected the messages: {e}") from None
        if tool_choice is not None and tool_choice.mode == "forced":
            text += FORCED_CALL_PREFIX  # the output is then one call's JSON (constrained)
        return text

    def _apply(self, conversation: list[dict], template: str, **kwargs) -> str:
        return self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True,
                                                  chat_template=template, **kwargs)

    def _stand_in(self, tools_template: str) -> str | None:
        """`tools_template` if it renders the probe conversations as the model's own template does."""
        try:
            same = all(self._apply(probe, tools_template, default_system_message=self.default_system_message)
                       == self._apply(probe, self.template) for probe in _PROBES)
        except Exception:  # noqa: BLE001  # a template that refuses a probe (e.g. no system role)
            return None
        return tools_template if same else None


def _default_system_message(tokenizer, template: str) -> str | None:
    """The system prompt a ChatML template adds to a conversation that has none."""
    try:
        text = tokenizer.apply_chat_template(_PROBES[0], tokenize=False, add_generation_prompt=False,
                                             chat_template=template)
    except Exception:  # noqa: BLE001
        return None
    match = _CHATML_DEFAULT_SYSTEM.fullmatch(text)
    return match.group(1) if match else None


def message_dict(index: int, message: ChatMessage) -> dict:
    """One message as chat templates take it: text content, tool calls with object arguments."""
    content = message.content
    if isinstance(content, list):  # content parts: only text is understood
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                raise RequestFieldError(f"messages.{index}.content", f"messages[{index}].content: only text parts "
                                                                     "({\"type\": \"text\", \"text\": ...}) are supported")
            texts.append(part["text"])
        content = "".join(texts)
    result = {"role": message.role, "content": content or ""}
    if message.name is not None:
        result["name"] = message.name
    if message.tool_calls is not None:
        if message.role != "assistant":
            raise RequestFieldError(f"messages.{index}.tool_calls", f"messages[{index}]: only assistant messages have tool_calls")
        result["tool_calls"] = template_tool_calls(index, message.tool_calls)
    if message.tool_call_id is not None:
        if message.role != "tool":
            raise RequestFieldError(f"messages.{index}.tool_call_id", f"messages[{index}]: only tool messages have a tool_call_id")
        result["tool_call_id"] = message.tool_call_id
    return result


class ChoiceText:
    """One chat choice's text as it streams: plain content, or content and tool calls when the
    request has tools. `feed` gives each step's delta, `finish` the last one and the finish reason."""

    def __init__(self, tool_choice: ToolChoice | None, parallel_tool_calls: bool | None):
        mode = tool_choice.mode if tool_choice is not None else "none"
        self.parser = None if mode == "none" else ToolCallParser(in_call=mode == "forced")
        self.max_calls = 1 if parallel_tool_calls is False or mode == "forced" else None
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> dict:
        if self.parser is None:
            return {"content": text} if text else {}
        return self._delta(*self.parser.feed(text))

    def finish(self, finish_reason: str | None) -> tuple[dict, str | None]:
        if self.parser is None:
            return {}, finish_reason
        delta = self._delta(*self.parser.finish())
        return delta, ("tool_calls" if self.calls and finish_reason == "stop" else finish_reason)

    def _delta(self, content: str, calls: list[ToolCall]) -> dict:
        delta = {"content": content} if content else {}
        room = len(calls) if self.max_calls is None else max(0, self.max_calls - len(self.calls))
        new = [{"index": len(self.calls) + k, **call.to_dict()} for k, call in enumerate(calls[:room])]
        self.calls += calls[:room]
        if new:
            delta["tool_calls"] = new
        return delta


def whole_message(text: str, finish_reason: str | None, tool_choice: ToolChoice | None,
                  parallel_tool_calls: bool | None) -> tuple[dict, str | None]:
    """A finished choice's message (role, content, tool_calls) and its finish reason."""
    choice = ChoiceText(tool_choice, parallel_tool_calls)
    first = choice.feed(text)
    last, finish_reason = choice.finish(finish_reason)
    content = first.get("content", "") + last.get("content", "")
    message = {"role": "assistant", "content": content}
    if choice.calls:
        message["content"] = content or None
        message["tool_calls"] = [call.to_dict() for call in choice.calls]
    return message, finish_reason
