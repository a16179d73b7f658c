"""The offline Python API: `LLM(model).generate(prompts, params)`, `.chat(...)`, `.stream(...)`."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine, Prompt
from tokenmill.models.registry import DEFAULT_MODEL
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

Messages = list[dict]


class LLM:
    """An engine in this process. Keyword arguments are `EngineConfig` fields (unknown ones are
    an error), e.g. `LLM("smollm2-135m", dtype="float32", max_num_batched_tokens=512)`.

    Split over ranks (`tensor_parallel_size`, `pipeline_parallel_size`), it holds worker
    processes and this process's torch.distributed group until `shutdown()`, the end of a
    `with LLM(...) as llm:` block, `del llm` (its last reference) or the interpreter's exit,
    whichever comes first; another engine, of any shape, may be built after that. The workers
    end with this process however it ends."""

    def __init__(self, model: str = DEFAULT_MODEL, **config):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **config))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Write the prefix cache's blocks to the disk tier (with `disk_cache_dir`) and stop its
        threads; with the model split over ranks, stop the other ranks and leave the process
        group. With either, the LLM cannot generate afterwards. Idempotent."""
        engine = getattr(self, "engine", None)  # (none when the constructor raised)
        if engine is not None:
            engine.core.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def __del__(self) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion as one in-flight batch; outputs in prompt order.
        A prompt is a string or a list of token ids."""
        finals: dict[str, RequestOutput] = {}
        ids = self._add(_as_prompt_list(prompts), sampling_params, chat=False)
        for out in self._run(ids):
            if out.finished:
                finals[out.request_id] = out
        return [finals[i] for i in ids]

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Like generate, for one conversation or a list of them, through the model's chat template."""
        if not messages or isinstance(messages[0], dict):
            conversations = [messages]  # one conversation (an empty one is rejected below)
        else:
            conversations = list(messages)
        prompts = [self.engine.apply_chat_template(list(c)) for c in conversations]
        finals: dict[str, RequestOutput] = {}
        ids = self._add(prompts, sampling_params, chat=True)
        for out in self._run(ids):
            if out.finished:
                finals[out.request_id] = out
        return [finals[i] for i in ids]

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield a RequestOutput each time a request progresses (its `delta_text` /
        `delta_token_ids` hold what is new); the last one of each request has `finished`."""
        ids = self._add(_as_prompt_list(prompts), sampling_params, chat=False)
        yield from self._run(ids)

    def _add(self, prompts: list[Prompt], params, chat: bool) -> list[str]:
        if params is None:
            params = SamplingParams()
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params_list):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, prompt, p, chat=chat)
                ids.append(request_id)
        except ValueError:
            self.engine.abort_request(ids)
            raise
        return ids

    def _run(self, ids: list[str]) -> Iterator[RequestOutput]:
        pending = set(ids)
        try:
            while pending:
                for out in self.engine.step():
                    if out.request_id in pending:
                        yield out
                        if out.finished:
                            pending.discard(out.request_id)
        finally:  # a caller that stops iterating early must not leave requests running
            self.engine.abort_request(list(pending))


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):  # a single prompt of token ids
        return [prompts]
    return prompts
