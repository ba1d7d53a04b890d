"""A step's whole forward pass as one native call: every layer inside one OpenMP parallel region (lesson 19).

The compiled forward pass (compiled_forward.py) takes most of the Python out of a step, not all of it: a batch-1
step of the bundled model in its native 4-bit form enters 2,370 PyTorch operators and 151 C kernels eagerly
(lesson 19's profile), and compiled, inductor's generated Python still allocates each of the 151 kernels' outputs
and calls it through the dispatcher, its fused pointwise loops run on one thread, and Dynamo checks its guards
every step: on 2 cores about as much time as the gap between the compiled and the native step (lesson 19), where
the parallel regions themselves cost under a microsecond each (bench/parallel_regions.py). `csrc/native_step.c`
runs the step's embedding, 30 layers and head as stages of one parallel region, every stage split between the
threads, the threads meeting at a barrier between stages, and reads the weights where the model keeps them (the
int4 layers' packing, the Q8_0 table, the KV pool): nothing is copied, allocated or laid out again.

What it covers, checked once (`native_step_unavailable_reason`): a CPU model on one rank without biases or q/k
norms, a pool in its dtype (`kv_cache_dtype="auto"`), and either
- int4 layers in bfloat16 with fused q/k/v and gate/up (the GGUF's own blocks, `quantization="gguf"`, or
  "int4"), the embedding a Q8_0 table or dense, the head a Q8_0 table or int4; a build with AVX-512 VNNI; or
- dense layers in float32 or bfloat16 (`nn.Linear`, or oneDNN-packed), a dense embedding and head; a build with
  AVX-512 (`csrc/native_stages.h`: in bfloat16 the products run on `vdpbf16ps` where the CPU has it). The C side
  reads plain (out, in) matrices, q/k/v and gate/up as the parts they are (`DenseWeights`); oneDNN's packed
  layout is opaque, so an engine whose native step runs dense layers does not pack them (`prepack_weights=True`
  packs them anyway, and the native step then reads a plain copy, which the KV budget counts).
Which steps: any whose tokens number at most `MAX_TOKENS` (dense bfloat16 layers: 1, `DENSE_BF16_MAX_TOKENS`)
and that want no prompt logprobs: decodes, the k + 1 rows of sequences verifying drafts, short prefill chunks. The
rest run as before (compiled, or eagerly). An int4 step whose activations hold an infinity or a NaN is handed back
too (`run` returns None), as the int4 kernel does.

The numbers are the operator path's kernels' (the C file says where its rounding can differ): the tests check
the same greedy tokens and logits within the dtype's tolerance against the compiled and eager paths.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
from pathlib import Path

import torch
from torch import nn

from ..attention.kv_cache import PagedKVCache
from ..model import CausalLM
from ..model.quantized_embedding import Q8Embedding, Q8Head
from ..model.packed_linear import PackedLinear
from ..model.quantized_linear import Int4Linear
from ..native import FLAG_SETS, KernelUnavailable, build_library
from .input_batch import ModelInput

SOURCE_DIR = Path(__file__).parent / "csrc"
# Every file the build reads (the kernels it includes), hashed into the cache key (native/build.py).
SOURCES = ("native_step.c", "native_stages.h", "../../model/csrc/quantized_matmul.c",
           "../../attention/csrc/paged_decode.c", "../../attention/csrc/paged_decode_body.h")
MAX_TOKENS = 8  # tokens of a step run natively (bundled GGUF, 2 cores: 1.35x compiled at 1, 1.24x at 8, 0.95x at 16)
# Dense bfloat16 layers: batch-1 steps only. Interleaved against the compiled graph on packed weights (bundled model,
# 2 cores): 1.28x at 1 token, 0.98x at 2, 0.71x at 4 (oneDNN's bfloat16 products stay memory-bound at 4 rows,
# vdpbf16ps's do not). Dense float32: 1.44x at 1, 1.13x at 4, 1.11x at 8, so MAX_TOKENS.
DENSE_BF16_MAX_TOKENS = 1
_C_MAX_TOKENS = 64  # native_step.c's bound (its stack buffers)
_P, _I = ctypes.c_void_p, ctypes.c_int64


class _Int4Weight(ctypes.Structure):
    _fields_ = [("packed", _P), ("scales_and_zeros", _P)]


class _DenseWeight(ctypes.Structure):
    _fields_ = [("part", _P * 3), ("rows", _I * 3)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _Int4Weight), ("o", _Int4Weight),
                ("gate_up", _Int4Weight), ("down", _Int4Weight), ("dqkv", _DenseWeight), ("dout", _DenseWeight),
                ("dgate_up", _DenseWeight), ("ddown", _DenseWeight), ("key_pool", _P), ("value_pool", _P)]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", _I), ("hidden", _I), ("num_heads", _I), ("num_kv_heads", _I), ("head_dim", _I),
                ("intermediate", _I), ("vocab", _I), ("group", _I), ("qkv_rows", _I), ("block_size", _I),
                ("eps", ctypes.c_float), ("attention_scale", ctypes.c_float), ("layers", ctypes.POINTER(_Layer)),
                ("final_norm", _P), ("embed_q", _P), ("embed_d", _P), ("embed_dense", _P), ("head_q", _P),
                ("head_d", _P), ("head_int4", _Int4Weight), ("head_rows", _I), ("head_dense", _P), ("cos", _P),
                ("sin", _P), ("max_positions", _I), ("num_blocks", _I), ("x", _P), ("h", _P), ("qkv", _P),
                ("attn", _P), ("act", _P), ("t", _P), ("step", _P), ("xsum", _P), ("xf", _P), ("xblock", _P)]


class _Step(ctypes.Structure):
    _fields_ = [("num_tokens", _I), ("num_logits", _I), ("input_ids", _P), ("positions", _P),
                ("slot_mapping", _P), ("logits_indices", _P), ("query_start_loc", _P), ("block_tables", _P),
                ("num_seqs", _I), ("table_stride", _I), ("table_width", _I), ("logits", _P)]


# native_step.c's refusals of a step whose indices point outside what they index (a caller's bug).
_BAD_STEP = {2: "query_start_loc does not split the step's rows into its sequences (or the block tables' shape)",
             3: "a token id outside the vocabulary", 4: "a position outside the model's rotary tables",
             5: "a slot outside the KV pool", 6: "a block table entry outside the KV pool, or past its row",
             7: "a logits row outside the step"}


@functools.cache
def load_library() -> ctypes.CDLL:
    """The compiled step (built on first call, then cached on disk and in this process)."""
    library = build_library("native_step", SOURCE_DIR, SOURCES, ("native_step.c",), FLAG_SETS)
    library.native_step_bf16.restype = ctypes.c_int
    library.native_step_bf16.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Step)]
    for name in ("native_step_available", "native_step_dense_available"):
        getattr(library, name).restype = ctypes.c_int
        getattr(library, name).argtypes = []
    if library.native_step_dense_available():
        for name in ("native_step_dense_bf16", "native_step_dense_f32"):
            getattr(library, name).restype = ctypes.c_int
            getattr(library, name).argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Step)]
    return library


@functools.cache
def library_unavailable_reason(dense: bool = False) -> str | None:
    """None when the step's library builds here with the kernels it runs on (int4's, or with `dense` the dense
    products'); otherwise why not."""
    if not dense:
        from ..model.quantized_kernels import kernels_unavailable_reason

        reason = kernels_unavailable_reason()  # the int4 packing this step reads, checked against PyTorch's
        if reason is not None:
            return reason
    try:
        library = load_library()
    except KernelUnavailable as error:
        return str(error)
    if dense and not library.native_step_dense_available():
        return "this CPU (or compiler) has no AVX-512, which the native step's dense products need"
    if not dense and not library.native_step_available():
        return "this CPU (or compiler) has no AVX-512 VNNI and VBMI, which the native step's int4 kernel needs"
    return None


