"""OpenAI's objects from the engine's outputs: completions, chat completions, streamed chunks, logprobs, errors.

`OpenAIResponse` builds one request's answer: the whole object from its final outputs (`collect`),
or one chunk per generated token (`stream`). Logprobs take OpenAI's two shapes: the legacy
completions lists (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) and chat's
`logprobs.content[]`. A logprob of minus infinity (a token the request's grammar forbids, among the top
ones; they are the logprobs of the distribution the token was drawn from, after the mask) is sent as
-9999.0, as vLLM does: JSON has no infinity. A chat answer under a tool constraint (`tools.py`) is
`tool_calls`: a named function's call streams its arguments as they come; the calls of `"required"` come in
one chunk at the end, when the array is whole. `APIError` is every failure, answered as OpenAI's error object.
"""

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse

from ..engine.engine import LLMEngine
from ..engine.outputs import CompletionOutput, Logprobs, RequestOutput
from . import protocol
from .async_engine import RequestStream
from .metrics import ServerMetrics
from .tools import ChatConstraint, make_tool_call_id, tool_calls_of

MIN_LOGPROB = -9999.0  # what -inf is sent as


class APIError(Exception):
    """An error answered as OpenAI's error object with this status."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.headers = status, headers
        self.info = protocol.ErrorInfo(message=message, type=kind, param=param, code=code)

    def response(self) -> JSONResponse:
        return JSONResponse(protocol.ErrorResponse(error=self.info).model_dump(), status_code=self.status,
                            headers=self.headers)


def engine_failed(request_id: str) -> APIError:
    return APIError(500, f"the engine failed while running request {request_id}; other requests are unaffected "
                         f"(see the server log)", kind="server_error")


class Formatter:
    """What every response of this server shares: the tokenizer (for logprob tokens) and the model name."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.model_name = model_name
        tokenizer = engine.tokenizer
        self.token_text = functools.lru_cache(maxsize=1 << 16)(
            (lambda token_id: tokenizer.decode([token_id])) if tokenizer is not None else str)


