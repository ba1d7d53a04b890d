"""`LLM`: the offline API, shaped like vLLM's.

    from llm_runtime import LLM, SamplingParams
    with LLM() as llm:                            # the bundled SmolLM2-135M-Instruct
        outputs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=16))
    print(outputs[0].outputs[0].text)             # leaving the block freed the engine's KV pool
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import EngineConfig
from ..model import CausalLM
from ..model.tokenizer import Tokenizer
from ..sampling import RequestOutputKind, SamplingParams
from .engine import LLMEngine
from .input_processor import EngineRequest, Messages, Prompt
from .outputs import RequestOutput


class LLM:
    """Load a model and generate for many prompts at once with continuous batching."""

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "auto",
        quantization: str | None = None,
        **engine_options: object,
    ) -> None:
        """`model`: None (bundled), a folder or a hub id; `quantization`: None, "int8", "int4" or "gguf"
        (`load_model`, lesson 13); `engine_options`: EngineConfig fields."""
        engine = LLMEngine.from_pretrained(model, device=device, dtype=dtype, quantization=quantization,
                                           config=EngineConfig(**engine_options))  # type: ignore[arg-type]
        self.model, self.tokenizer, self.llm_engine, self._next_id = engine.model, engine.tokenizer, engine, 0

    @classmethod
    def from_model(cls, model: CausalLM, tokenizer: Tokenizer | None, *, owns_model: bool = False,
                   **engine_options: object) -> "LLM":
        """An LLM around an already loaded model (lessons and tests share one model this way). The engine
        leaves the model as it is unless asked (`prepack_weights=True` repacks its linear layers in place), or
        unless `owns_model`: the caller loaded it for this engine alone (a benchmark does), which may then
        change it as `LLM(...)` does (pack its weights, compile its forward pass)."""
        llm = cls.__new__(cls)
        llm._init(model, tokenizer, EngineConfig(**engine_options), owns_model=owns_model)  # type: ignore[arg-type]
        return llm

    def _init(self, model: CausalLM, tokenizer: Tokenizer | None, config: EngineConfig, owns_model: bool) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.llm_engine = LLMEngine(model, tokenizer, config, owns_model=owns_model)
        self._next_id = 0

    def shutdown(self) -> None:
        """Free the engine's KV pool (and, on CUDA, return it to the driver); generating afterwards raises.
        A notebook that is done with an engine calls this, or uses `with LLM(...) as llm:`, so that the
        next engine finds the memory free (on a GPU a second engine would otherwise find no room)."""
        self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of `prompts`.

        If a request fails inside the engine, its output has finish_reason "error"; the others are kept.
        """
        request_ids = self._add_requests(prompts, sampling_params, RequestOutputKind.FINAL_ONLY)
        final: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Generating", unit="req", disable=not use_tqdm) as progress:
            while self.llm_engine.has_unfinished_requests():
                for output in self.llm_engine.step():
                    if output.finished:
                        final[output.request_id] = output
                        progress.update(1)
        return [final[request_id] for request_id in request_ids]

    def generate_stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[tuple[int, RequestOutput]]:
        """Yield (prompt index, output) after every step that moved a request; `text_delta` holds the new text."""
        request_ids = self._add_requests(prompts, sampling_params)
        index_of = {request_id: i for i, request_id in enumerate(request_ids)}
        try:
            while self.llm_engine.has_unfinished_requests():
                for output in self.llm_engine.step():
                    yield index_of[output.request_id], output
        finally:  # the consumer stopped early: don't leave its requests running
            for request_id in request_ids:
                if request_id in self.llm_engine.requests:
                    self.llm_engine.abort_request(request_id)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, rendered with the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        render = self.llm_engine.input_processor.render_chat
        prompts = [{"prompt_token_ids": render(list(c))} for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _add_requests(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        output_kind: RequestOutputKind | None = None,
    ) -> list[str]:
        """Validate every prompt first, then add them all: one refused prompt adds nothing."""
        # One prompt (text, a dict, or a flat list of ids) or a list of prompts.
        single = isinstance(prompts, (str, dict)) or (
            isinstance(prompts, Sequence) and len(prompts) > 0 and all(isinstance(t, int) for t in prompts)
        )
        prompt_list: list[Prompt] = [prompts] if single else list(prompts)  # type: ignore[list-item]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompt_list)} prompts")
        if output_kind is not None:
            params_list = [replace(p, output_kind=output_kind) if isinstance(p, SamplingParams) else p
                           for p in params_list]
        requests: list[EngineRequest] = []
        for prompt, params in zip(prompt_list, params_list):
            requests.append(self.llm_engine.input_processor.process(str(self._next_id + len(requests)), prompt, params))
        self._next_id += len(requests)
        added: list[str] = []
        try:
            for request in requests:
                self.llm_engine.add_processed(request)
                added.append(request.request_id)
        except BaseException:  # nothing of this call stays in the engine
            for request_id in added:
                self.llm_engine.abort_request(request_id)
            raise
        return [request.request_id for request in requests]
