"""The plan: every choice of how the model runs on its device, made once, with the reason for each.

    plan = choose_plan(config, model, owns_model=True)
    print(plan.describe())        # attention backend, packing, compiling, graphs, native step, ... and why

`choose_plan` reads the `EngineConfig`, the model (what its layers are) and the device's profile (`device.py`:
the one place that knows what a T4, an H100 or this CPU can run), and nothing else. Every worker prepares its
model from the plan (`worker.py`), the model runner runs the paths it names, and no step asks the device again:
where a T4 and an H100 part ways is the difference of two plans, which `describe()` prints.

A choice the config makes (True or False) is checked here and refused with the reason when it cannot run; a
choice it leaves to the engine (None) is made here by the rules in each helper's docstring.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from ..attention.backend import AttentionBackend
from ..attention.selector import select_backend
from ..config import EngineConfig
from ..device import DeviceProfile, device_profile
from ..model import CausalLM
from ..model.batch_invariant import batch_invariant_unsupported_reason
from ..model.packed_linear import packing_unsupported_reason
from .compiled_forward import compiled_forward_unavailable_reason
from .cuda_graphs import graphs_unavailable_reason
from .native_step import native_step_unavailable_reason, uses_dense_weights

POINTWISE_OPS = ("compiled", "eager", "as is")  # what the worker does to the layers' pointwise parts


@dataclass(frozen=True)
class ModelPlan:
    """How one engine's model runs: chosen by `choose_plan`, read by every worker (rank 0's sends it to the others
    as JSON). `reasons` says why, choice by choice."""

    device: str
    dtype: str
    profile: str  # DeviceProfile.describe(): the device as the plan saw it
    attention_backend: str
    block_size: int
    kv_cache_dtype: str
    batch_invariant: bool  # model/batch_invariant.py's ops; with Triton attention, its kernels for the linears too
    invariant_triton: bool
    prepack_weights: bool  # linear weights repacked for oneDNN, in place (model/packed_linear.py)
    pointwise_ops: str  # one of POINTWISE_OPS
    compile_model: bool  # the forward pass as one compiled graph (compiled_forward.py), compiled at set-up
    cuda_graphs: bool  # decode steps captured per batch-size bucket (cuda_graphs.py)
    native_step: bool  # short steps as one native call (native_step.py)
    native_dense_weights: bool  # the native step reads plain dense weights (so the linears stay unpacked)
    keep_freed_host_memory: bool  # the CPU's allocator keeps freed pages (host_memory.py)
    reasons: tuple[tuple[str, str], ...] = ()

    def reason(self, choice: str) -> str:
        return dict(self.reasons).get(choice, "")

    def describe(self) -> str:
        """One line per choice: its value and why (`stats()` carries it; `serve --verbose` logs it)."""
        lines = [f"plan for {self.profile}: {self.dtype}, blocks of {self.block_size} tokens"]
        for name in ("attention_backend", "kv_cache_dtype", "batch_invariant", "prepack_weights", "pointwise_ops",
                     "compile_model", "cuda_graphs", "native_step"):
            lines.append(f"  {name:18} {getattr(self, name)!s:9} {self.reason(name)}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        value = asdict(self)
        value["reasons"] = [list(pair) for pair in self.reasons]
        return value

    @classmethod
    def from_json(cls, value: object) -> "ModelPlan":
        """The plan rank 0 sent (a JSON object of exactly these fields, each of its type); RuntimeError otherwise."""
        names = {f.name: f for f in fields(cls)}
        if not isinstance(value, dict) or set(value) != set(names):
            raise RuntimeError(f"a worker expected a plan, got {value!r}")
        reasons = value["reasons"]
        if not (isinstance(reasons, list) and all(isinstance(r, list) and len(r) == 2 and all(isinstance(x, str) for x in r)
                                                  for r in reasons)):
            raise RuntimeError("a plan's reasons must be pairs of strings")
        for name, f in names.items():
            kind = {"bool": bool, "int": int, "str": str}.get(str(f.type))
            if kind is not None and not isinstance(value[name], kind):
                raise RuntimeError(f"a plan's {name} must be a {f.type}, got {value[name]!r}")
        if value["pointwise_ops"] not in POINTWISE_OPS:
            raise RuntimeError(f"a plan's pointwise_ops must be one of {POINTWISE_OPS}")
        return cls(**{**value, "reasons": tuple((a, b) for a, b in reasons)})

    def backend(self, model: CausalLM) -> AttentionBackend:
        """The attention backend the plan names, for `model` (rank 0's or a worker rank's shard)."""
        return select_backend(self.attention_backend, model.device, model.dtype, None, self.block_size,
                              batch_invariant=self.batch_invariant)


def choose_plan(config: EngineConfig, model: CausalLM, *, owns_model: bool,
                environ: Mapping[str, str] | None = None, profile: DeviceProfile | None = None) -> ModelPlan:
    """The plan for `model` (rank 0's shard under tensor parallelism) under `config`. `owns_model`: the engine
    loaded the model for itself (`LLM(...)`, `serve`, `bench`), so it may change it in place. `environ`: where
    LLM_RUNTIME_ATTENTION_BACKEND may override "auto" (the process's environment by default). ValueError for a
    choice the config makes that cannot run here, with the reason."""
    environ = os.environ if environ is None else environ
    profile = profile if profile is not None else device_profile(model.device)
    backend = select_backend(config.attention_backend, model.device, model.dtype, environ, config.block_size,
                             batch_invariant=config.batch_invariant)
    reasons: dict[str, str] = {"attention_backend": "asked" if config.attention_backend != "auto"
                               else "the first of this device's order that runs here (lesson 11)",
                               "kv_cache_dtype": "asked" if config.kv_cache_dtype != "auto" else "the model's dtype"}
    invariant_triton = config.batch_invariant and backend.name == "triton"
    if config.batch_invariant:
        reason = batch_invariant_unsupported_reason(model, triton=invariant_triton)
        if reason is not None:
            raise ValueError(reason)
        reasons["batch_invariant"] = "asked" + (": Triton kernels for the linears too" if invariant_triton else "")
    native, reasons["native_step"] = _native_step(config, model)
    dense_native = native and uses_dense_weights(model)
    pack, reasons["prepack_weights"] = _prepack_weights(config, model, owns_model, invariant_triton, dense_native)
    pointwise, reasons["pointwise_ops"] = _pointwise_ops(config, model, owns_model)
    graphs, reasons["cuda_graphs"] = _cuda_graphs(config, model, backend)
    compiled, reasons["compile_model"] = _compile_model(config, model, owns_model, backend, profile)
    return ModelPlan(
        device=str(model.device), dtype=str(model.dtype).removeprefix("torch."), profile=profile.describe(),
        attention_backend=backend.name, block_size=config.block_size, kv_cache_dtype=config.kv_cache_dtype,
        batch_invariant=config.batch_invariant, invariant_triton=invariant_triton, prepack_weights=pack,
        pointwise_ops=pointwise, compile_model=compiled, cuda_graphs=graphs, native_step=native,
        native_dense_weights=dense_native, keep_freed_host_memory=model.device.type == "cpu",
        reasons=tuple(reasons.items()))


def _native_step(config: EngineConfig, model: CausalLM) -> tuple[bool, str]:
    """Short steps as one native call (native_step.py): when the config says True (or None, and the model and pool
    are ones it covers); never with enforce_eager, batch invariance or tensor parallelism."""
    wanted = config.native_step
    if wanted is False or config.enforce_eager or config.batch_invariant:
        return False, "asked not to (native_step=False, enforce_eager or batch_invariant)"
    if config.tensor_parallel_size > 1:
        return False, "a tensor-parallel shard (the config refuses native_step=True with it)"
    reason = native_step_unavailable_reason(model, config.kv_cache_dtype)
    if wanted and reason is not None:
        raise ValueError(f"native_step=True, but {reason}")
    return reason is None, "asked" if wanted else (reason or "the model and pool are ones it covers")


def _prepack_weights(config: EngineConfig, model: CausalLM, owns_model: bool, invariant_triton: bool,
                     dense_native: bool) -> tuple[bool, str]:
    """Repack the linear weights for oneDNN, in place: when the config says True, or says None and the engine owns
    the model (or runs it batch-invariant) and packing applies here, unless a native step over dense layers reads
    the plain weights (packed, it would need a plain copy of each)."""
    wanted = config.prepack_weights
    reason = packing_unsupported_reason(model)
    if invariant_triton:  # the invariant Triton matrix multiply replaces the model's nn.Linear modules
        if wanted:
            raise ValueError("prepack_weights=True, but batch_invariant=True with Triton attention multiplies by "
                             "Triton kernels, not packed weights")
        return False, "the invariant Triton kernels multiply the plain weights"
    if wanted is None:
        if reason is not None:
            return False, reason
        if dense_native:
            return False, "the native step reads the plain weights"
        if not (owns_model or config.batch_invariant):
            return False, "a model passed in is left as it is"
        return True, "the engine owns the model" if owns_model else "batch invariance packs with a measured rule"
    if wanted and reason is not None:
        raise ValueError(f"prepack_weights=True, but {reason}")
    return wanted, "asked"


def _pointwise_ops(config: EngineConfig, model: CausalLM, owns_model: bool) -> tuple[str, str]:
    """The layers' pointwise parts through torch.compile (model/pointwise.py): when the config says True, or says
    None and the engine owns the model on CUDA (on the CPU it measured no faster); never with enforce_eager. A model
    an earlier engine compiled is set back to eager when this config asks for eager."""
    eager = config.enforce_eager or config.batch_invariant
    wanted = config.compile_pointwise
    if wanted is None:
        wanted = owns_model and model.device.type == "cuda" and not eager
        if wanted:
            return "compiled", "the engine owns a CUDA model"
        return ("eager", "enforce_eager or batch_invariant") if eager else ("as is", "not by itself on the CPU")
    if wanted:
        return "compiled", "asked"
    return "eager", "asked not to (compile_pointwise=False)"


def _cuda_graphs(config: EngineConfig, model: CausalLM, backend: AttentionBackend) -> tuple[bool, str]:
    """Decode steps captured in CUDA graphs (cuda_graphs.py): when the config says True, or says None and this
    device and attention backend allow it; never with enforce_eager, batch invariance or tensor parallelism."""
    if config.batch_invariant or config.tensor_parallel_size > 1:
        return False, "not with batch invariance or tensor parallelism (not yet run on a GPU that way)"
    wanted = config.cuda_graphs
    reason = graphs_unavailable_reason(model.device, backend)
    if reason is None and config.kv_cache_dtype != "auto":
        reason = "a quantized KV cache is read through a copy of each step's blocks, chosen on the host"
    if wanted is None:
        if config.enforce_eager:
            return False, "enforce_eager"
        return reason is None, reason or "this device and attention backend allow it"
    if wanted and reason is not None:
        raise ValueError(f"cuda_graphs=True, but {reason}")
    return wanted, "asked" if wanted else "asked not to (cuda_graphs=False)"


def _compile_model(config: EngineConfig, model: CausalLM, owns_model: bool, backend: AttentionBackend,
                   profile: DeviceProfile) -> tuple[bool, str]:
    """The forward pass as one compiled graph (compiled_forward.py): when the config says True, or says None and
    the engine owns a CPU model whose attention backend allows it; never with enforce_eager. With
    tensor_parallel_size > 1 only when it says True: every rank compiles its own graph, at once (on a small CPU the
    ranks' compilers share its cores for minutes). Not by itself on a CPU playing a GPU (LLM_RUNTIME_DEVICE_PROFILE):
    the GPU would not compile the forward pass this way, and the compile costs 10-20 s an engine that the played
    run would spend on nothing the GPU does."""
    if config.batch_invariant:
        return False, "batch invariance runs no compiled code"  # the config refuses compile_model=True with it
    wanted = config.compile_model
    reason = compiled_forward_unavailable_reason(backend, config.kv_cache_dtype)
    if wanted is None:
        if config.tensor_parallel_size > 1:
            return False, "tensor parallelism compiles only when asked"
        if model.device.type != "cpu":
            return False, "on CUDA the pointwise parts compile and decode steps replay graphs instead"
        if profile.is_gpu:
            return False, f"not by itself on {profile.describe()}"
        if reason is not None:
            return False, reason
        if config.enforce_eager or config.compile_pointwise is True:
            return False, "enforce_eager or compile_pointwise=True"
        if not owns_model:
            return False, "a model passed in is left as it is"
        return True, "the engine owns a CPU model whose attention runs inside the graph"
    if wanted and reason is not None:
        raise ValueError(f"compile_model=True, but {reason}")
    return wanted, "asked" if wanted else "asked not to (compile_model=False)"
