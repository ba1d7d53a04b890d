"""llm_runtime: a small LLM inference engine, built one lesson at a time.

    from llm_runtime import LLM, SamplingParams
    llm = LLM()                                  # the bundled SmolLM2-135M-Instruct
    outputs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    print(outputs[0].outputs[0].text)
"""

from .block_manager import BlockAllocator, BlockManager
from .config import EngineConfig, ModelConfig, RopeConfig
from .detokenizer import IncrementalDetokenizer
from .device import resolve_device, resolve_dtype
from .engine import EngineStats, LLMEngine
from .generate import generate
from .kv_cache import ContiguousKVCache, PagedKVCache
from .llm import LLM
from .model import BUNDLED_MODEL_NAME, CausalLM, ModelLoadError, load_model, prepare_bundled_model
from .model_runner import ModelRunner
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampling import Sampler, SamplerOutput, SamplingParams
from .scheduler import ScheduledBatch, Scheduler, StepRecord
from .sequence import Sequence, SequenceStatus
from .static_batching import StaticBatchRunner
from .tokenizer import encode_chat, load_tokenizer

__all__ = [
    "BUNDLED_MODEL_NAME",
    "BlockAllocator",
    "BlockManager",
    "CausalLM",
    "CompletionOutput",
    "ContiguousKVCache",
    "EngineConfig",
    "EngineStats",
    "IncrementalDetokenizer",
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
    "encode_chat",
    "generate",
    "load_model",
    "load_tokenizer",
    "prepare_bundled_model",
    "resolve_device",
    "resolve_dtype",
]
