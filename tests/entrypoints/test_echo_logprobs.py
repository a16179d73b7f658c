"""`echo` with `logprobs` on /v1/completions, through the `openai` client against a real server:
the prompt's tokens come back with their logprobs (the first null) and top-N, followed by the
completion's; `max_tokens: 0` scores the prompt alone. The prompt logprobs equal transformers'
log-softmax on the same weights (fp32) within LOGPROB_ATOL."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch

pytestmark = pytest.mark.slow

# max |logprob difference| against HF over every prompt position and its top-N (fp32; measured
# 3e-5 on this model); the top-N tokens themselves must be the same.
LOGPROB_ATOL = 1e-3
GPL3 = Path("/usr/share/common-licenses/GPL-3")


def approx(logprobs: list[float | None]):
    """Equal up to the batch shape's effect on fp32 sums (the same request alone or beside others)."""
    return [None if v is None else pytest.approx(v, abs=1e-4) for v in logprobs]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@torch.inference_mode()
def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """[len - 1, vocab]: log p(. | tokens <= i) for every position that predicts a prompt token."""
    logits = model(torch.tensor([token_ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def test_prompt_logprobs_equal_transformers(client, model_name, hf_model, hf_tokenizer):
    """Two prompts in one request, one of 300 tokens (prefilled in chunks by the server's
    256-token step budget), as token ids and scored only (max_tokens 0)."""
    text_ids = hf_tokenizer(GPL3.read_text())["input_ids"]
    prompts = [text_ids[:12], text_ids[2000:2300]]
    r = client.completions.create(model=model_name, prompt=prompts, echo=True, logprobs=5, max_tokens=0,
                                  temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == 312
    worst = 0.0
    for prompt, choice in zip(prompts, r.choices):
        lp = choice.logprobs
        assert choice.text == hf_tokenizer.decode(prompt) and choice.finish_reason == "length"
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(prompt)
        assert lp.tokens == [hf_tokenizer.decode([t]) for t in prompt]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        ref = hf_logprobs(hf_model, prompt)
        expected = ref.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
        got = torch.tensor(lp.token_logprobs[1:], dtype=torch.float32)
        worst = max(worst, float((got - expected).abs().max()))
        for i, top in enumerate(lp.top_logprobs[1:]):
            values, ids = ref[i].topk(5)
            assert list(top) == [hf_tokenizer.decode([t]) for t in ids.tolist()]
            worst = max(worst, float((torch.tensor(list(top.values())) - values).abs().max()))
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(prompt))]
    print(f"max |logprob - HF| = {worst:.2e}")
    assert worst <= LOGPROB_ATOL, worst


def test_echo_concatenates_prompt_and_completion(client, model_name):
    prompt = "The quick brown fox jumps over the"
    plain = client.completions.create(model=model_name, prompt=prompt, logprobs=2, max_tokens=4, temperature=0)
    scored = client.completions.create(model=model_name, prompt=prompt, echo=True, logprobs=2, max_tokens=0,
                                       temperature=0)
    both = client.completions.create(model=model_name, prompt=prompt, echo=True, logprobs=2, max_tokens=4,
                                     temperature=0)
    (p,), (s,), (b,) = plain.choices, scored.choices, both.choices
    assert s.text == prompt and b.text == prompt + p.text
    n = len(s.logprobs.tokens)
    assert b.logprobs.tokens == s.logprobs.tokens + p.logprobs.tokens
    assert b.logprobs.token_logprobs[:n] == approx(s.logprobs.token_logprobs)
    assert b.logprobs.token_logprobs[n:] == approx(p.logprobs.token_logprobs)
    assert [list(t or ()) for t in b.logprobs.top_logprobs] == [
        list(t or ()) for t in s.logprobs.top_logprobs + p.logprobs.top_logprobs]
    assert all(len(top) == 2 for top in b.logprobs.top_logprobs[1:])
    # offsets index the returned text: the completion's start after the echoed prompt
    for token, offset in zip(b.logprobs.tokens, b.logprobs.text_offset):
        assert b.text[offset:offset + len(token)] == token
    assert both.usage.completion_tokens == 4 and scored.usage.completion_tokens == 0

    stream = list(client.completions.create(model=model_name, prompt=prompt, echo=True, logprobs=2, max_tokens=4,
                                            temperature=0, stream=True))
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == b.text
    assert sum((c.logprobs.tokens for c in chunks), []) == b.logprobs.tokens
    assert sum((c.logprobs.token_logprobs for c in chunks), []) == approx(b.logprobs.token_logprobs)
    assert sum((c.logprobs.text_offset for c in chunks), []) == b.logprobs.text_offset
    streamed_score = [c.choices[0] for c in client.completions.create(
        model=model_name, prompt=prompt, echo=True, logprobs=2, max_tokens=0, temperature=0, stream=True) if c.choices]
    assert "".join(c.text for c in streamed_score) == prompt
    assert sum((c.logprobs.token_logprobs for c in streamed_score), []) == approx(s.logprobs.token_logprobs)


def test_echo_scores_each_sample_and_prompt(client, model_name):
    """n samples of several prompts: each choice carries its own prompt's logprobs."""
    prompts = ["One, two, three,", "Roses are red,"]
    r = client.completions.create(model=model_name, prompt=prompts, echo=True, logprobs=0, max_tokens=3, n=2,
                                  temperature=1.0, seed=3)
    singles = [client.completions.create(model=model_name, prompt=p, echo=True, logprobs=0, max_tokens=0)
               for p in prompts]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for choice in r.choices:
        single = singles[choice.index // 2].choices[0]
        n = len(single.logprobs.tokens)
        assert choice.text.startswith(single.text)
        assert choice.logprobs.token_logprobs[:n] == approx(single.logprobs.token_logprobs)
        assert choice.logprobs.top_logprobs[1:n] == [{}] * (n - 1)  # logprobs 0: no alternatives


def test_max_tokens_zero_needs_echo(client, model_name):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt="Hi", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
