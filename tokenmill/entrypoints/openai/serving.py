"""The completions and chat completions handlers: OpenAI request -> engine requests -> OpenAI
response, whole or as server-sent events (one event per engine iteration)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from tokenmill.engine.async_llm import AsyncLLM, EngineDeadError, RequestAbortedError, RequestStream
from tokenmill.engine.llm_engine import InvalidPromptError, LLMEngine
from tokenmill.entrypoints.openai.chat import ChatTemplate, ChoiceText, whole_message
from tokenmill.entrypoints.openai.metrics import RequestTracker, ServerMetrics
from tokenmill.entrypoints.openai.protocol import (
    MAX_N,
    MAX_SEQUENCES_PER_REQUEST,
    MAX_STOP_STRING_LENGTH,
    ChatCompletionRequest,
    CompletionRequest,
    completion_id,
    now,
)
from tokenmill.entrypoints.openai.structured_output import Constraint, build, constraint_of
from tokenmill.entrypoints.openai.tool_calls import ToolChoice, check_tools, forced_call_schema
from tokenmill.outputs import RequestOutput, TokenLogprob
from tokenmill.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError


class ClientDisconnected(Exception):
    """The client went away before its response was ready; its requests were aborted."""


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers


@dataclass
class _Job:
    """One engine request behind an API request: a prompt and its place among the choices."""

    request_id: str
    prompt: object  # text or token ids
    first_index: int  # choice index of its sample 0
    echo_text: str = ""


class OpenAIServing:
    def __init__(self, llm: AsyncLLM, engine: LLMEngine, model_name: str, metrics: ServerMetrics,
                 chat_template: str | None = None, max_prompt_chars: int | None = None):
        self.llm = llm
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.max_prompt_chars = max_prompt_chars  # None: no limit before tokenizing
        self.chat_template = ChatTemplate(engine.tokenizer, chat_template, engine.model_path.name)

    # -- request -> sampling params ---------------------------------------------------------------

    def sampling_params(self, req, max_tokens: int | None, logprobs: int | None, prompt_logprobs: bool = False,
                        constraint: Constraint | None = None) -> SamplingParams:
        if not 1 <= req.n <= MAX_N:
            raise APIError(400, f"n must be in [1, {MAX_N}], got {req.n}", param="n")
        stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        if any(len(s) > MAX_STOP_STRING_LENGTH for s in stop):
            raise APIError(400, f"each stop string must be at most {MAX_STOP_STRING_LENGTH} characters", param="stop")
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            min_p=req.min_p or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            frequency_penalty=req.frequency_penalty or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            logit_bias=req.logit_bias or None,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=stop,
            stop_token_ids=req.stop_token_ids or [],
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            prompt_logprobs=prompt_logprobs,
            structured_output=constraint.params if constraint is not None else None,
        )

    def check_prompt_length(self, text: str, param: str) -> None:
        """A 400 for prompt text too long to be worth tokenizing (--max-prompt-chars): the
        tokenizer runs on the event loop, and such a prompt could not fit the context anyway."""
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise APIError(400, f"{param}: the prompt has {len(text)} characters; at most {self.max_prompt_chars} "
                                f"are allowed (the model's maximum context length is {self.engine.max_model_len} "
                                f"tokens)", param=param)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                           param="model", type="NotFoundError", code="model_not_found")

    # -- completions --------------------------------------------------------------------------------

    async def completions(self, req: CompletionRequest, is_disconnected: Callable) -> dict | AsyncIterator[str]:
        self.check_model(req.model)
        # max_tokens 0 with echo scores the prompt: the engine samples one token, which is dropped.
        score_only = req.echo and req.max_tokens == 0
        echo_logprobs = req.echo and req.logprobs is not None
        constraint = constraint_of(req)
        params = self.sampling_params(req, 1 if score_only else req.max_tokens, req.logprobs, echo_logprobs, constraint)
        prompts = _prompt_list(req.prompt)
        if len(prompts) * req.n > MAX_SEQUENCES_PER_REQUEST:
            raise APIError(400, f"a request may ask for at most {MAX_SEQUENCES_PER_REQUEST} sequences (prompts x n), "
                                f"got {len(prompts)} prompts x n={req.n}", param="prompt")
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                self.check_prompt_length(prompt, "prompt" if isinstance(req.prompt, str) else f"prompt.{i}")
        base = completion_id("cmpl")
        jobs = []
        for i, prompt in enumerate(prompts):
            echo = "" if not req.echo else (prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(prompt))
            jobs.append(_Job(f"{base}-{i}", prompt, i * req.n, echo))
        streams = await self._start(jobs, params, chat=False, constraint=constraint)
        if req.stream:
            return self._stream_completions(base, jobs, streams, req, score_only)
        finals = await self._collect(streams, is_disconnected)
        if score_only:
            finals = [_without_completion(f) for f in finals]
        choices = []
        for job, final in zip(jobs, finals):
            for c in final.outputs:
                logprobs = None
                if req.logprobs is not None:
                    logprobs = self._completion_logprobs(c.logprobs, len(job.echo_text))
                    if req.echo:
                        logprobs = _concat_logprobs(self._prompt_logprobs(final), logprobs)
                choices.append({
                    "index": job.first_index + c.index,
                    "text": job.echo_text + c.text,
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                })
        return {"id": base, "object": "text_completion", "created": now(), "model": self.model_name,
                "choices": sorted(choices, key=lambda c: c["index"]), "usage": _usage(finals)}

    async def _stream_completions(self, base, jobs, streams, req, score_only: bool) -> AsyncIterator[str]:
        created = now()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        finals: list[RequestOutput] = []
        offsets: dict[int, int] = {}  # choice index -> text offset, for logprobs.text_offset
        async for job_index, out in _errors_as_events(_merge(streams)):
            if isinstance(out, str):
                yield out
                return
            job = jobs[job_index]
            if score_only:
                out = _without_completion(out)
            choices = []
            for c in out.outputs:
                index = job.first_index + c.index
                first = index not in offsets
                if not c.delta_token_ids and not c.finished and not c.delta_text and not first:
                    continue
                text = (job.echo_text if first else "") + c.delta_text
                logprobs = None
                if req.logprobs is not None and c.logprobs is not None:
                    new = c.logprobs[len(c.logprobs) - len(c.delta_token_ids):]
                    logprobs = self._completion_logprobs(new, offsets.get(index, 0) + len(text) - len(c.delta_text))
                    if req.echo and first:
                        logprobs = _concat_logprobs(self._prompt_logprobs(out), logprobs)
                offsets[index] = offsets.get(index, 0) + len(text)
                choices.append({"index": index, "text": text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason if c.finished else None})
            if out.finished:
                finals.append(out)
            if choices:
                yield _sse({"id": base, "object": "text_completion", "created": created, "model": self.model_name,
                            "choices": choices, **({"usage": None} if include_usage else {})})
        if include_usage:
            yield _sse({"id": base, "object": "text_completion", "created": created, "model": self.model_name,
                        "choices": [], "usage": _usage(finals)})
        yield "data: [DONE]\n\n"

    # -- chat completions ---------------------------------------------------------------------------

    async def chat_completions(self, req: ChatCompletionRequest, is_disconnected: Callable) -> dict | AsyncIterator[str]:
        self.check_model(req.model)
        for field in ("tool_choice", "parallel_tool_calls"):
            if getattr(req, field) is not None and not req.tools:
                raise APIError(400, f"{field} is only allowed when tools are given", param=field)
        tool_choice = check_tools(req.tools, req.tool_choice)
        constraint = constraint_of(req)
        if tool_choice is not None and tool_choice.mode == "forced":
            # the call is constrained to one of the allowed tools with arguments that fit its schema
            if constraint is not None:
                raise APIError(400, f"tool_choice {req.tool_choice!r} cannot be combined with {constraint.field}",
                               param="tool_choice")
            constraint = Constraint(build("tools", json=forced_call_schema(tool_choice)), "tools")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                           param="top_logprobs")
        if req.max_completion_tokens is not None and req.max_completion_tokens < 1:
            raise APIError(400, f"max_completion_tokens must be >= 1, got {req.max_completion_tokens}",
                           param="max_completion_tokens")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens, logprobs, constraint=constraint)
        prompt = self.chat_template.render(req.messages, tool_choice)
        self.check_prompt_length(prompt, "messages")
        base = completion_id("chatcmpl")
        jobs = [_Job(base, prompt, 0)]
        try:
            streams = await self._start(jobs, params, chat=True, constraint=constraint)
        except (InvalidPromptError, SamplingParamsError, APIError) as e:
            # name the field the client sent (max_completion_tokens wins over max_tokens)
            if req.max_completion_tokens is not None and getattr(e, "field", None) == "max_tokens":
                e.field = "max_completion_tokens"
            if req.max_completion_tokens is not None and getattr(e, "param", None) == "max_tokens":
                e.param = "max_completion_tokens"
            raise
        if req.stream:
            return self._stream_chat(base, streams[0], req, tool_choice)
        (final,) = await self._collect(streams, is_disconnected)
        choices = []
        for c in final.outputs:
            message, finish_reason = whole_message(c.text, c.finish_reason, tool_choice, req.parallel_tool_calls)
            choices.append({
                "index": c.index,
                "message": message,
                "logprobs": {"content": self._chat_logprobs(c.logprobs)} if req.logprobs else None,
                "finish_reason": finish_reason,
                "stop_reason": c.stop_reason,
            })
        return {"id": base, "object": "chat.completion", "created": now(), "model": self.model_name,
                "choices": choices, "usage": _usage([final])}

    async def _stream_chat(self, base, stream, req, tool_choice: ToolChoice | None) -> AsyncIterator[str]:
        created = now()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        extra = {"usage": None} if include_usage else {}

        def chunk(choices):
            return _sse({"id": base, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                         "choices": choices, **extra})

        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                     for i in range(req.n)])
        final = None
        texts = [ChoiceText(tool_choice, req.parallel_tool_calls) for _ in range(req.n)]
        async for _, out in _errors_as_events(_merge([stream])):
            if isinstance(out, str):
                yield out
                return
            choices = []
            for c in out.outputs:
                if not c.delta_token_ids and not c.finished and not c.delta_text:
                    continue
                logprobs = None
                if req.logprobs and c.logprobs is not None:
                    logprobs = {"content": self._chat_logprobs(c.logprobs[len(c.logprobs) - len(c.delta_token_ids):])}
                delta, finish_reason = texts[c.index].feed(c.delta_text), None
                if c.finished:
                    last, finish_reason = texts[c.index].finish(c.finish_reason)
                    delta = _merge_deltas(delta, last)
                if delta or logprobs or finish_reason:  # not a token inside a tool call, still being parsed
                    choices.append({"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason})
            if out.finished:
                final = out
            if choices:
                yield chunk(choices)
        if include_usage:
            extra = {"usage": _usage([final] if final else [])}
            yield chunk([])
        yield "data: [DONE]\n\n"

    # -- running requests ---------------------------------------------------------------------------

    async def _start(self, jobs: list[_Job], params: SamplingParams, chat: bool,
                     constraint: Constraint | None = None) -> list[AsyncIterator[RequestOutput]]:
        """Submit every job. Validation errors surface here, before any response is sent, and
        leave nothing running."""
        streams: list[RequestStream] = []
        try:
            for job in jobs:
                streams.append(await self.llm.add_request(job.request_id, job.prompt, params, chat))
        except BaseException as e:
            for stream in streams:
                stream.abort()
            if constraint is not None and isinstance(e, SamplingParamsError) and e.field.startswith("structured_output"):
                raise constraint.field_error(e) from None  # a schema or grammar the backend cannot compile
            raise
        self.metrics.accepted.inc(len(streams) * params.n)
        return [self._tracked(stream, params.n) for stream in streams]

    async def _tracked(self, stream: RequestStream, choices: int) -> AsyncIterator[RequestOutput]:
        """The stream's outputs, observed by the metrics; aborts the request if left early."""
        tracker = RequestTracker(self.metrics, stream.request_id, choices)
        try:
            async for out in stream:
                tracker.observe(out)
                yield out
        finally:
            stream.abort()  # a no-op once finished
            tracker.close()

    async def _collect(self, streams, is_disconnected: Callable) -> list[RequestOutput]:
        """Run every stream to its final output; abort them all if the client goes away first."""

        async def last(stream):
            final = None
            async for out in stream:
                final = out
            return final

        tasks = [asyncio.ensure_future(last(s)) for s in streams]
        watcher = asyncio.ensure_future(is_disconnected())
        try:
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait([*pending, watcher], return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    if t is not watcher and t.exception() is not None:
                        raise t.exception()
                if watcher in done:
                    raise ClientDisconnected()
                pending.discard(watcher)
            return [t.result() for t in tasks]
        finally:
            watcher.cancel()
            for t in tasks:
                t.cancel()
            # Let the cancelled tasks unwind out of their streams (which aborts the requests):
            # closing a stream a task is still inside raises "already running".
            await asyncio.gather(*tasks, return_exceptions=True)
            for s in streams:
                await s.aclose()

    # -- logprobs ---------------------------------------------------------------------------------

    def _token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    def _chat_logprobs(self, logprobs: list[TokenLogprob] | None) -> list[dict]:
        result = []
        for lp in logprobs or []:
            text = self._token_text(lp.token_id)
            result.append({
                "token": text, "logprob": lp.logprob, "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": (t := self._token_text(i)), "logprob": v, "bytes": list(t.encode())} for i, v in lp.top
                ],
            })
        return result

    def _prompt_logprobs(self, out: RequestOutput) -> dict:
        """The prompt's tokens in the shape of completion logprobs, as echo returns them: the
        first token has no logprob (nothing precedes it) and no top alternatives."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        offset = 0
        for i, token_id in enumerate(out.prompt_token_ids):
            text = self._token_text(token_id)
            tokens.append(text)
            token_logprobs.append(out.prompt_logprobs[i])
            alternatives = out.prompt_top_logprobs[i] if out.prompt_top_logprobs else []
            top.append(None if i == 0 else {self._token_text(t): v for t, v in alternatives})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def _completion_logprobs(self, logprobs: list[TokenLogprob] | None, offset: int) -> dict:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for lp in logprobs or []:
            text = self._token_text(lp.token_id)
            tokens.append(text)
            token_logprobs.append(lp.logprob)
            top.append({self._token_text(i): v for i, v in lp.top})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


# -- helpers ----------------------------------------------------------------------------------------


async def _merge(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as their items arrive, tagged with the stream's index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, stream):
        try:
            async for out in stream:
                await queue.put((i, out))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, out = await queue.get()
            if out is done:
                remaining -= 1
                if tasks[i].done() and tasks[i].exception() is not None:
                    raise tasks[i].exception()
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # out of the streams before closing them
        for s in streams:
            await s.aclose()


async def _errors_as_events(items: AsyncIterator) -> AsyncIterator:
    """Pass items through; a server-side failure after the response started (shutdown, a dead
    engine) becomes one final SSE error event (as a str, tagged like an item) and `[DONE]`."""
    try:
        async for item in items:
            yield item
    except (RequestAbortedError, EngineDeadError) as e:
        body = {"error": {"message": str(e), "type": "server_error", "param": None, "code": 503}}
        yield None, _sse(body) + "data: [DONE]\n\n"


def _concat_logprobs(first: dict, second: dict) -> dict:
    return {key: first[key] + second[key] for key in first}


def _without_completion(out: RequestOutput) -> RequestOutput:
    """A score-only request's output: the prompt and its logprobs, none of the one sampled token."""
    outputs = [dataclasses.replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None,
                                   delta_text="", delta_token_ids=[], finish_reason="length" if c.finished else None,
                                   stop_reason=None)
               for c in out.outputs]
    return dataclasses.replace(out, outputs=outputs)


def _prompt_list(prompt) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _merge_deltas(first: dict, second: dict) -> dict:
    merged = dict(first)
    if "content" in second:
        merged["content"] = merged.get("content", "") + second["content"]
    if "tool_calls" in second:
        merged["tool_calls"] = merged.get("tool_calls", []) + second["tool_calls"]
    return merged


def _usage(finals: list[RequestOutput]) -> dict:
    prompt = sum(len(f.prompt_token_ids) for f in finals)
    completion = sum(len(c.token_ids) for f in finals for c in f.outputs)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    drafts = sum(c.num_draft_tokens for f in finals for c in f.outputs)
    if drafts:  # an extension: what speculative decoding did for this request
        usage["speculative_decoding"] = {
            "draft_tokens": drafts, "accepted_tokens": sum(c.num_accepted_tokens for f in finals for c in f.outputs),
            "verifications": sum(c.num_verifications for f in finals for c in f.outputs),
        }
    return usage


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
