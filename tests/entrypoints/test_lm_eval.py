"""lm-evaluation-harness end to end against a real `tokenmill serve`: `lm_eval --model
local-completions` runs a multiple-choice (log-likelihood) task defined in a local YAML file over a
local jsonl (nothing from a hub: the tokenizer is saved from the served GGUF). Each log-likelihood
lm-eval reports equals transformers' on the same weights (fp32) within LOGLIKELIHOOD_ATOL, and so
does the accuracy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

LOGLIKELIHOOD_ATOL = 1e-3  # a sum of a few fp32 token logprobs, each ~3e-5 from HF's
TASK = "tokenmill_tiny_choice"
DOCS = [
    {"question": "The capital of France is", "choices": [" Paris.", " a banana.", " the moon."], "answer": 0},
    {"question": "Two plus two equals", "choices": [" seven hundred.", " four.", " blue."], "answer": 1},
    {"question": "Water freezes at zero degrees", "choices": [" Fahrenheit.", " Kelvin.", " Celsius."], "answer": 2},
    {"question": "The opposite of hot is", "choices": [" cold.", " loud.", " fast."], "answer": 0},
]
TASK_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@torch.inference_mode()
def hf_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context) as lm-eval splits it: the continuation's tokens are those of
    context + continuation after the context's."""
    context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), dim=-1)
    return sum(float(logprobs[i - 1, whole[i]]) for i in range(len(context_ids), len(whole)))


def test_lm_eval_loglikelihood_task(server, model_name, hf_model, hf_tokenizer, tmp_path):
    pytest.importorskip("lm_eval")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=data))
    tokenizer_dir = tmp_path / "tokenizer"
    hf_tokenizer.save_pretrained(tokenizer_dir)
    output = tmp_path / "out"
    model_args = ",".join([
        f"model={model_name}", f"base_url={server.url}/v1/completions", "tokenizer_backend=huggingface",
        f"tokenizer={tokenizer_dir}", "num_concurrent=2", "max_retries=1",
    ])
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_CACHE=str(tmp_path / "datasets"))
    run = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
         "--batch_size", "3", "--tasks", TASK, "--include_path", str(tasks), "--output_path", str(output), "--log_samples"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]

    (results_file,) = output.rglob("results_*.json")
    (samples_file,) = output.rglob(f"samples_{TASK}_*.jsonl")
    samples = sorted((json.loads(line) for line in samples_file.read_text().splitlines()), key=lambda s: s["doc_id"])
    assert len(samples) == len(DOCS)
    correct = 0
    for sample, doc in zip(samples, DOCS):
        got = [float(resp[0][0]) for resp in sample["resps"]]  # per choice: [[loglikelihood, is_greedy]]
        expected = [hf_loglikelihood(hf_model, hf_tokenizer, doc["question"], c) for c in doc["choices"]]
        assert got == pytest.approx(expected, abs=LOGLIKELIHOOD_ATOL), (doc, got, expected)
        correct += max(range(len(expected)), key=expected.__getitem__) == doc["answer"]
    acc = json.loads(results_file.read_text())["results"][TASK]["acc,none"]
    assert acc == pytest.approx(correct / len(DOCS))
