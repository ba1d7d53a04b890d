"""The input processor: a prompt and its parameters in, a validated `EngineRequest` out.

Every way into the engine (`LLM`, `LLMEngine.add_request`, the HTTP server) goes through here. It
tokenizes, renders chat messages with the model's template, and checks everything against the
model and the engine's configuration before anything reaches a tensor: every token id against the
vocabulary, logprob counts against `max_logprobs`, stop strings against their limits, `n` against
`max_num_seqs`, `max_tokens` against the context, and whether the prompt could ever be scheduled. A
structured-output constraint is compiled here, last (`structured_output/compiler.py`: bounded in size and
time, cached), so a request whose schema does not compile never enters the engine.
A refusal is an `InvalidRequestError` (a ValueError) whose `param` names the field, so the server
answers 400 naming the same field.

It only reads configuration that never changes, so the server runs it on a worker thread while
a step runs, and adds the finished `EngineRequest` between steps.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import abc
from dataclasses import dataclass
from typing import Any

from ..config import EngineConfig, ModelConfig
from ..errors import InvalidRequestError
from ..model.tokenizer import Tokenizer, encode_chat
from ..sampling import SamplingParams
from ..structured_output import CompiledGrammar, GrammarCompiler, PendingGrammar

# What a prompt may be: text, token ids, or vLLM's dict forms {"prompt": ...} / {"prompt_token_ids": [...]}.
Prompt = str | list[int] | dict
# A chat: [{"role": "user", "content": "Hi"}, ...]; content may also be a list of {"type": "text", "text": ...}.
Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class EngineRequest:
    """A request that passed every check: its tokens, its parameters and how many tokens it may add."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    arrival_time: float
    grammar: CompiledGrammar | None = None  # the compiled structured_outputs constraint, if the request has one
    pending_grammar: PendingGrammar | None = None  # its compile, while the request has yet to wait for it

    def compiled(self) -> "EngineRequest":
        """This request with its grammar compiled, waiting here for it (InvalidRequestError if it does not
        compile, or not in time)."""
        if self.pending_grammar is None:
            return self
        return dataclasses.replace(self, grammar=self.pending_grammar.result(), pending_grammar=None)

    async def compiled_async(self) -> "EngineRequest":
        """`compiled()`, awaited: the event loop goes on serving while the grammar compiles."""
        if self.pending_grammar is None:
            return self
        return dataclasses.replace(self, grammar=await self.pending_grammar.wait(), pending_grammar=None)


def validate_prompt(prompt_token_ids: object, vocab_size: int, max_model_len: int, limit_reason: str = "") -> list[int]:
    """The prompt as a list of ints, or an InvalidRequestError("prompt") saying what is wrong with it."""
    if isinstance(prompt_token_ids, (str, bytes)) or not isinstance(prompt_token_ids, abc.Sequence):
        raise InvalidRequestError("prompt", f"prompt_token_ids must be a list of token ids, got "
                                            f"{type(prompt_token_ids).__name__}")
    ids = list(prompt_token_ids)
    if not ids:
        raise InvalidRequestError("prompt", "prompt is empty: give at least one token")
    if not all(type(i) is int and 0 <= i < vocab_size for i in ids):  # bool is not a token id
        raise InvalidRequestError("prompt", f"prompt token ids must be integers in [0, {vocab_size})")
    if len(ids) >= max_model_len:
        raise InvalidRequestError("prompt", f"prompt has {len(ids)} tokens; the context is {max_model_len}"
                                            f"{limit_reason}, and at least one token must be generated")
    return ids


