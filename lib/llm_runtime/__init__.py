"""llm_runtime: a small LLM inference engine, built one lesson at a time.

    from llm_runtime import LLM, SamplingParams
    llm = LLM()                                  # the bundled SmolLM2-135M-Instruct
    outputs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    print(outputs[0].outputs[0].text)

The folders follow a request through the engine: `model/` (the decoder, its loader and tokenizer),
`attention/` (KV caches and attention over them), `sampling/`, `engine/` (scheduler, block manager,
model runner, `LLMEngine`, `LLM`), `serving/` (async engine, OpenAI-compatible server), `bench/`
(metrics, benchmark runners, roofline) and `lessons/` (helpers only the lessons use).
"""

from .attention import ContiguousKVCache, PagedKVCache
from .config import EngineConfig, ModelConfig, RopeConfig
from .device import DeviceProfile, device_profile, resolve_device, resolve_dtype
from .errors import EngineBusyError, EngineDeadError, InvalidRequestError
from .engine import (LLM, BlockAllocator, BlockManager, CompletionOutput, EngineStats, IncrementalDetokenizer,
                     LLMEngine, ModelRunner, RequestMetrics, RequestOutput, ScheduledBatch, Scheduler, Sequence,
                     SequenceStatus, StepRecord, generate)
from .lessons import StaticBatchRunner
from .model import BUNDLED_MODEL_NAME, CausalLM, ModelLoadError, load_model, load_reason, prepare_bundled_model
from .model.tokenizer import encode_chat, load_tokenizer
from .sampling import Sampler, SamplerOutput, SamplingParams, StructuredOutputsParams

__all__ = [
    "BUNDLED_MODEL_NAME",
    "BlockAllocator",
    "BlockManager",
    "CausalLM",
    "CompletionOutput",
    "ContiguousKVCache",
    "DeviceProfile",
    "EngineBusyError",
    "EngineConfig",
    "EngineDeadError",
    "EngineStats",
    "IncrementalDetokenizer",
    "InvalidRequestError",
    "LLM",
    "LLMEngine",
    "ModelConfig",
    "ModelLoadError",
    "ModelRunner",
    "PagedKVCache",
    "RequestMetrics",
    "RequestOutput",
    "RopeConfig",
    "Sampler",
    "SamplerOutput",
    "SamplingParams",
    "ScheduledBatch",
    "Scheduler",
    "Sequence",
    "SequenceStatus",
    "StaticBatchRunner",
    "StepRecord",
    "StructuredOutputsParams",
    "device_profile",
    "encode_chat",
    "generate",
    "load_model",
    "load_reason",
    "load_tokenizer",
    "prepare_bundled_model",
    "resolve_device",
    "resolve_dtype",
]
