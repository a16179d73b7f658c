"""The official `openai` client against a real `tokenmill serve` process: completions and chat,
streaming and not, n > 1, seeds, stop strings, logprobs, usage, and in-flight batching of 32
concurrent streams giving each request's offline output."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
    "What is 12 times 12?", "Who wrote Hamlet?", "Give me a synonym for happy.",
    "What does a bee make?", "Describe a cat in one sentence.",
]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_served_model(client, model_name):
    assert [m.id for m in client.models.list().data] == [model_name]


def test_completion_usage_matches_the_tokenizer(client, model_name, hf_tokenizer):
    prompt = "The three laws of thermodynamics are"
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    (choice,) = r.choices
    assert choice.finish_reason == "length" and choice.text
    assert r.usage.prompt_tokens == len(hf_tokenizer(prompt)["input_ids"])
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_completion_prompt_forms(client, model_name):
    """A list of prompts gives choices in order; token-id prompts equal their text."""
    prompts = ["One, two, three,", "Roses are red,"]
    r = client.completions.create(model=model_name, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    ids = client.post("/../tokenize", body={"prompt": prompts[1]}, cast_to=object)["tokens"]
    by_ids = client.completions.create(model=model_name, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == r.choices[1].text
    echoed = client.completions.create(model=model_name, prompt=prompts[0], max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == prompts[0] + r.choices[0].text


def test_chat_stream_equals_non_stream(client, model_name, hf_tokenizer):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": QUESTIONS[0]}]
    whole = client.chat.completions.create(model=model_name, messages=messages, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model=model_name, messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    prompt = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert whole.usage.prompt_tokens == len(hf_tokenizer(prompt, add_special_tokens=False)["input_ids"])


def test_n_and_seed(client, model_name):
    kwargs = dict(model=model_name, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=16,
                  temperature=1.0, n=3)
    a = client.chat.completions.create(seed=7, **kwargs)
    b = client.chat.completions.create(seed=7, **kwargs)
    c = client.chat.completions.create(seed=8, **kwargs)
    texts = lambda r: [ch.message.content for ch in sorted(r.choices, key=lambda ch: ch.index)]  # noqa: E731
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert texts(a) == texts(b)
    assert texts(a) != texts(c)
    assert len(set(texts(a))) > 1  # the samples differ from each other
    assert 3 <= a.usage.completion_tokens <= 3 * 16
    streamed = list(client.chat.completions.create(seed=7, stream=True, **kwargs))
    by_index = {i: "" for i in range(3)}
    for chunk in streamed:
        for ch in chunk.choices:
            by_index[ch.index] += ch.delta.content or ""
    assert list(by_index.values()) == texts(a)


def test_stop_string(client, model_name):
    kwargs = dict(model=model_name, prompt="Count: 1, 2, 3, 4, 5,", max_tokens=20, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), full
    r = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert r.finish_reason == "stop"
    assert r.text == full[: full.index(stop)]


def test_logprobs(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": QUESTIONS[4]}],
                                       max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert t.top_logprobs[0].token == t.token  # greedy: the chosen token is the most likely
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-5)
    c = client.completions.create(model=model_name, prompt="Hello, my name is", max_tokens=5, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == c.choices[0].text
    assert lp.text_offset[0] == 0 and all(len(d) == 2 for d in lp.top_logprobs)


def test_32_concurrent_streams_match_offline(server, model_name, default_model_path):
    """In-flight batching changes nothing: each stream's greedy text equals the offline engine's
    output for that request generated alone."""
    conversations = [[{"role": "user", "content": f"{q} (question {i})"}] for i, q in enumerate(QUESTIONS * 4)]
    max_tokens = 20

    async def one(client, messages):
        text = ""
        stream = await client.chat.completions.create(model=model_name, messages=messages, max_tokens=max_tokens,
                                                      temperature=0, stream=True)
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
        return text

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
            return await asyncio.gather(*(one(c, m) for m in conversations))

    served = asyncio.run(all_of_them())
    llm = LLM(str(default_model_path), dtype="float32", quantization="none", kv_cache_memory_gb=0.1)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    offline = [llm.chat(m, params)[0].outputs[0].text for m in conversations]
    assert served == offline