class OpenAIResponse:
    """Builds one request's OpenAI completion or chat completion objects from the engine's outputs."""

    def __init__(self, formatter: Formatter, n: int, chat: bool, num_top: int,
                 constraint: ChatConstraint | None = None) -> None:
        self.formatter, self.n, self.chat, self.num_top = formatter, n, chat, num_top
        self.tool_mode = constraint.tool_mode if constraint is not None else "text"
        self.constraint = constraint
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    # ---------------------------------------------------------------- logprobs in OpenAI's two shapes
    def _completion_logprobs(self, entries: list[Logprobs] | None, token_ids: list[int], k: int, offset: int
                             ) -> tuple[protocol.CompletionLogprobs | None, int]:
        if entries is None:
            return None, offset
        text = self.formatter.token_text
        tokens = [text(t) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return protocol.CompletionLogprobs(
            tokens=tokens, token_logprobs=[_finite(entry[t]) for entry, t in zip(entries, token_ids)],
            top_logprobs=[{text(t): lp for t, lp in _top(entry, k)} for entry in entries], text_offset=offsets), offset

    def _chat_logprobs(self, entries: list[Logprobs] | None, token_ids: list[int], k: int
                       ) -> protocol.ChatLogprobs | None:
        if entries is None:
            return None
        text = self.formatter.token_text

        def top(token_id: int, logprob: float) -> protocol.TopLogprob:
            token = text(token_id)
            return protocol.TopLogprob(token=token, logprob=_finite(logprob), bytes=list(token.encode("utf-8")))

        return protocol.ChatLogprobs(content=[
            protocol.TokenLogprob(**top(t, entry[t]).model_dump(), top_logprobs=[top(i, lp) for i, lp in _top(entry, k)])
            for entry, t in zip(entries, token_ids)])

    # ---------------------------------------------------------------- whole responses
    @staticmethod
    def _usage(prompt_tokens: int, completion_tokens: int) -> protocol.Usage:
        return protocol.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                              total_tokens=prompt_tokens + completion_tokens)

    async def collect(self, streams: list[RequestStream], metrics: ServerMetrics) -> dict:
        """Every prompt's final output as one completion object; 500 if the engine failed any of them."""
        finals: list[RequestOutput] = []
        try:
            for stream in streams:
                final = None
                async for output in stream:
                    final = output
                assert final is not None
                if any(c.finish_reason == "error" for c in final.outputs):
                    raise engine_failed(final.request_id)
                metrics.record(final, sum(len(c.token_ids) for c in final.outputs))
                finals.append(final)
        except APIError:
            raise
        except Exception as error:  # the engine loop died under this request
            raise APIError(500, f"the engine failed: {error}", kind="server_error") from error
        finally:
            for stream in streams:
                stream.cancel()
        prompt_tokens = sum(len(f.prompt_token_ids) for f in finals)
        usage = self._usage(prompt_tokens, sum(len(c.token_ids) for f in finals for c in f.outputs))
        choices = [self._choice(p * self.n + c.index, c, final) for p, final in enumerate(finals) for c in final.outputs]
        if self.chat:
            return protocol.ChatCompletionResponse(id=self.id, created=self.created, model=self.formatter.model_name,
                                                   choices=choices, usage=usage).model_dump(mode="json")
        return protocol.CompletionResponse(id=self.id, created=self.created, model=self.formatter.model_name,
                                           choices=choices, usage=usage).model_dump(mode="json")

    def _choice(self, index: int, c: CompletionOutput, final: RequestOutput) -> Any:
        k = self.num_top
        if self.chat:
            calls = tool_calls_of(self.constraint, c.text) if self.constraint is not None else None
            message = (protocol.ChatResponseMessage(content=c.text) if calls is None
                       else protocol.ChatResponseMessage(content=None, tool_calls=calls))
            return protocol.ChatChoice(index=index, message=message,
                                       logprobs=self._chat_logprobs(c.logprobs, c.token_ids, k),
                                       finish_reason=self._finish_reason(c, calls), stop_reason=c.stop_reason)
        prompt_logprobs = None
        if final.prompt_logprobs is not None:
            text = self.formatter.token_text
            prompt_logprobs = [None if e is None else {text(t): lp for t, lp in e.items()} for e in final.prompt_logprobs]
        return protocol.CompletionChoice(index=index, text=c.text,
                                         logprobs=self._completion_logprobs(c.logprobs, c.token_ids, k, 0)[0],
                                         finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                         prompt_logprobs=prompt_logprobs)

    def _finish_reason(self, c: CompletionOutput, calls: list[protocol.ToolCall] | None) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call ("required"); a named call the request forced
        ends "stop", as OpenAI's does."""
        if calls is not None and self.tool_mode == "required" and c.finish_reason == "stop":
            return "tool_calls"
        return c.finish_reason

    async def stream(self, streams: list[RequestStream], metrics: ServerMetrics, include_usage: bool
                     ) -> AsyncIterator[dict]:
        """One chunk per generated token of each completion, then (if asked) one with the usage."""
        model, counts = self.formatter.model_name, {}
        offsets: dict[int, int] = {}
        self._calls: dict[int, str] = {}  # a named call's id, per choice
        self._held: dict[int, list[CompletionOutput]] = {}  # a "required" choice's deltas, until it is whole
        prompt_tokens = 0
        try:
            if self.chat:  # OpenAI's first chat chunk carries the role
                yield protocol.ChatCompletionChunk(id=self.id, created=self.created, model=model, choices=[
                    protocol.ChatChunkChoice(index=i, delta=protocol.ChatDelta(role="assistant", content=""))
                    for i in range(self.n)]).model_dump(mode="json")
            for p, stream in enumerate(streams):
                try:
                    async for output in stream:
                        for c in output.outputs:
                            if c.finish_reason == "error":
                                raise engine_failed(output.request_id)
                            index = p * self.n + c.index
                            counts[index] = counts.get(index, 0) + len(c.token_ids)
                            chunk = self._chunk(index, c, offsets)
                            if chunk is not None:
                                yield chunk
                        if output.finished:
                            prompt_tokens += len(output.prompt_token_ids)
                            metrics.record(output, sum(counts.get(p * self.n + i, 0) for i in range(self.n)))
                except (APIError, asyncio.CancelledError):
                    raise
                except Exception as error:  # the engine loop died under this request
                    raise APIError(500, f"the engine failed: {error}", kind="server_error") from error
            if include_usage:
                usage = self._usage(prompt_tokens, sum(counts.values()))
                chunk = protocol.ChatCompletionChunk if self.chat else protocol.CompletionChunk
                yield chunk(id=self.id, created=self.created, model=model, choices=[], usage=usage).model_dump(mode="json")
        finally:  # the client went away (or we are done): stop whatever still runs
            for stream in streams:
                stream.cancel()

    def _chunk(self, index: int, c: CompletionOutput, offsets: dict[int, int]) -> dict | None:
        model, k = self.formatter.model_name, self.num_top
        if self.chat:
            if self.tool_mode == "required":
                held = self._held.setdefault(index, [])
                held.append(c)
                if c.finish_reason is None:
                    return None  # the array is sent whole
                whole = CompletionOutput(index=c.index, text="".join(h.text for h in held),
                                         token_ids=[t for h in held for t in h.token_ids],
                                         finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                         logprobs=None if c.logprobs is None
                                         else [e for h in held for e in h.logprobs or []])
                calls = tool_calls_of(self.constraint, whole.text) if self.constraint is not None else None
                if calls is None:
                    delta = protocol.ChatDelta(content=whole.text)
                else:
                    delta = protocol.ChatDelta(tool_calls=[protocol.ToolCallDelta(
                        index=i, id=call.id, type="function",
                        function=protocol.FunctionCallDelta(name=call.function.name, arguments=call.function.arguments))
                        for i, call in enumerate(calls)])
                c, finish = whole, self._finish_reason(whole, calls)
            elif self.tool_mode == "named":
                first = index not in self._calls
                call_id = self._calls.setdefault(index, make_tool_call_id())
                assert self.constraint is not None
                delta = protocol.ChatDelta(tool_calls=[protocol.ToolCallDelta(
                    index=0, id=call_id if first else None, type="function" if first else None,
                    function=protocol.FunctionCallDelta(name=self.constraint.function_name if first else None,
                                                        arguments=c.text))])
                finish = c.finish_reason
            else:
                delta, finish = protocol.ChatDelta(content=c.text), c.finish_reason
            choice = protocol.ChatChunkChoice(index=index, delta=delta,
                                              logprobs=self._chat_logprobs(c.logprobs, c.token_ids, k),
                                              finish_reason=finish)
            return protocol.ChatCompletionChunk(id=self.id, created=self.created, model=model,
                                                choices=[choice]).model_dump(mode="json")
        logprobs, offsets[index] = self._completion_logprobs(c.logprobs, c.token_ids, k, offsets.get(index, 0))
        choice = protocol.CompletionChoice(index=index, text=c.text, logprobs=logprobs, finish_reason=c.finish_reason,
                                           stop_reason=c.stop_reason)
        return protocol.CompletionChunk(id=self.id, created=self.created, model=model,
                                        choices=[choice]).model_dump(mode="json")


def _top(entry: Logprobs, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens of a position (the chosen token counts only if it is among them)."""
    return sorted(entry.items(), key=lambda item: -item[1])[:k]


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)