def _projections(layer: nn.Module) -> dict[str, list[nn.Module]]:
    """A decoder layer's four products, each as the modules that hold it: one fused module (q/k/v, gate/up
    packed or quantized as one) or its parts."""
    attention, mlp = layer.self_attn, layer.mlp
    return {"qkv": [attention.qkv_proj] if attention.qkv_proj is not None
            else [attention.q_proj, attention.k_proj, attention.v_proj],
            "o": [attention.o_proj], "down": [mlp.down_proj],
            "gate_up": [mlp.gate_up_proj] if mlp.gate_up_proj is not None else [mlp.gate_proj, mlp.up_proj]}


def _is_dense(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, PackedLinear)) and module.bias is None


def uses_dense_weights(model: CausalLM) -> bool:
    """Whether the native step would run this model on dense weights (not int4)."""
    return not isinstance(model.model.layers[0].self_attn.o_proj, Int4Linear)


def native_step_unavailable_reason(model: CausalLM, kv_cache_dtype: str) -> str | None:
    """None when `NativeStep` runs this model's steps; otherwise why not (the module docstring's conditions)."""
    config = model.config
    if model.device.type != "cpu":
        return f"the native step runs on the CPU, the model is on {model.device}"
    if model.tp is not None:
        return "the native step runs a whole model, not a tensor-parallel shard"
    if kv_cache_dtype != "auto":
        return f"the native step reads a pool in the model's dtype, not {kv_cache_dtype!r}"
    if config.qk_norm or config.attention_bias or config.mlp_bias:
        return "the native step has no q/k norms and no biases"
    if config.head_dim > 256 or config.head_dim % 2:
        return "the native step takes heads of an even size up to 256"
    modules = [module for layer in model.model.layers for parts in _projections(layer).values() for module in parts]
    embed, head = model.model.embed_tokens, model.lm_head
    if all(_is_dense(module) for module in modules):
        if model.dtype not in (torch.float32, torch.bfloat16):
            return f"the native step computes in float32 or bfloat16, the model in {model.dtype}"
        if not isinstance(embed, nn.Embedding) or not _is_dense(head):
            return "with dense layers the native step reads a dense embedding and head"
        sizes = [config.hidden_size, config.intermediate_size, config.num_heads * config.head_dim,
                 config.num_kv_heads * config.head_dim]
        if any(size % 32 for size in sizes):
            return "the native step's dense products need hidden, intermediate and head widths in blocks of 32"
        return library_unavailable_reason(dense=True)
    if model.dtype != torch.bfloat16:
        return f"the native step computes int4 layers in bfloat16, the model in {model.dtype}"
    if not all(isinstance(module, Int4Linear) and module.bias is None and len(parts) == 1
               for layer in model.model.layers for parts in _projections(layer).values() for module in parts):
        return ("the native step runs dense layers (float32, bfloat16), or int4 layers with q/k/v and gate/up fused "
                "(quantization 'gguf' or 'int4')")
    groups = {module.group_size for module in modules}
    if len(groups) != 1 or next(iter(groups)) % 32:
        return f"the native step takes one int4 group size, a multiple of 32, got {sorted(groups)}"
    if isinstance(embed, Q8Embedding) and embed.table.m is not None or not isinstance(embed, (Q8Embedding, nn.Embedding)):
        return "the native step reads a Q8_0 or dense embedding"
    if isinstance(head, Q8Head) and head.table.m is not None or not isinstance(head, (Q8Head, Int4Linear)):
        return "the native step's head is a Q8_0 table or int4"
    if config.hidden_size % 64 or config.intermediate_size % 64:
        return "the native step needs hidden and intermediate sizes in blocks of 64 with int4 layers"
    return library_unavailable_reason()


