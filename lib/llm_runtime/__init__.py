"""llm_runtime: a small LLM inference engine, built one lesson at a time.

    from llm_runtime import load_model, generate, SamplingParams
    model, tokenizer = load_model()              # the bundled SmolLM2-135M-Instruct
    ids = tokenizer.encode("The capital of France is")
    print(tokenizer.decode(generate(model, ids, SamplingParams(temperature=0, max_tokens=8))))
"""

from .config import ModelConfig, RopeConfig
from .device import resolve_device, resolve_dtype
from .generate import generate
from .kv_cache import ContiguousKVCache
from .model import BUNDLED_MODEL_NAME, CausalLM, ModelLoadError, load_model, prepare_bundled_model
from .sampling import Sampler, SamplerOutput, SamplingParams
from .tokenizer import encode_chat, load_tokenizer

__all__ = [
    "BUNDLED_MODEL_NAME",
    "CausalLM",
    "ContiguousKVCache",
    "ModelConfig",
    "ModelLoadError",
    "RopeConfig",
    "Sampler",
    "SamplerOutput",
    "SamplingParams",
    "encode_chat",
    "generate",
    "load_model",
    "load_tokenizer",
    "prepare_bundled_model",
    "resolve_device",
    "resolve_dtype",
]