def validate_stop_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Stop token ids index the logits (min_tokens masks them): each must be in the vocabulary."""
    if any(not 0 <= i < vocab_size for i in params.stop_token_ids):
        raise InvalidRequestError("stop_token_ids", f"stop_token_ids must be token ids in [0, {vocab_size}), "
                                                    f"got {params.stop_token_ids}")


def max_new_tokens(params: SamplingParams, prompt_len: int, max_model_len: int, limit_reason: str = "") -> int:
    """How many tokens a request may generate: max_tokens, and never past the context."""
    room = max_model_len - prompt_len
    if params.max_tokens is None:
        return room
    if params.max_tokens > room:
        raise InvalidRequestError(
            "max_tokens", f"max_tokens={params.max_tokens} with a {prompt_len}-token prompt exceeds the context "
                          f"of {max_model_len} tokens{limit_reason} (at most {room})")
    return params.max_tokens


class InputProcessor:
    """Turns (request id, prompt, SamplingParams) into an `EngineRequest`, or refuses it."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        model_config: ModelConfig,
        config: EngineConfig,
        *,
        context_len: int,
        max_model_len: int,
        num_kv_blocks: int,
    ) -> None:
        """`context_len`: the longest sequence the model and the step allow; `max_model_len`: that, or
        less when the KV pool holds fewer tokens (a prompt beyond the pool gets its own message)."""
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.config = config
        self.context_len = context_len
        self.max_model_len = max_model_len
        self.num_kv_blocks = num_kv_blocks
        limited_by_step = not config.enable_chunked_prefill and context_len == config.max_num_batched_tokens + 1
        self.limit_reason = "" if not limited_by_step else (
            " (with enable_chunked_prefill=False a prompt, and after a preemption prompt + output, must fit in "
            f"one step of max_num_batched_tokens={config.max_num_batched_tokens})")
        # A token decodes to at most this many characters, so a longer text than max_model_len of them
        # is refused before it is tokenized (tokenizing megabytes takes seconds).
        self.max_token_chars = 0 if tokenizer is None else max(map(len, tokenizer.get_vocab()), default=1)
        self._grammar_compiler: GrammarCompiler | None = None  # made for the first constrained request
        self._grammar_lock = threading.Lock()

    # ------------------------------------------------------------------ entry points
    def process(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                arrival_time: float | None = None, *, wait_for_grammar: bool = True) -> EngineRequest:
        """Validate and tokenize one request; raises InvalidRequestError naming the field at fault (EngineBusyError
        when too many constraints are being compiled). `wait_for_grammar=False`: its grammar may come back pending."""
        params = self._check_params(request_id, params)
        text, token_ids = self._tokenize(prompt)
        return self._request(request_id, text, token_ids, params, arrival_time, wait_for_grammar)

    def process_chat(self, request_id: str, messages: Messages, params: SamplingParams | None = None,
                     arrival_time: float | None = None, *, wait_for_grammar: bool = True) -> EngineRequest:
        """The same for a conversation, rendered with the tokenizer's chat template."""
        params = self._check_params(request_id, params)
        return self._request(request_id, None, self.render_chat(messages), params, arrival_time, wait_for_grammar)

    def render_chat(self, messages: Messages) -> list[int]:
        """Token ids of `messages` through the chat template (text parts of a message joined by newlines)."""
        if self.tokenizer is None:
            raise InvalidRequestError("messages", "chat needs a tokenizer; this engine has none")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages", "messages must be a non-empty list of {role, content} objects")
        rendered, total = [], 0
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise InvalidRequestError("messages", f"messages[{i}] must be an object with a string role")
            content = message.get("content")
            if isinstance(content, list):
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise InvalidRequestError("messages", f"messages[{i}].content: only text parts "
                                                          f'({{"type": "text", "text": ...}}) are supported')
                content = "\n".join(part["text"] for part in content)
            if not isinstance(content, str):
                raise InvalidRequestError("messages", f"messages[{i}].content must be a string or a list of "
                                                      f"text parts")
            total += len(content)
            self._check_text_length(content, "messages")
            rendered.append({**message, "content": content})
        if len(messages) > 1:
            self._check_text_length_of(total, "messages")  # the whole chat, not only each message
        try:
            return encode_chat(self.tokenizer, rendered)
        except Exception as error:  # the template's own refusals (jinja's TemplateError, raise_exception)
            raise InvalidRequestError("messages", f"the chat template refused the messages: {error}") from error

    def grammar_compiler(self) -> GrammarCompiler:
        """The compiler of structured_outputs constraints for this tokenizer (made once, when first needed: it
        reads the whole vocabulary)."""
        if self.tokenizer is None:
            raise InvalidRequestError("structured_outputs", "structured_outputs needs a tokenizer; this engine has "
                                                            "none")
        with self._grammar_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(
                    self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids,
                    max_spec_chars=self.config.max_grammar_chars, timeout_s=self.config.grammar_compile_timeout_s,
                    max_pending=self.config.max_pending_grammar_compiles)
            return self._grammar_compiler

    def close(self) -> None:
        """Stop the grammar compiler's workers, if it has any (the engine's shutdown)."""
        with self._grammar_lock:
            if self._grammar_compiler is not None:
                self._grammar_compiler.close()

    # ------------------------------------------------------------------ checks
    def _check_params(self, request_id: str, params: SamplingParams | None) -> SamplingParams:
        config, vocab_size = self.config, self.model_config.vocab_size
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id", f"request_id must be a non-empty string, got {request_id!r}")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(None, f"params must be a SamplingParams, got {type(params).__name__}")
        if params.n > config.max_num_seqs:
            raise InvalidRequestError("n", f"n = {params.n} completions cannot run at once under max_num_seqs = "
                                           f"{config.max_num_seqs}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > config.max_logprobs:
                raise InvalidRequestError(name, f"{name} must be <= max_logprobs ({config.max_logprobs}), got {value}")
        validate_stop_token_ids(params, vocab_size)
        if params.stop:
            if self.tokenizer is None:
                raise InvalidRequestError("stop", "stop strings need a tokenizer; this engine has none "
                                                  "(use stop_token_ids)")
            if len(params.stop) > config.max_num_stop_strings:
                raise InvalidRequestError("stop", f"at most {config.max_num_stop_strings} stop strings, got "
                                                  f"{len(params.stop)}")
            longest = max(map(len, params.stop))
            if longest > config.max_stop_string_len:
                raise InvalidRequestError("stop", f"a stop string may have at most {config.max_stop_string_len} "
                                                  f"characters, got {longest}")
        if params.structured_outputs is not None and params.min_tokens:
            raise InvalidRequestError("min_tokens", "min_tokens cannot be combined with structured_outputs: the "
                                                    "grammar decides where the output may end")
        return params

    def _check_text_length(self, text: str, param: str) -> None:
        self._check_text_length_of(len(text), param)

    def _check_text_length_of(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_model_len * self.max_token_chars:
            raise InvalidRequestError(param, f"{param} of {num_chars} characters is longer than any text of "
                                             f"{self.max_model_len} tokens (the context) can be")

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, object]:
        if isinstance(prompt, dict):
            if set(prompt) not in ({"prompt"}, {"prompt_token_ids"}):
                raise InvalidRequestError("prompt", "a dict prompt has exactly one key: 'prompt' or "
                                                    "'prompt_token_ids'")
            if "prompt_token_ids" in prompt:
                return None, prompt["prompt_token_ids"]
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("prompt", "text prompts need a tokenizer; pass token ids instead")
            if not prompt:
                raise InvalidRequestError("prompt", "prompt is empty: give at least one token")
            self._check_text_length(prompt, "prompt")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, abc.Sequence) and not isinstance(prompt, bytes):
            return None, prompt
        raise InvalidRequestError("prompt", f"prompt must be a string or a list of token ids, got "
                                            f"{type(prompt).__name__}")

    def _request(self, request_id: str, text: str | None, token_ids: object, params: SamplingParams,
                 arrival_time: float | None, wait_for_grammar: bool) -> EngineRequest:
        ids = validate_prompt(token_ids, self.model_config.vocab_size, self.context_len, self.limit_reason)
        block_size = self.config.block_size
        needed = -(-(len(ids) + 1) // block_size)  # the prompt and at least one new token
        if needed > self.num_kv_blocks:
            raise InvalidRequestError(
                "prompt", f"prompt of {len(ids)} tokens needs {needed} KV blocks of {block_size} tokens, but the "
                          f"whole pool has {self.num_kv_blocks}: it could never run (give the engine more KV "
                          f"memory: num_kv_blocks, kv_cache_memory or gpu_memory_utilization)")
        budget = max_new_tokens(params, len(ids), self.max_model_len, self.limit_reason)
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        structured = params.structured_outputs
        pending = self.grammar_compiler().submit(structured) if structured is not None else None  # the last check
        request = EngineRequest(request_id, text, ids, params, budget, arrival, pending_grammar=pending)
        return request.compiled() if wait_for_grammar else request
