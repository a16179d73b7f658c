"""Text in, text out around EngineCore: tokenize and validate prompts, fan out n samples,
detokenize incrementally, apply stop strings, and assemble RequestOutputs."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.config import EngineConfig
from tokenmill.core.outputs import EngineCoreOutput
from tokenmill.core.request import Request, RequestStatus
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.engine_core import EngineCore
from tokenmill.models.loader import load_checkpoint
from tokenmill.models.registry import resolve_model
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from tokenmill.sampling_params import SamplingParams, SamplingParamsError
from tokenmill.structured.grammar import GrammarCompiler

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]


class InvalidPromptError(ValueError):
    """A prompt the engine cannot take; `field` names the offending input."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class ContextLengthError(InvalidPromptError):
    """prompt + max_tokens does not fit in the model's context."""


@dataclass
class _Sample:
    """One of a request's n samples: a child request in the core."""

    child_id: str
    request: Request
    completion: CompletionOutput
    detokenizer: IncrementalDetokenizer


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    metrics: RequestMetrics
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(s.completion.finished for s in self.samples)


@dataclass
class PreparedRequest:
    """A request tokenized and validated against the model, not yet in the engine."""

    state: _RequestState

    @property
    def request_id(self) -> str:
        return self.state.request_id


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        path = resolve_model(config.model)
        checkpoint = load_checkpoint(path)
        self.model_path = path
        self.tokenizer = checkpoint.tokenizer
        self.eos_token_ids = list(checkpoint.config.eos_token_ids)
        self.vocab_size = checkpoint.config.vocab_size
        # Structured output: constraints compiled at admission, cached by (kind, text).
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.core = EngineCore(config, checkpoint)
        self.max_model_len = self.core.max_model_len
        # The most tokens one request can hold in the KV cache (one sample of it, at least).
        self.kv_capacity_tokens = self.core.runner.num_blocks * config.block_size
        self._requests: dict[str, _RequestState] = {}
        self._child_to_parent: dict[str, tuple[_RequestState, _Sample]] = {}

    # -- input ----------------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidPromptError("prompt", "prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        token_ids = list(prompt)
        if not token_ids:
            raise InvalidPromptError("prompt", "prompt is empty")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidPromptError("prompt", f"token ids must be integers in [0, {self.vocab_size}), got {bad[:5]}")
        return None, token_ids

    def apply_chat_template(self, messages: list[dict]) -> str:
        if not messages:
            raise InvalidPromptError("messages", "messages is empty")
        if not self.tokenizer.chat_template:
            raise InvalidPromptError("messages", f"model {self.model_path.name} has no chat template")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams, chat: bool = False) -> None:
        """Validate and queue a request. Raises InvalidPromptError, SamplingParamsError or
        RequestRejectedError (all ValueErrors) without touching any other request."""
        self.add_prepared(self.prepare_request(request_id, prompt, params, chat))

    def prepare_request(self, request_id: str, prompt: Prompt, params: SamplingParams, chat: bool = False) -> PreparedRequest:
        """Tokenize and validate. Reads only the tokenizer and the config, so it may run on
        another thread than the one stepping the engine."""
        if params.logit_bias:
            bad = [t for t in params.logit_bias if not 0 <= t < self.vocab_size]
            if bad:
                raise SamplingParamsError("logit_bias", f"logit_bias keys must be token ids in [0, {self.vocab_size}), got {bad[:5]}")
        # A constraint the backend cannot compile is the caller's error, raised here before
        # anything is queued; compiled grammars are cached, so a repeated schema costs a lookup.
        grammar = self.grammar_compiler.compile(params.structured_output) if params.structured_output else None
        if chat:  # the chat template already placed every special token
            text, token_ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            text, token_ids = self.tokenize_prompt(prompt)
        num_prompt = len(token_ids)
        if params.max_tokens is None:
            max_tokens = min(self.max_model_len, self.kv_capacity_tokens) - num_prompt
            if max_tokens < 1:
                raise ContextLengthError(
                    "messages" if chat else "prompt",
                    f"This model's maximum context length is {self.max_model_len} tokens; the prompt has "
                    f"{num_prompt} tokens, which leaves no room for the completion.",
                )
        else:
            max_tokens = params.max_tokens
        for limit, what in ((self.max_model_len, "This model's maximum context length is"),
                            (self.kv_capacity_tokens, "The server's KV cache holds")):
            if num_prompt + max_tokens > limit:
                field = "max_tokens" if num_prompt < limit else ("messages" if chat else "prompt")
                raise ContextLengthError(
                    field,
                    f"{what} {limit} tokens; you requested {num_prompt + max_tokens} tokens: {num_prompt} in the "
                    f"prompt, {max_tokens} for the completion. Please reduce the prompt or max_tokens.",
                )
        state = _RequestState(request_id, text, token_ids, params, [], RequestMetrics(arrival_time=time.monotonic()))
        if params.prompt_logprobs:
            state.prompt_logprobs = [None]  # the first prompt token has no context to predict it
            if params.logprobs:
                state.prompt_top_logprobs = [None]
        for index in range(params.n):
            child_params = params if params.n == 1 else dataclasses.replace(
                params, n=1, seed=None if params.seed is None else params.seed + index
            )
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            child = Request(child_id, token_ids, child_params, self.eos_token_ids, max_tokens, state.metrics.arrival_time,
                            grammar=grammar)
            if index:  # the other samples share the first one's prompt blocks
                child.fork_parent = state.samples[0].request
            completion = CompletionOutput(index=index, logprobs=[] if params.logprobs is not None else None)
            if params.logprobs is not None:
                completion.cumulative_logprob = 0.0
            state.samples.append(_Sample(child_id, child, completion, IncrementalDetokenizer(self.tokenizer, token_ids, child_params)))
        return PreparedRequest(state)

    def add_prepared(self, prepared: PreparedRequest) -> None:
        """Queue a prepared request (on the thread that steps the engine)."""
        state = prepared.state
        if state.request_id in self._requests:
            raise InvalidPromptError("request_id", f"request id {state.request_id!r} is already in use")
        added: list[str] = []
        try:
            for sample in state.samples:
                self.core.add_request(sample.request)
                added.append(sample.child_id)
        except ValueError:
            self.core.abort_requests(added)
            raise
        self._requests[state.request_id] = state
        for sample in state.samples:
            self._child_to_parent[sample.child_id] = (state, sample)

    def abort_request(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            state = self._requests.pop(request_id, None)
            if state is None:
                continue
            self.core.abort_requests([s.child_id for s in state.samples])
            for s in state.samples:
                self._child_to_parent.pop(s.child_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # -- one step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine iteration; return an output for every request that progressed."""
        for state in self._requests.values():
            for s in state.samples:
                s.completion.delta_text = ""
                s.completion.delta_token_ids = []
        core_outputs = self.core.step()
        now = time.monotonic()  # after the step: its tokens exist from here on
        touched: dict[str, _RequestState] = {}
        stopped_by_string: list[str] = []
        for out in core_outputs:
            entry = self._child_to_parent.get(out.req_id)
            if entry is None:
                continue
            state, sample = entry
            if out.new_prompt_logprobs and sample is state.samples[0]:  # all samples compute the same
                state.prompt_logprobs.extend(out.new_prompt_logprobs)
                if state.prompt_top_logprobs is not None:
                    state.prompt_top_logprobs.extend(out.new_prompt_top_logprobs)
            if not out.new_token_ids:
                continue
            if self._process(sample, out):
                stopped_by_string.append(out.req_id)
            touched[state.request_id] = state
            if state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = sample.request.first_scheduled_time
            state.metrics.first_token_time = state.metrics.first_token_time or now
            state.metrics.last_token_time = now
        if stopped_by_string:
            self.core.finish_requests(stopped_by_string, RequestStatus.FINISHED_STOPPED)
        outputs = []
        for state in touched.values():
            if state.finished:
                state.metrics.finished_time = now
                del self._requests[state.request_id]
                for s in state.samples:
                    self._child_to_parent.pop(s.child_id, None)
            outputs.append(
                RequestOutput(
                    request_id=state.request_id,
                    prompt=state.prompt,
                    prompt_token_ids=state.prompt_token_ids,
                    outputs=[dataclasses.replace(s.completion, token_ids=list(s.completion.token_ids)) for s in state.samples],
                    finished=state.finished,
                    metrics=dataclasses.replace(state.metrics),
                    prompt_logprobs=state.prompt_logprobs,
                    prompt_top_logprobs=state.prompt_top_logprobs,
                )
            )
        return outputs

    @staticmethod
    def _process(sample: _Sample, out: EngineCoreOutput) -> bool:
        """Fold one core output into the sample's completion. True if a stop string ended it."""
        c = sample.completion
        # Several tokens arrive at once with speculative decoding: they are fed one at a time,
        # so that a stop string ends the output at the token it would have ended it at without
        # speculation (the tokens after it are dropped: not in the output, usage or logprobs).
        new_ids, stop_string = out.new_token_ids, None
        for i, token_id in enumerate(out.new_token_ids):
            stop_string = sample.detokenizer.update([token_id])
            if stop_string is not None:
                new_ids = out.new_token_ids[: i + 1]
                break
        c.token_ids.extend(new_ids)
        c.delta_token_ids.extend(new_ids)
        c.num_draft_tokens += out.num_draft_tokens
        c.num_accepted_tokens += out.num_accepted_tokens
        c.num_verifications += out.num_draft_tokens > 0
        if c.logprobs is not None and out.new_logprobs is not None:
            for token_id, logprob, top in zip(new_ids, out.new_logprobs, out.new_top_logprobs or []):
                c.logprobs.append(TokenLogprob(token_id, logprob, top))
                c.cumulative_logprob += logprob
        finished = out.finished or stop_string is not None
        c.delta_text += sample.detokenizer.take_delta()
        if finished:
            c.delta_text += sample.detokenizer.flush()
        c.text = sample.detokenizer.output_text
        if stop_string is not None:
            c.finish_reason, c.stop_reason = "stop", stop_string
        elif out.finished:
            c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
        return stop_string is not None and not out.finished
