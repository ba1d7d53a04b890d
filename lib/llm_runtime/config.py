"""Configuration dataclasses: what the model is (`ModelConfig`), parsed once from a Hugging Face config.

Every default lives here, once. Configs are frozen and validate in `__post_init__`, so code
that receives one can trust it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

# model_type in config.json -> the feature switches our one decoder needs for it.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding parameters (theta plus an optional scaling rule)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # Llama-3 frequency-dependent scaling; only read when rope_type == "llama3".
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_type {self.rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if not (self.theta > 0 and self.factor > 0):
            raise ValueError(f"rope theta and factor must be > 0, got {self.theta} and {self.factor}")

    def inverse_frequencies(self, head_dim: int) -> torch.Tensor:
        """theta^(-2i/d) for i < d/2, scaled by this config's rule (the rotary embedding's angles a position,
        per pair of channels: model/rope.py). Shape (head_dim // 2,), float32."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (self.theta**exponents)
        if self.rope_type == "linear":
            return inv_freq / self.factor
        if self.rope_type == "llama3":
            # Long wavelengths (low frequencies) are stretched by `factor`, short ones kept,
            # and the band between is interpolated smoothly.
            old_len = self.original_max_position_embeddings
            low_freq_wavelen = old_len / self.low_freq_factor
            high_freq_wavelen = old_len / self.high_freq_factor
            wavelen = 2 * math.pi / inv_freq
            scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
            smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
            return torch.where(is_medium, smoothed, scaled)
        return inv_freq

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "RopeConfig":
        """Read both spellings: transformers >= 5 `rope_parameters`, older `rope_theta` + `rope_scaling`."""
        params = dict(hf.get("rope_parameters") or {})
        scaling = dict(hf.get("rope_scaling") or {})
        merged = {**scaling, **params}
        theta = merged.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = merged.get("rope_type", merged.get("type", "default"))
        return cls(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(merged.get("factor", 1.0)),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
        )


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder: Llama 2/3, SmolLM2, Qwen2/2.5, Qwen3."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q, k and v projections
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k, before rotary
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise ValueError(f"rms_norm_eps must be a positive number, got {self.rms_norm_eps}")

    @property
    def num_queries_per_kv(self) -> int:
        """How many query heads share one key/value head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, dtype_size: int) -> int:
        """Bytes of K and V one token occupies across all layers: 2 x layers x kv heads x head dim x size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_size

    @classmethod
    def from_hf(cls, hf: dict[str, Any], generation: dict[str, Any] | None = None) -> "ModelConfig":
        """Build from a Hugging Face `config.json` dict (and `generation_config.json`, for EOS ids)."""
        model_type = hf.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            architectures = ", ".join(hf.get("architectures") or []) or "none listed"
            raise ValueError(
                f"unsupported architecture: model_type {model_type!r} (architectures: {architectures}); "
                f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if hf.get("use_sliding_window"):
            raise ValueError("unsupported: sliding-window attention (use_sliding_window=true in config.json)")
        num_heads = int(hf["num_attention_heads"])
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        eos = (generation or {}).get("eos_token_id", hf.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2's q/k/v projections always have a bias, whatever its config says.
            attention_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            eos_token_ids=eos_ids,
            bos_token_id=hf.get("bos_token_id"),
        )


# ------------------------------------------------------------------ speculative decoding
SPECULATIVE_METHODS = ("ngram", "draft")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Which proposer guesses the next tokens, and how many (vLLM's `speculative_config`, lesson 14).

    Given as vLLM takes it, a dict on `LLM(speculative_config=...)`, `EngineConfig` and `--speculative-config
    JSON` on `serve` and `bench`:

        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
        {"method": "draft", "model": "<folder or hub id>", "num_speculative_tokens": 3}
        {"method": "draft", "model": "self", "quantization": "gguf", "num_speculative_tokens": 3}
        {"method": "draft", "model": "self", "num_layers": 24, "num_speculative_tokens": 3}

    `"model": "self"` drafts with the target's own weights loaded again, quantized by `quantization` (on the
    CPU, the bundled model's own 4-bit copy: the same tokenizer, a fraction of the bytes per step). `num_layers`
    keeps only the draft's first layers, then its final norm and head (early exit, the draft of LayerSkip's
    self-speculation); "self" without a quantization then shares the target's own modules: no second copy.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None  # ngram: the longest suffix matched
    prompt_lookup_min: int | None = None  # ngram: the shortest
    model: str | None = None  # draft: a folder, a hub id, or "self"
    quantization: str | None = None  # draft: how the draft model's weights are loaded (lesson 13)
    num_layers: int | None = None  # draft: keep its first num_layers layers (early exit); None: all of them

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.num_speculative_tokens!r}")
        if self.method == "ngram":
            if self.model is not None or self.quantization is not None or self.num_layers is not None:
                raise ValueError("an ngram proposer takes no model, quantization or num_layers")
            lookup_max = 4 if self.prompt_lookup_max is None else self.prompt_lookup_max
            lookup_min = 1 if self.prompt_lookup_min is None else self.prompt_lookup_min
            if not (isinstance(lookup_max, int) and isinstance(lookup_min, int) and 1 <= lookup_min <= lookup_max):
                raise ValueError(f"need integers 1 <= prompt_lookup_min <= prompt_lookup_max, "
                                 f"got {lookup_min!r} and {lookup_max!r}")
            object.__setattr__(self, "prompt_lookup_max", lookup_max)
            object.__setattr__(self, "prompt_lookup_min", lookup_min)
        else:
            if not self.model:
                raise ValueError('a draft proposer needs "model": a folder, a hub id, or "self"')
            if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                raise ValueError("prompt_lookup_max and prompt_lookup_min are for the ngram method")
            if self.num_layers is not None and (isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int)
                                                or self.num_layers < 1):
                raise ValueError(f"num_layers must be a positive integer, got {self.num_layers!r}")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | Mapping[str, Any] | None") -> "SpeculativeConfig | None":
        """A config from vLLM's dict form (unknown keys refused by name), or None for no speculation."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if "method" not in value or "num_speculative_tokens" not in value:
            raise ValueError('speculative_config needs "method" and "num_speculative_tokens"')
        return cls(**value)


# The CPU's emulated device memory: 2 GiB, of which 90 % leaves about 1.2 GiB of KV pool for the bundled
# model in float32 (its weights take 0.5 GiB); a second engine alive beside it finds no room, as on a GPU.
DEFAULT_CPU_DEVICE_MEMORY = 2 << 30

# Attention backends by name (attention/selector.py holds the classes); "auto" picks by device and
# what is installed. The environment variable overrides "auto" (read once, when an engine is built).
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # EngineConfig.kv_cache_dtype (attention/kv_quant.py)
ATTENTION_BACKENDS = ("auto", "torch-gather", "blockwise", "cpu", "flex", "triton", "flash-attn")
ATTENTION_BACKEND_ENV = "LLM_RUNTIME_ATTENTION_BACKEND"


@dataclass(frozen=True)
class EngineConfig:
    """How the engine schedules and how much KV memory it has.

    The KV pool is `num_kv_blocks` blocks of `block_size` tokens. Its size comes from, in order:
    `num_kv_blocks` if given; else `kv_cache_memory` bytes; else the device's memory times
    `gpu_memory_utilization`, minus what the process already holds (on CUDA profiled, on the CPU
    counted against an emulated device of `cpu_device_memory` bytes), and never more than
    `max_num_seqs` full-length sequences can use (`worker/kv_budget.py`).
    """

    max_num_seqs: int = 32  # sequences running at once (decode batch size)
    max_num_batched_tokens: int = 2048  # tokens in one forward pass, prefill chunks and decodes together
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_chunked_prefill: bool = True  # split a long prompt across steps to fit the token budget
    seed: int = 0  # generator for requests without their own seed
    record_steps: bool = False  # keep a StepRecord per step (lessons plot timelines from them)
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # the pool size in blocks, if set
    kv_cache_memory: int | None = None  # the pool size in bytes, if set (and num_kv_blocks is not)
    gpu_memory_utilization: float = 0.9  # fraction of device memory the engine may use, weights included
    cpu_device_memory: int = DEFAULT_CPU_DEVICE_MEMORY  # the CPU's emulated device memory (the KV budget's rule)
    enable_prefix_caching: bool = True  # reuse computed blocks of equal prefixes across requests
    # How the pool stores keys and values: "auto" (the model's dtype), "int8" (a scale and zero per layer, KV
    # head and channel, calibrated at start; keys turned back by the rotary embedding, so the scales hold at any
    # position) or "fp8" (e4m3): 4x the tokens of a float32 pool in the same bytes (attention/kv_quant.py,
    # kv_calibration.py).
    kv_cache_dtype: str = "auto"
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS (lesson 11)
    # The model's linear weights repacked in place for oneDNN (model/packed_linear.py; the CPU, float32 and
    # bfloat16): faster linear layers, the same memory but for a tied head's copy. None: if the engine owns the
    # model (LLM(...)).
    prepack_weights: bool | None = None
    # The layers' pointwise parts (RMSNorm, rotary, SiLU-and-multiply) through torch.compile (model/pointwise.py).
    # None: where it wins, on CUDA, if the engine owns the model. enforce_eager=True never compiles.
    compile_pointwise: bool | None = None
    # The whole forward pass and the logits as one torch.compile graph, for the steps whose attention runs inside
    # it (worker/compiled_forward.py; the cpu backend over a full-precision pool). None: on the CPU, if the engine
    # owns the model (LLM(...), serve, bench). The engine compiles when it is built; enforce_eager=True never does.
    compile_model: bool | None = None
    # Decode-only steps replayed from CUDA graphs captured per batch-size bucket (worker/cuda_graphs.py).
    # None: on CUDA, where the attention backend can be captured, unless enforce_eager.
    cuda_graphs: bool | None = None
    enforce_eager: bool = False  # as vLLM's: no torch.compile, no CUDA graphs; every step runs eagerly
    # Steps of a few tokens (decodes, drafts verified, short chunks) as one native call, every layer inside one
    # OpenMP parallel region (worker/native_step.py, lesson 19): CPU models in bfloat16 with int4 layers (the GGUF's
    # own, quantization "gguf" or "int4"), and dense float32 and bfloat16 ones (whose linears the engine then leaves
    # unpacked unless prepack_weights=True). None: wherever it applies, unless enforce_eager.
    native_step: bool | None = None
    # Batch invariance (model/batch_invariant.py, lesson 16): a request's logits bitwise the same whatever else runs
    # in its steps, however its prompt is chunked or cached, with or without speculation, in a prefill chunk or a
    # decode step. On the CPU: packed linears (a lone row as two, or calls of a fixed row count: measured at start),
    # every attention row through the C kernel; on CUDA: Triton kernels with fixed reduction orders for the
    # linears, RMSNorm and attention. No torch.compile and no CUDA graphs either way.
    batch_invariant: bool = False
    # Tensor parallelism (distributed/, lesson 17): the model's layers split over this many ranks, rank 0 this
    # process (scheduler, block manager, sampler), the others worker processes the engine starts; gloo on the
    # CPU, NCCL on CUDA (one GPU per rank). Not yet with the compiled forward, CUDA graphs or an 8-bit KV cache.
    tensor_parallel_size: int = 1
    tensor_parallel_timeout_s: float = 30.0  # a collective inside a step waiting longer fails the engine (a hung rank)
    # Limits on what one request may ask for (the input processor refuses more, naming the field).
    max_logprobs: int = 20  # top logprobs per token (`logprobs`, `prompt_logprobs`), as vLLM's default
    max_num_stop_strings: int = 16  # stop strings per request
    max_stop_string_len: int = 256  # characters in one stop string (the text held back while streaming)
    check_invariants: bool = False  # check the scheduler's books after every step (the test suite turns it on)
    # Speculative decoding (spec_decode/, lesson 14): vLLM's dict, e.g. {"method": "ngram", "num_speculative_tokens":
    # 4}, parsed into a SpeculativeConfig; None: one token per sequence per step.
    speculative_config: SpeculativeConfig | Mapping[str, Any] | None = None
    # Structured output (structured_output/, lesson 15). Jump-forward: up to this many tokens the grammar forces
    # (a schema's next key) go through the speculative path as drafts the model verifies; 0 turns it off.
    max_forced_tokens: int = 8
    max_grammar_chars: int = 65536  # a schema, regex or grammar longer than this is refused, not compiled
    grammar_compile_timeout_s: float = 10.0  # a constraint that takes longer to compile is refused
    max_pending_grammar_compiles: int = 8  # distinct constraints compiling at once; more are refused as busy (503)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_num_stop_strings",
                     "max_stop_string_len", "max_grammar_chars", "max_pending_grammar_compiles"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}), so every running sequence can decode each step"
            )
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2 or None, got {self.max_model_len!r}")
        for name in ("num_kv_blocks", "kv_cache_memory", "cpu_device_memory"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")
        for name in ("max_logprobs", "max_forced_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        size = self.tensor_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
        timeout = self.tensor_parallel_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ValueError(f"tensor_parallel_timeout_s must be a number of seconds > 0, got {timeout!r}")
        if size > 1:
            clashes = [name for name in ("cuda_graphs", "native_step") if getattr(self, name)]
            if self.batch_invariant:
                clashes.append("batch_invariant=True")
            if clashes:
                raise ValueError(f"tensor_parallel_size={size} does not run yet with {', '.join(clashes)}")
        if self.batch_invariant:
            clashes = [name for name, value in (("compile_model", self.compile_model),
                                                ("compile_pointwise", self.compile_pointwise),
                                                ("cuda_graphs", self.cuda_graphs),
                                                ("native_step", self.native_step)) if value]
            if self.prepack_weights is False:
                clashes.append("prepack_weights=False")
            if clashes:
                raise ValueError(f"batch_invariant=True runs no compiled code or CUDA graphs, and packed linears on "
                                 f"the CPU; it cannot be combined with {', '.join(clashes)}")
        timeout = self.grammar_compile_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ValueError(f"grammar_compile_timeout_s must be a number of seconds > 0, got {timeout!r}")
        for name in ("prepack_weights", "compile_pointwise", "compile_model", "cuda_graphs", "native_step"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True, False or None, got {getattr(self, name)!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be True or False, got {self.enforce_eager!r}")
        if self.enforce_eager and self.compile_pointwise:
            raise ValueError("compile_pointwise=True asks for torch.compile, which enforce_eager=True forbids")
        if self.enforce_eager and self.compile_model:
            raise ValueError("compile_model=True asks for torch.compile, which enforce_eager=True forbids")
        if self.compile_model and self.compile_pointwise:
            raise ValueError("compile_model=True compiles the pointwise parts with the rest of the forward pass; "
                             "compile_pointwise=True asks for them alone")
        if self.enforce_eager and self.native_step:
            raise ValueError("native_step=True runs steps outside the model's modules, which enforce_eager=True forbids")
        if self.enforce_eager and self.cuda_graphs:
            raise ValueError("cuda_graphs=True asks for CUDA graphs, which enforce_eager=True forbids")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if not (isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