class DenseWeights(nn.Module):
    """The plain (out, in) matrices the native step reads for a model with dense layers: the model's own where
    they are plain (`nn.Linear`), and a plain copy of each packed one (model/packed_linear.py: oneDNN's layout is
    opaque). A module, so the engine's memory book (kv_budget.py) counts the copies, and the shared ones once.
    The head is the embedding's rows when the two are tied."""

    def __init__(self, model: CausalLM) -> None:
        super().__init__()
        self.layers: list[dict[str, list[torch.Tensor]]] = []
        count = itertools.count()
        for layer in model.model.layers:
            self.layers.append({name: [self._keep(next(count), _plain(module)) for module in parts]
                                for name, parts in _projections(layer).items()})
        head = model.lm_head
        tied = model.config.tie_word_embeddings
        self.head = self._keep(next(count), model.model.embed_tokens.weight if tied else _plain(head))

    def _keep(self, index: int, weight: torch.Tensor) -> torch.Tensor:
        weight = weight.detach()
        if not weight.is_contiguous():
            weight = weight.contiguous()
        self.register_buffer(f"w{index}", weight, persistent=False)
        return weight


def _plain(module: nn.Module) -> torch.Tensor:
    return module.weight if isinstance(module, nn.Linear) else module.packed_weight.to_dense()  # (out, in)


