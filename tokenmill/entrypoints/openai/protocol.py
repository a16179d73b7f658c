"""Request and response bodies of the OpenAI-compatible API (pydantic).

Requests are validated strictly: a wrong JSON type is a 400 naming the field, not a silent
coercion ("0.5" is not a temperature). Ranges are checked once, by `SamplingParams`, so the
HTTP layer and the Python API agree on what is allowed.

No field is silently ignored. Every field a request model declares is acted on, or is one of
`IGNORED_FIELDS` (harmless to ignore: it changes nothing about the answer, and the README lists
it). Any other field is a 400 naming it (`check_request`), with the reason for the OpenAI and
vLLM fields tokenmill knows and does not implement (`REFUSED_FIELDS`). A field sent as null is
a field not sent.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from tokenmill.sampling_params import MAX_ABS_FREQUENCY_PRESENCE_PENALTY, MAX_ABS_LOGIT_BIAS, MAX_LOGPROBS

# Stop strings per request: each is checked against every new token's text.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LENGTH = 1024
# Samples per request (`n`): each is a sequence in the batch, so this bounds what one request
# can take from everyone else; so does the bound on prompts x n of a completions request.
MAX_N = 64
MAX_SEQUENCES_PER_REQUEST = 256

Number = StrictFloat | StrictInt


def _documented(default: Any = None, **schema: Any) -> Any:
    """A field whose OpenAPI schema states what the server accepts (ranges, lengths) beyond its
    JSON type. Documentation only: the values are checked once, by `SamplingParams` and the
    handlers, whose 400s name the field; the schema lets clients and API fuzzers know them."""
    return Field(default, json_schema_extra=schema)


class RequestFieldError(ValueError):
    """A request field tokenmill refuses; `field` names it as OpenAI's `param` ("messages.0.content")."""

    def __init__(self, field: str | None, message: str):
        super().__init__(message)
        self.field = field


class _Body(BaseModel):
    # Extra fields are kept so that `check_request` can name them in its 400; the schema says
    # what that 400 means: no field beyond the declared ones.
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra={"additionalProperties": False})


class StreamOptions(_Body):
    include_usage: StrictBool = False
    include_obfuscation: StrictBool | None = None  # ignored: nothing is obfuscated


class _SamplingFields(_Body):
    """What completions and chat completions share."""

    model: StrictStr | None = None
    max_tokens: StrictInt | None = _documented(minimum=1)
    temperature: Number | None = _documented(minimum=0)
    top_p: Number | None = _documented(exclusiveMinimum=0, maximum=1)
    n: StrictInt = _documented(1, minimum=1, maximum=MAX_N)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOP_STRINGS)] | None = _documented(
        minLength=1, maxLength=MAX_STOP_STRING_LENGTH, items={"minLength": 1, "maxLength": MAX_STOP_STRING_LENGTH})
    seed: StrictInt | None = None
    frequency_penalty: Number | None = _documented(minimum=-MAX_ABS_FREQUENCY_PRESENCE_PENALTY,
                                                   maximum=MAX_ABS_FREQUENCY_PRESENCE_PENALTY)
    presence_penalty: Number | None = _documented(minimum=-MAX_ABS_FREQUENCY_PRESENCE_PENALTY,
                                                  maximum=MAX_ABS_FREQUENCY_PRESENCE_PENALTY)
    # token id (a decimal string, below the vocabulary size) -> bias
    logit_bias: dict[StrictStr, Number] | None = _documented(
        propertyNames={"pattern": "^(0|[1-9][0-9]*)$"},
        additionalProperties={"minimum": -MAX_ABS_LOGIT_BIAS, "maximum": MAX_ABS_LOGIT_BIAS})
    user: StrictStr | None = None  # ignored: an end-user id for the caller's own abuse tracking
    # Structured output (response_format on completions and guided_* as in vLLM); one at most
    response_format: dict[str, Any] | None = _documented(
        required=["type"], properties={"type": {"enum": ["text", "json_object"]}}, additionalProperties=False)
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = _documented(minItems=1, items={"minLength": 1})
    guided_grammar: StrictStr | None = None
    guided_decoding_backend: StrictStr | None = None  # ignored: there is one grammar engine
    # Extensions (as in vLLM): sent by the openai client through `extra_body`.
    top_k: StrictInt | None = _documented(minimum=-1)
    min_p: Number | None = _documented(minimum=0, maximum=1)
    repetition_penalty: Number | None = _documented(exclusiveMinimum=0)
    min_tokens: StrictInt = _documented(0, minimum=0)  # at most max_tokens
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = _documented(items={"minimum": 0})
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False


_TOKEN_ID = {"type": "integer", "minimum": 0}


class CompletionRequest(_SamplingFields):
    # text, texts, token ids or lists of token ids; never empty; at most MAX_SEQUENCES_PER_REQUEST / n prompts
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]] = Field(
        json_schema_extra={"anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "minItems": 1, "maxItems": MAX_SEQUENCES_PER_REQUEST,
             "items": {"type": "string", "minLength": 1}},
            {"type": "array", "minItems": 1, "items": _TOKEN_ID},
            {"type": "array", "minItems": 1, "maxItems": MAX_SEQUENCES_PER_REQUEST,
             "items": {"type": "array", "minItems": 1, "items": _TOKEN_ID}},
        ]})
    max_tokens: StrictInt | None = _documented(16, minimum=0)  # 0 only with echo
    logprobs: StrictInt | None = _documented(minimum=0, maximum=MAX_LOGPROBS)
    echo: StrictBool = False
    suffix: StrictStr | None = _documented(maxLength=0)  # refused unless empty
    best_of: StrictInt | None = None  # refused unless equal to n


