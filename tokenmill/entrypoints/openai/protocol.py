"""Request and response bodies of the OpenAI-compatible API (pydantic).

Requests are validated strictly: a wrong JSON type is a 400 naming the field, not a silent
coercion ("0.5" is not a temperature). Ranges are checked once, by `SamplingParams`, so the
HTTP layer and the Python API agree on what is allowed. Fields the OpenAI API defines but
tokenmill does not implement are rejected by name when set; unknown extra fields are ignored
(clients send vendor extensions freely).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

# Stop strings per request: each is checked against every new token's text.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LENGTH = 1024

Number = StrictFloat | StrictInt


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _SamplingFields(_Body):
    """What completions and chat completions share."""

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: StrictInt | None = None
    frequency_penalty: Number | None = None
    presence_penalty: Number | None = None
    logit_bias: dict[StrictStr, Number] | None = None
    user: StrictStr | None = None
    # Extensions (as in vLLM): sent by the openai client through `extra_body`.
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    min_tokens: StrictInt = 0
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[dict[str, Any]] | None = None
    name: StrictStr | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


class TokenizeRequest(_Body):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: StrictBool = True


class DetokenizeRequest(_Body):
    model: StrictStr | None = None
    tokens: list[StrictInt]


# -- responses are plain dicts; these name and date them -------------------------------------------


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
