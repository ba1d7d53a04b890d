"""The forward pass as one `torch.compile` graph: the CPU's way out of Python between kernels (lesson 12).

On a GPU, CUDA graphs take the Python out of a decode step (cuda_graphs.py). A CPU has no graph to
replay, but its overhead is of the same kind: a one-sequence decode step of the bundled model is about
1,200 small PyTorch operations (each norm, rotary, residual add and cast its own call, a few
microseconds of dispatch and its own pass over memory) around 121 matrix multiplies, inside the Python
of 30 layers' modules. `torch.compile` traces the whole forward pass and the logits once: inductor fuses
the pointwise operations into a few generated C++ loops per layer, and what is left of a step is one
call that runs the graph's kernels back to back.

What the tracer must not meet, and how this keeps it out:
- code it cannot see into (ctypes calls into this package's C kernels): each is one PyTorch operator
  (`native/operators.py`), which the graph keeps as one node. A layer's attention is the backend's
  `attend_compiled` (for the `cpu` backend, `cpu_paged_attention`: store the step's keys and values,
  attend every row); the quantized products (`int4_matmul`, `q8_matmul_t`) and oneDNN's packed product
  (`packed_linear`) are operators too. The two called most, `cpu_paged_attention` and `int4_matmul`, are
  also registered from C++ (native/cpp_operators.py): built and loaded here before the first trace, and
  the graph calls them without entering Python where they build;
- host decisions that change from step to step (they would recompile, or be frozen in): the attention
  plan is made on the host before the graph runs, and the graph reads it as tensors
  (`AttentionBackend.compiled_inputs`); a kernel chosen by row count is chosen inside its operator;
- shapes: the step's sizes (tokens, kernel rows, block-table width, sampled rows, and the pool's number of
  blocks) are symbols the graph never specializes, not even for a size of 0 or 1 (`mark_unbacked`), so
  one graph serves a one-token decode and a 512-token prefill chunk alike.

What a call costs besides its kernels: dynamo checks the graph's guards before each one, about 5,200 for the
bundled model, most of them on the modules (their hook dictionaries, attributes and types): 0.7 ms of a
step on the 2-core CI machine. So each kind of model gets its own copy of `_forward` (`model_kind`, a
digest of everything about the modules a trace reads), and the copy's graph skips the module guards
(0.27 ms). So a model changed after the engine is built (a hook registered, a layer swapped) is not seen:
build the engine after the model is final. And inductor's generated
loops run on one thread: at decode each handles one row, where a parallel region costs more than it
saves. With both, the bundled model's native 4-bit batch-1 step went from 2.84-2.90x float32's speed to
3.05-3.14x (four runs of each, alternated).

A step runs compiled when its attention can (the `cpu` backend: no prefill chunk longer than its kernel
takes) and no request of the step wants prompt logprobs (they need every position's hidden state);
other steps run eagerly, through the same modules. The first call compiles: 35-60 s for the bundled
model on a 2-core CPU; inductor's cache on disk makes it about 10 s in a later process, and later engines
in the same process (on a model of the same kind) find the graph ready. So the engine warms the graph up
when it is built (`warm_up`), as it captures CUDA graphs there.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import types

import torch

from ..attention import cpu_kernels
from ..attention.backend import AttentionBackend, PagedAttentionStep
from ..attention.kv_cache import PagedKVCache
from ..attention.metadata import AttentionMetadata
from ..model import CausalLM, quantized_kernels, quantized_linear
from ..native import cpp_operators
from ..native.build import FLAG_SETS, KernelUnavailable, build_torch_library
from .input_batch import ModelInput

logger = logging.getLogger(__name__)
RECOMPILE_LIMIT = 64  # graphs of `_forward` one process may hold (kinds of model, not step shapes)


def compiled_forward_unavailable_reason(backend: AttentionBackend, kv_cache_dtype: str) -> str | None:
    """None when this engine's steps can run as a compiled forward pass; otherwise why not."""
    if type(backend).compiled_inputs is AttentionBackend.compiled_inputs:
        return f"the {backend.name} attention backend does not run inside a compiled forward pass"
    if kv_cache_dtype != "auto":
        return "an 8-bit KV pool is written by PyTorch operations on the host's choice of slots"
    return None

