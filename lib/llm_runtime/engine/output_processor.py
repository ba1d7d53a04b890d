"""The output processor: sampled tokens in, text deltas, stop strings and `RequestOutput`s out.

After each step the scheduler has appended every sampled token to its `Sequence` (and applied the
token stop rules: EOS, stop token ids, max_tokens). Here, for each sequence that moved, the new
token becomes text (`IncrementalDetokenizer`), stop strings are looked for where the new text
could complete one, and the request's output is built in the shape its `output_kind` asks for.

Constant work per new token: text is kept as released pieces plus a short held-back tail (the
characters a stop string could still claim), and a DELTA output carries only what is new. Only a
CUMULATIVE or final output copies a completion's whole text and token list.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..model.tokenizer import Tokenizer
from ..sampling import RequestOutputKind, SamplingParams
from .detokenizer import IncrementalDetokenizer
from .input_processor import EngineRequest
from .outputs import CompletionOutput, Logprobs, RequestOutput, request_metrics
from ..core.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


class SequenceText:
    """One completion's text: detokenized token by token, cut at stop strings, released once.

    `released` pieces were handed out (or will be with the next delta); `pending` is produced
    text held back while a stop string could still begin in it (the longest stop string - 1 chars).
    """

    def __init__(self, detokenizer: IncrementalDetokenizer | None, params: SamplingParams) -> None:
        self.detokenizer = detokenizer
        self.params = params
        self.hold = max(map(len, params.stop), default=1) - 1
        self.released: list[str] = []
        self.pending = ""

    @property
    def text(self) -> str:
        """All the text so far, held-back tail included (joins the pieces: O(length))."""
        return "".join(self.released) + self.pending

    def append(self, seq: Sequence, now: float) -> bool:
        """Add the text of the token `seq` just appended. If a stop string now ends the text, cut it
        there, finish `seq` with that string as its stop reason (even if max_tokens ended it in this same
        step, as vLLM does) and return True."""
        return self.append_output(seq, seq.num_output_tokens - 1, True, now)

    def append_output(self, seq: Sequence, index: int, last: bool, now: float) -> bool:
        """`append` for output token `index` of `seq`; `last`: the last token its step appended (a speculative
        step appends kept drafts before it, lesson 14), the one a token stop rule may have ended it on."""
        if self.detokenizer is None:
            return False
        params, token_id = self.params, seq.output_token_ids[index]
        if last and seq.status is SequenceStatus.FINISHED_STOPPED:  # just now, by EOS or a stop token
            if params.include_stop_str_in_output:
                self.pending += self.detokenizer.add(token_id) + self.detokenizer.flush()
            return False  # as vLLM does, the stopping token's own text is not output
        new = self.detokenizer.add(token_id)
        self.pending += new
        if new and params.stop and index + 1 >= params.min_tokens:
            stop = self._find_stop(len(new))
            if stop is not None:
                seq.finish(SequenceStatus.FINISHED_STOPPED, now, stop)
                return True
        if last and seq.is_finished:  # by length: the rest of an incomplete character goes out too
            self.pending += self.detokenizer.flush()
        return False

    def _find_stop(self, num_new_chars: int) -> str | None:
        """A stop string that ends in the new text (it may begin in the held-back tail); cut the text there."""
        matches = []
        for stop in self.params.stop:
            position = self.pending.find(stop, max(0, len(self.pending) - num_new_chars - len(stop) + 1))
            if position >= 0:
                matches.append((position, stop))
        if not matches:
            return None
        position, stop = min(matches)
        self.pending = self.pending[: position + (len(stop) if self.params.include_stop_str_in_output else 0)]
        return stop

    def take_delta(self, finished: bool) -> str:
        """Text released since the last call; while running, the last `hold` characters stay back."""
        keep = 0 if finished else self.hold
        if len(self.pending) <= keep:
            return ""
        delta = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(delta):]
        self.released.append(delta)
        return delta


@dataclass
class ProcessedOutputs:
    """What `OutputProcessor.process` made of one step."""

    outputs: list[RequestOutput] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # ended here by a stop string: their blocks go back
    failed: list[str] = field(default_factory=list)  # requests whose output failed: every sequence must leave


@dataclass
class RequestState:
    """What the output processor keeps per request: its sequences, their text, and what was sent.

    Per completion, `num_tokens_sent` is the one "sent so far" cursor (its text is released with
    the same tokens), and `finish_sent` whether its final output went out.
    """

    request: EngineRequest
    sequences: list[Sequence]
    texts: list[SequenceText]
    logprobs: list[list[Logprobs]] | None
    num_tokens_sent: list[int]
    finish_sent: list[bool]
    prompt_logprobs: list[Logprobs | None] | None = None
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(self.finish_sent)


class OutputProcessor:
    """Keeps every live request's output state; `process` builds the outputs of one step."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(self, request: EngineRequest, sequences: list[Sequence]) -> None:
        params = request.params
        texts = [SequenceText(None if self.tokenizer is None else IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, params.skip_special_tokens), seq.params) for seq in sequences]
        self.requests[request.request_id] = RequestState(
            request, sequences, texts, [[] for _ in sequences] if params.logprobs is not None else None,
            [0] * len(sequences), [False] * len(sequences), [None] if params.prompt_logprobs is not None else None)

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def add_prompt_logprobs(self, request_id: str, start: int, entries: list[Logprobs]) -> None:
        """Logprobs of prompt tokens start + 1 ... from a prefill chunk (a recomputed chunk adds nothing new)."""
        state = self.requests.get(request_id)
        if state is None or state.prompt_logprobs is None:
            return
        known = len(state.prompt_logprobs)  # entries for tokens 0 .. known - 1
        state.prompt_logprobs += entries[max(0, known - 1 - start):]

    def process(self, request_ids: Iterable[str], logprobs: dict[Sequence, list[Logprobs]], now: float
                ) -> ProcessedOutputs:
        """Turn the new tokens of these requests into outputs: them, the sequences a stop string finished (whose
        blocks the scheduler must now free), and the requests that failed here."""
        processed = ProcessedOutputs()
        for request_id in request_ids:
            state = self.requests.get(request_id)
            if state is None:
                continue
            try:
                output = self._process_request(state, logprobs, now, processed.finished)
            except Exception:  # a fault in one request's text (a tokenizer bug) fails that request only
                logger.exception("output processing failed for request %s", request_id)
                # Every completion ends with an error, the waiting ones too (a preempted sibling, a fork not yet
                # made): the caller takes them out of the scheduler (`Scheduler.abort`), wherever they are.
                for seq in state.sequences:
                    if not seq.is_finished:
                        seq.finish(SequenceStatus.FINISHED_ERROR, now)
                state.finish_sent = [True] * len(state.sequences)
                output = self._output(state, {i: ("", []) for i in range(len(state.sequences))})
                processed.failed.append(request_id)
            if output is not None:
                processed.outputs.append(output)
            if state.finished:
                del self.requests[request_id]
        return processed

    def _process_request(self, state: RequestState, logprobs: dict[Sequence, list[Logprobs]], now: float,
                         finished_here: list[Sequence]) -> RequestOutput | None:
        news: dict[int, tuple[str, list[int]]] = {}  # completion -> (text delta, new token ids)
        for i, (seq, text) in enumerate(zip(state.sequences, state.texts)):
            has_new_token = seq.num_output_tokens > state.num_tokens_sent[i]
            if not has_new_token and not (seq.is_finished and not state.finish_sent[i]):
                continue
            if has_new_token:  # one token a step, or several when kept drafts came before it (lesson 14)
                sent, entries = state.num_tokens_sent[i], logprobs.get(seq, [])
                was_running = not seq.is_finished
                for index in range(sent, seq.num_output_tokens):
                    if state.logprobs is not None and index - sent < len(entries):
                        state.logprobs[i].append(entries[index - sent])
                    if text.append_output(seq, index, index == seq.num_output_tokens - 1, now):
                        seq.truncate_output(index + 1)  # a stop string ended it: later kept drafts go
                        if was_running:
                            finished_here.append(seq)
                        break
            new_ids = seq.output_token_ids[state.num_tokens_sent[i]:]
            state.num_tokens_sent[i] = seq.num_output_tokens
            state.finish_sent[i] = seq.is_finished
            news[i] = (text.take_delta(seq.is_finished), new_ids)
        return self._output(state, news) if news else None

    def _output(self, state: RequestState, news: dict[int, tuple[str, list[int]]]) -> RequestOutput | None:
        request, sequences = state.request, state.sequences
        kind = request.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not state.finished:
            return None
        delta_only = kind is RequestOutputKind.DELTA
        completions = []
        for i in sorted(news) if delta_only else range(len(sequences)):
            seq, (delta, new_ids) = sequences[i], news.get(i, ("", []))
            seq_logprobs = None if state.logprobs is None else state.logprobs[i]
            if delta_only:
                text, token_ids = delta, new_ids
                if seq_logprobs is not None:
                    seq_logprobs = seq_logprobs[len(seq_logprobs) - len(new_ids):]
            else:
                text, token_ids = state.texts[i].text, list(seq.output_token_ids)
                seq_logprobs = None if seq_logprobs is None else list(seq_logprobs)
            completions.append(CompletionOutput(
                index=seq.index, text=text, token_ids=token_ids, finish_reason=seq.status.finish_reason,
                stop_reason=seq.stop_reason, logprobs=seq_logprobs, text_delta=delta, token_ids_delta=new_ids))
        prompt_logprobs = None
        if state.prompt_logprobs is not None and not (delta_only and state.prompt_logprobs_sent):
            prompt_logprobs = state.prompt_logprobs
            state.prompt_logprobs_sent = True
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions,
                             state.finished, request_metrics(sequences, with_token_times=state.finished),
                             prompt_logprobs)