def _dense(parts: list[torch.Tensor]) -> _DenseWeight:
    weight = _DenseWeight()
    for i, part in enumerate(parts):
        weight.part[i], weight.rows[i] = part.data_ptr(), part.shape[0]
    return weight


class NativeStep:
    """Runs steps of at most `max_tokens` tokens (MAX_TOKENS; 1 for dense bfloat16 layers) as one native call
    over the engine's model and pool. Build it after checking `native_step_unavailable_reason`. It reads the model's
    and the pool's tensors where they are, and holds them: it checks their shapes against the config once, and each
    step's indices against the pool and the vocabulary (in C, before anything is read: a ValueError, never memory
    overwritten). A model with dense layers needs its `DenseWeights` (built before its pool, so the pool's budget
    counts them). The engine drops it at shutdown, with the pool."""

    def __init__(self, model: CausalLM, kv_cache: PagedKVCache, max_model_len: int,
                 dense: DenseWeights | None = None) -> None:
        reason = native_step_unavailable_reason(model, "auto")  # the pool's dtype: _check_layouts
        if reason is not None:
            raise ValueError(reason)
        layers = model.model.layers
        self.is_dense = uses_dense_weights(model)
        if self.is_dense and dense is None:
            dense = DenseWeights(model)
        self.model, self.kv_cache, self.library, self.dense = model, kv_cache, load_library(), dense
        self.num_runs = 0  # steps that ran natively
        self.max_tokens = DENSE_BF16_MAX_TOKENS if self.is_dense and model.dtype == torch.bfloat16 else MAX_TOKENS
        config = model.config
        hidden, width, inner = config.hidden_size, config.num_heads * config.head_dim, config.intermediate_size
        qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        if not self.is_dense:
            qkv_rows = layers[0].self_attn.qkv_proj.packed.shape[0]  # padded to a block of 64
        group = 32 if self.is_dense else layers[0].self_attn.qkv_proj.group_size
        with torch.inference_mode():
            positions = torch.arange(max_model_len)[None]  # (1, L): the model's own tables, as its layers read them
            cos, sin = (table[0].contiguous() for table in model.model.rotary_emb(positions, model.dtype))  # (L, d)
        widest = max(hidden, width, inner)
        act, rows = model.dtype, _C_MAX_TOKENS
        # Every tensor the C side points at, held here: a model changed later (repacked, quantized again) or a pool
        # released leaves this step reading tensors that still exist, never freed memory.
        self._keep: list[torch.Tensor] = [cos, sin]
        workspace = {name: self._tensor(shape, dtype) for name, shape, dtype in (
            ("x", (rows, hidden), act), ("h", (rows, hidden), act), ("qkv", (rows, qkv_rows), act),
            ("attn", (rows, width), act), ("act", (rows, inner), act), ("t", (rows, widest), torch.int16),
            ("step", (rows, widest // group), torch.float32), ("xsum", (rows, widest // group), torch.float32),
            ("xf", (rows, hidden), torch.float32), ("xblock", (rows, hidden // 32), torch.float32))}
        none4 = _Int4Weight(None, None)
        self._layers = (_Layer * len(layers))()
        for i, layer in enumerate(layers):
            entry = self._layers[i]
            entry.input_norm = layer.input_layernorm.weight.data_ptr()
            entry.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            entry.key_pool, entry.value_pool = kv_cache.keys[i].data_ptr(), kv_cache.values[i].data_ptr()
            if dense is not None:
                weights = dense.layers[i]
                entry.dqkv, entry.dout = _dense(weights["qkv"]), _dense(weights["o"])
                entry.dgate_up, entry.ddown = _dense(weights["gate_up"]), _dense(weights["down"])
                entry.qkv = entry.o = entry.gate_up = entry.down = none4
            else:
                entry.qkv, entry.o = _int4(layer.self_attn.qkv_proj), _int4(layer.self_attn.o_proj)
                entry.gate_up, entry.down = _int4(layer.mlp.gate_up_proj), _int4(layer.mlp.down_proj)
        embed, head = model.model.embed_tokens, model.lm_head
        self._model = _Model(
            num_layers=len(layers), hidden=hidden, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim, intermediate=inner, vocab=config.vocab_size, group=group, qkv_rows=qkv_rows,
            block_size=kv_cache.block_size, eps=config.rms_norm_eps, attention_scale=config.head_dim ** -0.5,
            layers=self._layers, final_norm=model.model.norm.weight.data_ptr(),
            embed_q=embed.table.q.data_ptr() if isinstance(embed, Q8Embedding) else None,
            embed_d=embed.table.d.data_ptr() if isinstance(embed, Q8Embedding) else None,
            embed_dense=embed.weight.data_ptr() if isinstance(embed, nn.Embedding) else None,
            head_q=head.table.q.data_ptr() if isinstance(head, Q8Head) else None,
            head_d=head.table.d.data_ptr() if isinstance(head, Q8Head) else None,
            head_int4=_int4(head) if isinstance(head, Int4Linear) else none4,
            head_rows=head.packed.shape[0] if isinstance(head, Int4Linear) else 0,
            head_dense=dense.head.data_ptr() if dense is not None else None,
            cos=cos.data_ptr(), sin=sin.data_ptr(), max_positions=max_model_len, num_blocks=kv_cache.num_blocks,
            **{name: tensor.data_ptr() for name, tensor in workspace.items()})
        self._keep += self._pointed_at(model, kv_cache, dense)
        self._call = (self.library.native_step_bf16 if not self.is_dense
                      else self.library.native_step_dense_bf16 if act == torch.bfloat16
                      else self.library.native_step_dense_f32)
        self._check_layouts(model, kv_cache, dense)

    def _tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype)
        self._keep.append(tensor)
        return tensor

    @staticmethod
    def _pointed_at(model: CausalLM, kv_cache: PagedKVCache, dense: DenseWeights | None) -> list[torch.Tensor]:
        """The model's and the pool's tensors whose addresses the C side keeps."""
        held = [model.model.norm.weight, *kv_cache.keys, *kv_cache.values]
        for i, layer in enumerate(model.model.layers):
            held += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            if dense is not None:
                held += [part for parts in dense.layers[i].values() for part in parts]
            else:
                for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                               layer.mlp.down_proj):
                    held += [linear.packed, linear.scales_and_zeros]
        embed, head = model.model.embed_tokens, model.lm_head
        for module in (embed, head):
            if isinstance(module, (Q8Embedding, Q8Head)):
                held += [module.table.q, module.table.d]
            elif isinstance(module, Int4Linear):
                held += [module.packed, module.scales_and_zeros]
        if isinstance(embed, nn.Embedding):
            held.append(embed.weight)
        if dense is not None:
            held.append(dense.head)
        return [tensor.detach() for tensor in held]

    @staticmethod
    def _check_layouts(model: CausalLM, kv_cache: PagedKVCache, dense: DenseWeights | None) -> None:
        """Every tensor the C side reads must be contiguous in the layout it assumes, in the model's dtype, and of the
        shape it strides by (the config's sizes): a table or a pool of another shape would be read past its end."""
        config = model.config
        vocab, hidden, width = config.vocab_size, config.hidden_size, config.num_heads * config.head_dim
        embed, head = model.model.embed_tokens, model.lm_head
        shapes: list[tuple[str, torch.Tensor, tuple[int, ...]]] = [("the final norm", model.model.norm.weight,
                                                                     (hidden,))]
        for i, layer in enumerate(model.model.layers):
            shapes += [(f"layer {i}'s norms", layer.input_layernorm.weight, (hidden,)),
                       (f"layer {i}'s norms", layer.post_attention_layernorm.weight, (hidden,))]
        pool = (kv_cache.num_blocks, kv_cache.block_size, config.num_kv_heads, config.head_dim)
        shapes += [("the KV pool", tensor, pool) for tensor in (*kv_cache.keys, *kv_cache.values)]
        if len(kv_cache.keys) != len(model.model.layers):
            raise ValueError("the native step reads one KV pool per layer")
        for name, module in (("embedding", embed), ("head", head)):
            if isinstance(module, (Q8Embedding, Q8Head)):  # block-major: (blocks, vocab, 32) and (blocks, vocab)
                shapes += [(f"the Q8_0 {name}", module.table.q, (hidden // 32, vocab, 32)),
                           (f"the Q8_0 {name}'s scales", module.table.d, (hidden // 32, vocab))]
            elif isinstance(module, Int4Linear) and module.out_features != vocab:
                raise ValueError(f"the native step's int4 head has {module.out_features} rows, the vocabulary {vocab}")
        if isinstance(embed, nn.Embedding):
            shapes.append(("the embedding", embed.weight, (vocab, hidden)))
        if dense is not None:
            shapes.append(("the head", dense.head, (vocab, hidden)))
            for i, parts in enumerate(dense.layers):
                expected = {"qkv": width + 2 * config.num_kv_heads * config.head_dim, "o": hidden,
                            "gate_up": 2 * config.intermediate_size, "down": hidden}
                inputs = {"qkv": hidden, "o": width, "gate_up": hidden, "down": config.intermediate_size}
                for name, tensors in parts.items():
                    if sum(t.shape[0] for t in tensors) != expected[name] or any(
                            t.dim() != 2 or t.shape[1] != inputs[name] for t in tensors):
                        raise ValueError(f"the native step's layer {i} {name} weights are not the config's "
                                         f"({expected[name]}, {inputs[name]})")
        for what, tensor, shape in shapes:
            if tuple(tensor.shape) != shape:
                raise ValueError(f"the native step reads {what} as {shape}, the model holds {tuple(tensor.shape)}")
        tensors = [model.model.norm.weight, *kv_cache.keys, *kv_cache.values]
        for i, layer in enumerate(model.model.layers):
            tensors += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            if dense is not None:
                tensors += [part for parts in dense.layers[i].values() for part in parts]
                continue
            for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                tensors += [linear.packed, linear.scales_and_zeros]
                if linear.scales_and_zeros.dtype != torch.bfloat16:
                    raise ValueError("the native step reads int4 scales in bfloat16")
        if dense is not None:
            tensors += [dense.head, model.model.embed_tokens.weight]
            if any(t.dtype != model.dtype for t in tensors):
                raise ValueError(f"the native step reads dense weights, norms and pools in the model's {model.dtype}")
        if any(not tensor.is_contiguous() for tensor in tensors):
            raise ValueError("the native step reads contiguous weights and pools")
        if kv_cache.keys[0].dtype != model.dtype:
            raise ValueError(f"the native step reads a pool in the model's {model.dtype}, not {kv_cache.keys[0].dtype}")

    def can_run(self, model_input: ModelInput) -> bool:
        """Whether this step is one the native call takes (its token count)."""
        return 0 < model_input.num_tokens <= self.max_tokens

    def run(self, model_input: ModelInput) -> torch.Tensor | None:
        """The step's logits (R, vocab) in the model's dtype, its keys and values stored; None when the native
        call handed the step back (an infinity or a NaN among an int4 step's activations), for the caller to run
        it otherwise."""
        metadata = model_input.metadata
        input_ids, positions = model_input.input_ids[0], model_input.positions[0]  # (N,) each
        tables, logits_indices = metadata.block_tables, model_input.logits_indices
        for tensor in (input_ids, positions, metadata.slot_mapping, logits_indices):
            assert tensor.dtype == torch.int64 and tensor.is_contiguous(), "the runner's index buffers are int64"
        assert tables.dtype == torch.int32 and tables.stride(1) == 1 and metadata.query_start_loc.is_contiguous()
        logits = torch.empty(logits_indices.shape[0], self.model.config.vocab_size, dtype=self.model.dtype)
        num_seqs = metadata.num_seqs
        if (positions.shape[0] != input_ids.shape[0] or metadata.slot_mapping.shape[0] != input_ids.shape[0]
                or metadata.query_start_loc.shape[0] < num_seqs + 1 or tables.shape[0] < num_seqs):
            raise ValueError("the native step was given a step whose index tensors do not match its tokens")
        step = _Step(num_tokens=input_ids.shape[0], num_logits=logits_indices.shape[0],
                     input_ids=input_ids.data_ptr(), positions=positions.data_ptr(),
                     slot_mapping=metadata.slot_mapping.data_ptr(), logits_indices=logits_indices.data_ptr(),
                     query_start_loc=metadata.query_start_loc.data_ptr(), block_tables=tables.data_ptr(),
                     num_seqs=num_seqs, table_stride=tables.stride(0), table_width=tables.shape[1],
                     logits=logits.data_ptr())
        status = self._call(ctypes.byref(self._model), ctypes.byref(step))
        if status in _BAD_STEP:
            raise ValueError(f"the native step refused a step with {_BAD_STEP[status]}: nothing was read or written")
        if status != 0:
            return None
        self.num_runs += 1
        return logits


def _int4(linear: Int4Linear) -> _Int4Weight:
    return _Int4Weight(linear.packed.data_ptr(), linear.scales_and_zeros.data_ptr())