@functools.cache
def load_cpp_operators() -> str | None:
    """Build (the first time on this machine) and load the C++ twins of the attention and int4 operators
    (native/cpp_operators.py); None when they are loaded, else why not. Called once per process; later calls
    return the first answer."""
    reason = cpu_kernels.kernel_unavailable_reason() or quantized_kernels.kernels_unavailable_reason()
    if reason is not None:
        return reason
    sources = (*(cpu_kernels.SOURCE_DIR / name for name in cpu_kernels.COMPILED),
               *(quantized_kernels.SOURCE_DIR / name for name in quantized_kernels.SOURCES))
    try:
        path = build_torch_library("operators", cpp_operators.SOURCE, sources,
                                   {"DENSE_ROWS": quantized_linear.DENSE_ROWS}, FLAG_SETS)
        cpp_operators.register_cpp_operators(path, {"int4_matmul": quantized_linear.int4_matmul_fake,
                                                    "cpu_paged_attention": cpu_kernels.cpu_paged_attention_fake})
    except (KernelUnavailable, OSError) as error:
        logger.info("the compiled forward pass calls the Python operators: %s", error)
        return str(error)
    return None


class _TracedAttention:
    """The model's `KVCache` protocol inside the graph: each layer's attention is one `attend_compiled`."""

    def __init__(self, backend: AttentionBackend, cache: PagedKVCache, slot_mapping: torch.Tensor,
                 plan: tuple[torch.Tensor, ...]) -> None:
        self.backend, self.cache, self.slot_mapping, self.plan = backend, cache, slot_mapping, plan

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (1, H, N, d), k, v (1, KV, N, d) -> (1, H, N, d), as `PagedAttentionStep.attend`."""
        query, key, value = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)  # (N, heads, d)
        out = self.backend.attend_compiled(query, key, value, self.cache.keys[layer_idx], self.cache.values[layer_idx],
                                           self.slot_mapping, *self.plan)  # (N, H, d)
        return out.transpose(0, 1)[None]

    def advance(self, num_new_tokens: int) -> None:
        """Nothing to do, as for `PagedAttentionStep`."""


class CompiledForward:
    """The model's forward pass and logits over the paged pool, compiled once for every step shape."""

    def __init__(self, model: CausalLM, kv_cache: PagedKVCache, backend: AttentionBackend) -> None:
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.num_runs = 0  # steps that ran compiled
        # Before the first trace: the layers then call the C++ operators (native/cpp_operators.py), or say why not.
        self.cpp_operators_unavailable_reason = (load_cpp_operators() if model.device.type == "cpu"
                                                 else "the C++ operators serve CPU models")
        for pool in (*kv_cache.keys, *kv_cache.values):  # the pool's size too: engines of any pool share a graph
            _mark_unbacked(pool, (0,))  # (inductor's cache on disk serves all of them)
        # Dynamic: the sizes marked in `_call`. Without the size asserts: the graph checks no output's strides, as
        # this package's operators make their outputs the strides their fake versions promise. No guards on the
        # modules: `_forward_for` gives each kind of model its own copy of `_forward`, so the graph a copy holds
        # was traced from modules equal to these. One thread for the generated pointwise loops (module docstring).
        forward = types.MethodType(_forward_for(model_kind(model)), self)
        self._compiled = torch.compile(forward, fullgraph=True, dynamic=False, options={
            "size_asserts": False, "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
            "cpp.threads": 1})
        self._recompile_limit = torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT)  # a reusable patch

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 logits_indices: torch.Tensor, *plan: torch.Tensor) -> torch.Tensor:
        """What the graph holds: input_ids, positions (1, N) -> logits (R, vocab) of the rows `logits_indices`."""
        num_tokens = input_ids.shape[1]
        torch._check(positions.shape[1] == num_tokens)
        torch._check(slot_mapping.shape[0] == num_tokens)
        attention = _TracedAttention(self.backend, self.kv_cache, slot_mapping, plan)
        hidden = self.model(input_ids, attention, positions)  # type: ignore[arg-type]  # (1, N, hidden)
        return self.model.compute_logits(hidden[0, logits_indices])  # (R, vocab)

    def plan_for(self, step: PagedAttentionStep) -> tuple[torch.Tensor, ...] | None:
        """The step's attention plan as the graph reads it; None when its attention cannot run compiled."""
        return self.backend.compiled_inputs(step.plan, self.kv_cache.num_blocks)

    def run(self, model_input: ModelInput, step: PagedAttentionStep,
            plan: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor | None:
        """The step's logits (R, vocab) from the graph; None when its attention cannot run compiled. `plan`: the
        step's `plan_for`, when the caller has made it."""
        plan = plan if plan is not None else self.plan_for(step)
        if plan is None:
            return None
        logits = self._call(model_input.input_ids, model_input.positions, model_input.metadata.slot_mapping,
                            model_input.logits_indices, plan)
        self.num_runs += 1
        return logits

    def warm_up(self) -> None:
        """Compile now, on a one-token step that writes nowhere (slot -1) and reads one key."""
        device = self.model.device
        with torch.inference_mode():  # the tensors of real steps are inference tensors: a guard tells them apart
            metadata = AttentionMetadata.build([[0]], [0], [1], block_size=self.kv_cache.block_size, device=device)
            plan = self.backend.compiled_inputs(self.backend.plan(metadata), self.kv_cache.num_blocks)
            assert plan is not None, "a one-token step always runs compiled"
            ids, positions = (torch.zeros(1, 1, dtype=torch.int64, device=device) for _ in range(2))  # (1, 1) each
            self._call(ids, positions, torch.full((1,), -1, dtype=torch.int64, device=device),
                       torch.zeros(1, dtype=torch.int64, device=device), plan)

    def _call(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
              logits_indices: torch.Tensor, plan: tuple[torch.Tensor, ...]) -> torch.Tensor:
        for tensor, dims in ((input_ids, (1,)), (positions, (1,)), (slot_mapping, (0,)), (logits_indices, (0,))):
            _mark_unbacked(tensor, dims)
        for tensor in plan:
            _mark_unbacked(tensor, tuple(range(tensor.dim())))
        # One graph serves every step of every engine on models of one kind (the compiled code belongs to the kind's
        # copy of `_forward`, the tensors are its inputs); the limit stays above dynamo's default of 8 graphs a
        # code object, for a copy that meets other backends or pools' dtypes.
        with self._recompile_limit:
            return self._compiled(input_ids, positions, slot_mapping, logits_indices, *plan)


def model_kind(model: torch.nn.Module) -> str:
    """Everything about the model's modules that a trace reads, as a digest: each module's path and class, its
    attributes (numbers, shapes, configs, the pointwise operations it calls, its hooks), and each
    parameter's and buffer's shape, strides, dtype and device. Two models of one kind differ only in their
    tensors' values, which the graph takes as inputs."""
    def describe(value: object) -> str:
        if isinstance(value, torch.Tensor):
            return f"tensor{tuple(value.shape)}{value.stride()}{value.dtype}{value.device}{value.requires_grad}"
        if isinstance(value, (list, tuple)):
            return type(value).__name__ + "(" + ", ".join(map(describe, value)) + ")"
        if isinstance(value, dict):  # hooks (an OrderedDict each): what they hold
            return "{" + ", ".join(f"{key!r}: {describe(item)}" for key, item in value.items()) + "}"
        return repr(value)

    lines = []
    for path, module in model.named_modules():
        cls = type(module)
        lines.append(f"{path} {cls.__module__}.{cls.__qualname__}")
        lines.extend(f"  {key} = {describe(value)}" for key, value in sorted(vars(module).items())
                     if key not in ("_modules", "_non_persistent_buffers_set"))  # a set: no stable order
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


# One copy of `CompiledForward._forward` per kind of model (`model_kind`), made once per process. dynamo keeps
# its compiled graphs on a function's code object, so each copy holds the graph of one kind; engines on models
# of that kind share it, and its guards need not look at the modules, which `model_kind` already compared.
_FORWARDS: dict[str, types.FunctionType] = {}


def _forward_for(kind: str) -> types.FunctionType:
    if kind not in _FORWARDS:
        original = CompiledForward._forward
        code = original.__code__.replace(co_name=f"_forward_{len(_FORWARDS)}")  # a new code object
        _FORWARDS[kind] = types.FunctionType(code, original.__globals__, code.co_name, original.__defaults__,
                                             original.__closure__)
    return _FORWARDS[kind]


def _mark_unbacked(tensor: torch.Tensor, dims: tuple[int, ...]) -> None:
    for dim in dims:
        torch._dynamo.decorators.mark_unbacked(tensor, dim)