_TEXT_PART = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[dict[str, Any]] | None = _documented(items=_TEXT_PART)  # text parts only
    name: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant turns that called tools
    tool_call_id: StrictStr | None = None  # tool turns: the call they answer


_TOOL = {"type": "object", "required": ["type", "function"], "additionalProperties": False, "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": {"type": "string"},
        "parameters": {"type": "object"}, "strict": {"type": "boolean"}}}}}


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = _documented(minimum=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = _documented(minimum=0, maximum=MAX_LOGPROBS)  # with logprobs true
    tools: list[dict[str, Any]] | None = _documented(minItems=1, items=_TOOL)  # where the chat template supports them
    tool_choice: StrictStr | dict[str, Any] | None = _documented(anyOf=[  # with tools
        {"enum": ["none", "auto", "required"]},
        {"type": "object", "required": ["type", "function"], "additionalProperties": False, "properties": {
            "type": {"const": "function"}, "function": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string"}}}}},
        {"type": "null"}])
    parallel_tool_calls: StrictBool | None = None  # with tools
    modalities: list[StrictStr] | None = _documented(minItems=1, maxItems=1, items={"const": "text"})  # only ["text"]
    store: StrictBool | None = _documented(enum=[False, None])  # only false: nothing is stored
    # Ignored: bookkeeping and routing hints that change nothing about the answer.
    metadata: dict[str, StrictStr] | None = None
    service_tier: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None  # prefix caching is automatic
    prompt_cache_retention: StrictStr | None = None
    prompt_cache_options: dict[str, Any] | None = None


class TokenizeRequest(_Body):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: StrictBool = True


class DetokenizeRequest(_Body):
    model: StrictStr | None = None
    tokens: list[StrictInt] = Field(json_schema_extra={"items": _TOKEN_ID})  # below the vocabulary size


# Declared fields tokenmill accepts and does not act on, per request model (the README lists them).
IGNORED_FIELDS = {
    "user", "guided_decoding_backend", "metadata", "service_tier", "safety_identifier", "prompt_cache_key",
    "prompt_cache_retention", "prompt_cache_options", "stream_options.include_obfuscation",
}

# Fields of the OpenAI API (and vLLM's extensions) that tokenmill does not implement: a 400 with
# the reason. Any other undeclared field is a 400 too, as an unknown field.
REFUSED_FIELDS = {
    "audio": "audio output is not supported (text only)",
    "functions": "functions is deprecated and not supported; use tools",
    "function_call": "function_call is deprecated and not supported; use tool_choice",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "reasoning_effort is not supported: the model does not reason",
    "verbosity": "verbosity is not supported",
    "web_search_options": "web search is not supported",
    "moderation": "moderation is not supported",
    "guided_whitespace_pattern": "guided_whitespace_pattern is not supported",
    "use_beam_search": "beam search is not supported",
    "prompt_logprobs": "prompt_logprobs is not supported; use echo with logprobs on /v1/completions",
}


def check_request(body: _Body) -> None:
    """Refuse what the request models cannot: undeclared fields, invalid Unicode in any text
    (a lone surrogate, which JSON's \\ud800 escapes allow and UTF-8 cannot hold), and declared
    fields set to a value tokenmill does not implement. Raises RequestFieldError naming the field."""
    _check_unicode(body, "")
    _check_extra_fields(body, "")
    if isinstance(body, CompletionRequest):
        if body.suffix:
            raise RequestFieldError("suffix", "suffix is not supported by this server (insertion is not implemented)")
        if body.best_of is not None and body.best_of != body.n:
            raise RequestFieldError("best_of", f"best_of is not supported by this server unless equal to n ({body.n}); use n")
    if isinstance(body, _SamplingFields) and body.stream_options is not None and not body.stream:
        raise RequestFieldError("stream_options", "stream_options is only allowed when stream is true")
    if isinstance(body, ChatCompletionRequest):
        if body.modalities is not None and body.modalities != ["text"]:
            raise RequestFieldError("modalities", f"modalities must be [\"text\"], got {body.modalities}")
        if body.store:
            raise RequestFieldError("store", "store is not supported: this server stores no completions")


def _check_extra_fields(model: BaseModel, prefix: str) -> None:
    for name, value in (model.model_extra or {}).items():
        if value is None:
            continue
        field = prefix + name
        reason = REFUSED_FIELDS.get(name) if not prefix else None
        raise RequestFieldError(field, reason or f"unknown field {field!r}: this server does not support it")
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            _check_extra_fields(value, f"{prefix}{name}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    _check_extra_fields(item, f"{prefix}{name}.{i}.")


def _check_unicode(value, field: str) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestFieldError(
                field or None,
                f"{field or 'request body'}: invalid Unicode at character {e.start} "
                f"({value[e.start]!a}, a lone surrogate): text must be valid UTF-8",
            ) from None
    elif isinstance(value, BaseModel):
        for name in [*type(value).model_fields, *(value.model_extra or {})]:
            _check_unicode(name, field)
            _check_unicode(getattr(value, name), _join(field, name))
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key, field)
            _check_unicode(item, _join(field, str(key)))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_unicode(item, _join(field, str(i)))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


# -- responses are plain dicts; these name and date them -------------------------------------------


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
