"""The C++ operators (native/cpp_operators.py) are the Python operators they stand in for: the same schemas,
the same outputs and pool writes, the same errors; a layer
traced for the compiled forward pass calls the C++ operator when it is loaded and the Python one when not;
and a missing C++ compiler is reported, not raised past the caller."""

from __future__ import annotations

import pytest
import torch

from llm_runtime.attention import cpu_kernels
from llm_runtime.model.quantized_linear import Int4Linear, int4_product
from llm_runtime.native import KernelUnavailable, build_torch_library, cpp_operators
from llm_runtime.worker.compiled_forward import load_cpp_operators

pytestmark = pytest.mark.skipif(load_cpp_operators() is not None,
                                reason="the C++ operators do not build here")


def _native(name: str) -> torch._ops.OpOverload:
    operator = cpp_operators.cpp_operator(name)
    assert operator is not None
    return operator


def test_the_cpp_operators_have_the_python_operators_schemas() -> None:
    for name in cpp_operators.NAMES:
        python = getattr(torch.ops.llm_runtime, name).default._schema
        native = _native(name)._schema
        assert str(native).replace(cpp_operators.NAMESPACE, "llm_runtime", 1) == str(python)


def _int4_layer(rows: int, columns: int, dtype: torch.dtype) -> Int4Linear:
    return Int4Linear.from_weight(torch.randn(rows, columns, generator=torch.Generator().manual_seed(rows)), None,
                                  dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("num_rows", [1, 32, 33])  # an int4 kernel up to DENSE_ROWS, then the dense product
@pytest.mark.parametrize("layer_rows", [80, 128])  # a tail of rows (PyTorch's kernel), whole blocks (this package's)
def test_the_cpp_int4_product_is_the_python_one(dtype: torch.dtype, num_rows: int, layer_rows: int) -> None:
    layer = _int4_layer(layer_rows, 128, dtype)
    rows = torch.randn(num_rows, 128).to(dtype)
    arguments = (rows, layer.packed, layer.group_size, layer.scales_and_zeros)
    assert torch.equal(_native("int4_matmul")(*arguments), int4_product(*arguments))


def _attention_inputs(dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks, block_size, kv, heads, dim = 6, 4, 2, 6, 64
    pools = [torch.randn(num_blocks, block_size, kv, dim, generator=gen).to(dtype) for _ in range(2)]
    query = torch.randn(3, heads, dim, generator=gen).to(dtype)
    key, value = (torch.randn(3, kv, dim, generator=gen).to(dtype) for _ in range(2))
    slots = torch.tensor([5, 9, -1])  # two rows write, the third (padding) writes nowhere
    tables = torch.tensor([[3, 1, 0], [2, 5, 4]], dtype=torch.int32)
    lengths = torch.tensor([6, 10], dtype=torch.int32)
    rows = torch.tensor([0, 1])
    return query, key, value, *pools, slots, tables, lengths, rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_cpp_attention_is_the_python_one(dtype: torch.dtype) -> None:
    python_inputs, native_inputs = _attention_inputs(dtype), _attention_inputs(dtype)
    expected = cpu_kernels.cpu_paged_attention(*python_inputs)
    out = _native("cpu_paged_attention")(*native_inputs)
    assert torch.equal(out[:2], expected[:2])  # row 2 is not attended: its output is left as allocated
    for python_pool, native_pool in zip(python_inputs[3:5], native_inputs[3:5]):
        assert torch.equal(native_pool, python_pool)  # the same slots written


def test_the_cpp_attention_refuses_what_the_python_one_refuses() -> None:
    attention = _native("cpu_paged_attention")
    inputs = list(_attention_inputs(torch.float32))
    with pytest.raises(TypeError, match="one dtype"):
        attention(inputs[0].to(torch.bfloat16), *inputs[1:])
    untouched = [pool.clone() for pool in inputs[3:5]]
    inputs[5] = torch.tensor([5, 24, -1])  # slot 24 is past the pool's 6 x 4
    with pytest.raises(ValueError, match="outside"):
        attention(*inputs)
    assert all(torch.equal(pool, before) for pool, before in zip(inputs[3:5], untouched))  # nothing written
    inputs[5] = torch.tensor([5, 9])  # one slot short of the rows
    with pytest.raises(ValueError, match="shapes disagree"):
        attention(*inputs)


# (what is wrong, the argument, its replacement, the error, its message), as for the Python operator
# (tests/attention/test_cpu_kernel.py): each would have the C code read outside a tensor or as the wrong type.
QUERY, SLOTS, TABLES, LENGTHS, ROWS = 0, 5, 6, 7, 8
BAD_INPUTS = [
    ("tables-int64", TABLES, lambda t: t.long(), TypeError, "int32"),
    ("lengths-int64", LENGTHS, lambda t: t.long(), TypeError, "int32"),
    ("rows-int32", ROWS, lambda t: t.int(), TypeError, "int64"),
    ("slots-int32", SLOTS, lambda t: t.int(), TypeError, "int64"),
    ("tables-strided", TABLES, lambda t: t.repeat_interleave(2, dim=1)[:, ::2], ValueError, "contiguous"),
    ("tables-1d", TABLES, lambda t: t.flatten(), ValueError, "shapes disagree"),
    ("rows-2d", ROWS, lambda t: t[:, None], ValueError, "shapes disagree"),
    ("lengths-short", LENGTHS, lambda t: t[:1], ValueError, "shapes disagree"),
    ("block-past-the-pool", TABLES, lambda t: torch.tensor([[3, 1, 0], [2, 5, 6]], dtype=torch.int32), ValueError,
     "block table entries"),
    ("negative-block", TABLES, lambda t: torch.tensor([[3, 1, 0], [2, -1, 4]], dtype=torch.int32), ValueError,
     "block table entries"),
    ("length-past-the-table", LENGTHS, lambda t: torch.tensor([6, 13], dtype=torch.int32), ValueError, "seq_lens"),
    ("empty-length", LENGTHS, lambda t: torch.tensor([6, 0], dtype=torch.int32), ValueError, "seq_lens"),
    ("row-past-the-batch", ROWS, lambda t: torch.tensor([0, 3]), ValueError, "rows"),
    ("query-head-dim", QUERY, lambda q: q[..., :32].contiguous(), ValueError, "shapes disagree"),
]


@pytest.mark.parametrize("what,argument,replace_with,error,message", BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS])
def test_the_cpp_attention_refuses_what_the_c_code_would_misread_and_writes_nothing(what, argument, replace_with,
                                                                                 error, message) -> None:
    inputs = list(_attention_inputs(torch.float32))
    inputs[argument] = replace_with(inputs[argument])
    pools = [pool.clone() for pool in inputs[3:5]]
    with pytest.raises(error, match=message):
        _native("cpu_paged_attention")(*inputs)
    assert torch.equal(inputs[3], pools[0]) and torch.equal(inputs[4], pools[1])  # refused before the store
    with pytest.raises(error, match=message):  # as the Python operator does
        cpu_kernels.cpu_paged_attention(*_attention_inputs(torch.float32)[:argument], inputs[argument],
                                        *_attention_inputs(torch.float32)[argument + 1:])


def _traced_targets(layer: torch.nn.Module, x: torch.Tensor) -> set[str]:
    targets: set[str] = set()

    def backend(graph: torch.fx.GraphModule, example_inputs):
        targets.update(str(node.target) for node in graph.graph.nodes if node.op == "call_function")
        return graph.forward

    torch._dynamo.reset()
    torch.compile(layer, backend=backend, fullgraph=True)(x)
    torch._dynamo.reset()
    return targets


def test_a_traced_layer_calls_the_cpp_operator_and_the_python_one_without_it(monkeypatch) -> None:
    layer, x = _int4_layer(64, 128, torch.bfloat16), torch.randn(1, 128).to(torch.bfloat16)
    assert "llm_runtime_native.int4_matmul.default" in _traced_targets(layer, x)
    monkeypatch.setattr(cpp_operators, "_LOADED", {})  # as in a process where the library did not build
    assert "llm_runtime.int4_matmul.default" in _traced_targets(layer, x)


def test_without_a_cpp_compiler_the_build_says_why(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(KernelUnavailable, match="did not compile"):
        build_torch_library("operators", cpp_operators.SOURCE, (), {"DENSE_ROWS": 32})
