"""Tool calling through the `openai` client against a real `tokenmill serve` of the default
model with no `--chat-template`: its own template ignores tools, so requests with tools are
rendered with the shipped Hermes-style template (templates/hermes.jinja, Qwen2.5's; the prompts
equal those of the reference data/hermes_tools.jinja, test_tool_calls.py). Tools reach the
prompt, the model's `<tool_call>` blocks come back as `message.tool_calls` (streamed as deltas the
client assembles), and tool results are fed back through the template. `--chat-template hermes`
selects the same template by name for every request."""

from __future__ import annotations

import json

import openai
import pytest

from tests.entrypoints.schema_check import validate
from tests.serving import BASE_FLAGS, MODEL, ServerProcess

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def _called(city: str, i: int) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]}


# Earlier turns in which the assistant called the tool: the 135M model, not trained on tools,
# follows them (greedy, fp32) and calls it for the new question too.
FEW_SHOT = [{"role": "user", "content": "Weather in Paris?"}, _called("Paris", 1),
            {"role": "user", "content": "Weather in Rome?"}, _called("Rome", 2),
            {"role": "user", "content": "Weather in Berlin?"}, _called("Berlin", 3),
            {"role": "user", "content": "Weather in London?"}]


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def hermes_server(default_model_path, tmp_path_factory):
    proc = ServerProcess(MODEL, *BASE_FLAGS, "--chat-template", "hermes",
                         log_path=tmp_path_factory.mktemp("hermes_server") / "server.log")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def prompt_of(client, messages: list[dict]) -> str:
    """The prompt the server builds for messages (/tokenize renders as chat requests do)."""
    tokens = client.post("/../tokenize", body={"messages": messages}, cast_to=object)["tokens"]
    return client.post("/../detokenize", body={"tokens": tokens}, cast_to=object)["prompt"]


def test_auto_tool_call_whole_and_streamed(client):
    r = client.chat.completions.create(model=MODEL, messages=FEW_SHOT, tools=[WEATHER], max_tokens=40, temperature=0)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "London"}

    with client.chat.completions.stream(model=MODEL, messages=FEW_SHOT, tools=[WEATHER], max_tokens=40,
                                        temperature=0) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls" and not streamed.message.content
    (scall,) = streamed.message.tool_calls
    assert (scall.function.name, scall.function.arguments) == (call.function.name, call.function.arguments)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_tool_call_is_always_valid(client, tool_choice):
    """required / a named function: the grammar engine makes every sample one valid call, even
    sampled at temperature 1 from a model never trained on tools."""
    messages = [{"role": "user", "content": "What time is it in Paris, and is it raining there?"}]
    kwargs = dict(model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=60,
                  temperature=1.0, seed=11)
    r = client.chat.completions.create(n=3, **kwargs)
    with client.chat.completions.stream(**kwargs) as stream:
        streamed = stream.get_final_completion().choices
    for choice in [*r.choices, *streamed]:
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        if isinstance(tool_choice, dict):
            assert call.function.name == "get_time"
        validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_choice_none_and_no_parallel_calls(client):
    r = client.chat.completions.create(model=MODEL, messages=FEW_SHOT, tools=[WEATHER], tool_choice="none",
                                       max_tokens=40, temperature=0)
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason in ("stop", "length")
    # the same conversation asking for two cities: with parallel_tool_calls false, at most one call
    two = [*FEW_SHOT[:-1], {"role": "user", "content": "Weather in London and in Madrid?"}]
    r = client.chat.completions.create(model=MODEL, messages=two, tools=[WEATHER], parallel_tool_calls=False,
                                       max_tokens=80, temperature=0)
    assert len(r.choices[0].message.tool_calls or []) <= 1


def test_tool_results_are_fed_back_through_the_template(client):
    conversation = [*FEW_SHOT[:2], {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'}]
    r = client.chat.completions.create(model=MODEL, messages=conversation, tools=[WEATHER], max_tokens=16,
                                       temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    prompt = prompt_of(client, conversation)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert '<|im_start|>user\n<tool_response>\n{"celsius": 21}\n</tool_response><|im_end|>' in prompt


def test_assistant_message_from_a_response_can_be_sent_back(client):
    r = client.chat.completions.create(model=MODEL, messages=FEW_SHOT, tools=[WEATHER], max_tokens=40, temperature=0)
    message = r.choices[0].message
    call = message.tool_calls[0]
    follow = [*FEW_SHOT, message, {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 14}'}]
    r2 = client.chat.completions.create(model=MODEL, messages=follow, tools=[WEATHER], max_tokens=8, temperature=0)
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("messages, field", [
    ([{"role": "user", "content": "Hi", "tool_calls": []}], "messages.0.tool_calls"),
    ([{"role": "user", "content": "Hi", "tool_call_id": "x"}], "messages.0.tool_call_id"),
    ([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}],
     "messages.0.tool_calls.0.function.arguments"),
])
def test_bad_tool_messages_are_a_400(client, messages, field):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=1)
    assert e.value.body["param"] == field


def test_the_server_says_once_that_tools_use_the_shipped_template(client, server):
    lines = [line for line in server.log().splitlines() if "ignores tools" in line]
    assert len(lines) == 1 and "'hermes'" in lines[0], lines
    # a conversation without tools: the model's own prompt, its default system prompt included
    assert prompt_of(client, FEW_SHOT[-1:]) == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
                                                "trained by Hugging Face<|im_end|>\n<|im_start|>user\nWeather in "
                                                "London?<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_hermes_by_name(client, hermes_server):
    """`--chat-template hermes`: every conversation through the shipped template, which renders
    the default model's conversations as the fallback above does, tools or not."""
    hermes = openai_client(hermes_server)
    for messages in (FEW_SHOT, FEW_SHOT[-1:], [{"role": "system", "content": "Be brief."}, *FEW_SHOT[-1:]]):
        assert prompt_of(hermes, messages) == prompt_of(client, messages)
    r = hermes.chat.completions.create(model=MODEL, messages=FEW_SHOT[-1:], tools=[WEATHER, TIME],
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       max_tokens=40, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    validate(json.loads(call.function.arguments), SCHEMAS["get_time"])
    assert "ignores tools" not in hermes_server.log()  # the template was given: no stand-in
