"""The C kernels for quantized weights (`model/quantized_kernels.py`): PyTorch's int4 packing read back
exactly (a full block of 64 rows and a tail, every group size), the int4 product in 16-bit integers within
its error bound, the Q8_0 product and tiles equal to the float weights', the layers equal with and without
the kernels, every build (AVX-512, AVX2, plain C), and the guards."""

from __future__ import annotations

import pytest
import torch

from llm_runtime.model import quantized_kernels
from llm_runtime.model.quantized_embedding import Q8Head, Q8Table
from llm_runtime.model.quantized_kernels import int4_dequantize_t, int4_matmul, q8_dequantize, q8_matmul
from llm_runtime.model.quantized_linear import DENSE_ROWS, Int4Linear, _dense_here, dequantize_int4, quantize_int4

pytestmark = pytest.mark.skipif(quantized_kernels.kernels_unavailable_reason() is not None,
                                reason="the quantized C kernels do not build here")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return {flag for line in cpuinfo if line.startswith("flags") for flag in line.split(":")[1].split()}
    except OSError:
        return set()


HAS_VNNI = {"avx512_vnni", "avx512vbmi", "avx512bw"} <= _cpu_flags()  # what int4_matmul's fast build needs


def _packed_layer(rows: int, columns: int, group: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, columns, generator=gen)
    q, scale, zero = quantize_int4(w, group)
    layer = Int4Linear(q, scale, zero, None, dtype)
    # The weight as the layer holds it: its scales and zeros rounded to its dtype.
    stored = layer.scales_and_zeros.float()[:, :rows]  # (G, N, 2)
    weight = dequantize_int4(q, stored[..., 0].t(), stored[..., 1].t())  # (N, K)
    return layer, weight


@pytest.mark.parametrize("rows", [48, 80, 960])  # only a tail, a block and a tail, 15 blocks
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_pytorchs_int4_packing_is_read_back_exactly(rows: int, group: int, dtype: torch.dtype) -> None:
    layer, weight = _packed_layer(rows, 256, group, dtype)
    read = int4_dequantize_t(layer.packed, layer.scales_and_zeros, 256, group)  # (K, N padded)
    assert read.shape == (256, layer.packed.shape[0]) and read.dtype == dtype
    # q * s + (zero - 8 s) in float32 (a rounding or two from (q - 8) * s + zero), then once to dtype
    rtol = 1e-6 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(read.t()[:rows].float(), weight, rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_an_int4_layer_is_the_same_product_on_either_side_of_dense_rows(dtype: torch.dtype) -> None:
    layer, weight = _packed_layer(200, 256, 32, dtype, seed=1)
    gen = torch.Generator().manual_seed(2)
    for num_rows in (1, DENSE_ROWS, DENSE_ROWS + 1, 100):
        x = torch.randn(num_rows, 256, generator=gen).to(dtype)
        expected = x.float() @ weight.t()
        assert _dense_here(x, layer.packed) == (num_rows > DENSE_ROWS or dtype == torch.float32)
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2 * float(expected.abs().max())
        assert (layer(x).float() - expected).abs().max() < tolerance, num_rows


def _wide_rows(num_rows: int, columns: int, group: int, seed: int) -> torch.Tensor:
    """Rows whose groups span a wide range: each value times 2^u, u uniform in -20..3, so most groups hold
    values far below 2^-7 of their largest (the ones the 16-bit integers round)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, columns, generator=gen) * 2.0 ** torch.randint(-20, 4, (num_rows, columns), generator=gen)
    return x.bfloat16()


def _int16_bound(x: torch.Tensor, layer: Int4Linear, weight: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """What int4_matmul may differ from the exact product by: each x rounded by at most 2^-15 of its group's
    largest |x|, weighed by q * scale (its weight less the group's zero point, zero - 8 scale: the kernel adds
    that part from the exact sum of x), then the result once to bfloat16 (2^-8 of it), and float32's sums."""
    group, rows = layer.group_size, weight.shape[0]
    stored = layer.scales_and_zeros.double()[:, :rows]  # (G, N, 2)
    zero_point = (stored[..., 1] - 8 * stored[..., 0]).t().repeat_interleave(group, dim=1)  # (N, K)
    largest = x.double().abs().view(x.shape[0], -1, group).amax(dim=2).repeat_interleave(group, dim=1)  # (M, K)
    return 2.0**-15 * (largest @ (weight.double() - zero_point).abs().t()) + 2.0**-8 * exact.abs() + 1e-30


@pytest.mark.skipif(not HAS_VNNI, reason="the 16-bit integer int4 kernel needs AVX-512 VNNI and VBMI")
@pytest.mark.parametrize(("rows", "columns", "group"), [(64, 64, 32), (960, 576, 32), (128, 512, 64),
                                                        (192, 512, 128), (64, 512, 256)])
def test_the_int4_product_in_16_bit_integers_is_within_its_bound(rows: int, columns: int, group: int) -> None:
    layer, weight = _packed_layer(rows, columns, group, torch.bfloat16, seed=rows)
    for num_rows in (1, 2, 3, 4, 5, 9, 32):  # whole and partial tiles of the kernel's 4 rows
        x = _wide_rows(num_rows, columns, group, seed=num_rows)
        out = int4_matmul(x, layer.packed, group, layer.scales_and_zeros)
        assert out is not None and out.shape == (num_rows, rows) and out.dtype == torch.bfloat16
        exact = x.double() @ weight.double().t()
        assert ((out.double() - exact).abs() <= _int16_bound(x, layer, weight, exact)).all(), num_rows
        pytorchs = torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer.packed, group, layer.scales_and_zeros)
        assert (out.double() - exact).abs().max() <= 2 * (pytorchs.double() - exact).abs().max() + 1e-30


@pytest.mark.skipif(not HAS_VNNI, reason="the 16-bit integer int4 kernel needs AVX-512 VNNI and VBMI")
def test_the_activations_become_multiples_of_their_groups_power_of_two_step() -> None:
    """With W = I (q one-hot, scale 1, zero 8: the zero point is 0) the product is the activations as the
    kernel holds them: each group's largest |x| = f 2^e (f in [0.5, 1)) makes the step 2^(e - 15), and every
    x is rounded to a multiple of it, bit for bit (all of them fit a bfloat16). Rows read with a stride."""
    size, group = 64, 32
    layer = Int4Linear(torch.eye(size, dtype=torch.int32), torch.ones(size, size // group),
                       torch.full((size, size // group), 8.0), None, torch.bfloat16)
    wide = _wide_rows(5, size + 32, group, seed=7)
    x = wide[:, :size]  # (5, 64) with a row stride of 96
    out = int4_matmul(x, layer.packed, group, layer.scales_and_zeros)
    assert torch.equal(out, int4_matmul(x.contiguous(), layer.packed, group, layer.scales_and_zeros))
    groups = x.double().view(5, -1, group)
    _, exponent = torch.frexp(groups.abs().amax(dim=2, keepdim=True))
    step = torch.pow(2.0, exponent.double() - 15)
    held = (torch.round(groups / step) * step).view(5, size)  # round half to even, as the kernel
    assert torch.equal(out.double(), held)
    near = groups.abs() >= groups.abs().amax(dim=2, keepdim=True) / 2**7  # within 2^7 of the largest: exact
    assert torch.equal(held.view(5, -1, group)[near], groups[near]) and not near.all()


@pytest.mark.skipif(not HAS_VNNI, reason="the 16-bit integer int4 kernel needs AVX-512 VNNI and VBMI")
def test_values_near_their_groups_largest_are_exact_in_16_bit_integers() -> None:
    """Every group's values within 2^7 of its largest: the integers hold them exactly, so the product is the
    exact one rounded once to bfloat16 (and float32's sum over groups)."""
    layer, weight = _packed_layer(128, 256, 32, torch.bfloat16, seed=5)
    gen = torch.Generator().manual_seed(6)
    magnitude = (1 + 127 * torch.rand(4, 256, generator=gen)) * 2.0 ** torch.randint(-8, 8, (4, 8), generator=gen
                                                                                      ).repeat_interleave(32, dim=1)
    x = (magnitude * torch.randn(4, 256, generator=gen).sign()).bfloat16()
    out = int4_matmul(x, layer.packed, 32, layer.scales_and_zeros).double()
    exact = x.double() @ weight.double().t()
    torch.testing.assert_close(out, exact.bfloat16().double(), rtol=2**-8, atol=0)


@pytest.mark.skipif(not HAS_VNNI, reason="the 16-bit integer int4 kernel needs AVX-512 VNNI and VBMI")
def test_the_int4_product_refuses_what_it_does_not_handle() -> None:
    """An infinity or a NaN has no step: the layer's product goes to PyTorch's kernel, which keeps them."""
    from llm_runtime.model.quantized_linear import int4_product

    layer, _ = _packed_layer(128, 128, 32, torch.bfloat16)
    x = torch.randn(3, 128).bfloat16()
    assert int4_matmul(x, layer.packed, 32, layer.scales_and_zeros) is not None
    for bad in (float("nan"), float("inf")):
        x[1, 70] = bad
        assert int4_matmul(x, layer.packed, 32, layer.scales_and_zeros) is None
        out = int4_product(x, layer.packed, 32, layer.scales_and_zeros)
        assert not out[1].isfinite().any() and out[[0, 2]].isfinite().all()
    x[1, 70] = 0.0
    assert int4_matmul(x.float(), layer.packed, 32, layer.scales_and_zeros.float()) is None  # float32: dense
    assert int4_matmul(torch.randn(256, 3).bfloat16().t(), layer.packed, 32, layer.scales_and_zeros) is None
    tail, _ = _packed_layer(80, 128, 32, torch.bfloat16)  # a block of 64 rows and a tail of 16
    assert int4_matmul(x, tail.packed, 32, tail.scales_and_zeros) is None
    with pytest.raises(ValueError, match="must match rows"):
        int4_matmul(torch.randn(1, 64).bfloat16(), layer.packed, 32, layer.scales_and_zeros)
    with pytest.raises(ValueError, match="must match rows"):  # scales of groups of 32 read as groups of 64
        int4_matmul(x, layer.packed, 64, layer.scales_and_zeros)
    with pytest.raises(ValueError, match="packed uint8"):
        int4_matmul(x, layer.packed.view(torch.int8), 32, layer.scales_and_zeros)


def test_without_the_kernels_the_layers_keep_pytorchs(monkeypatch) -> None:
    layer, weight = _packed_layer(64, 128, 32, torch.bfloat16)
    table = Q8Table(torch.randint(-127, 128, (64, 64), dtype=torch.int8), torch.rand(64, 2) / 100, torch.bfloat16)
    x = torch.randn(40, 128).bfloat16()
    with_kernels = layer(x), Q8Head(table)(x[:3, :64]), Q8Head(table)(x[:, :64])
    monkeypatch.setattr(quantized_kernels, "kernels_unavailable_reason", lambda: "no compiler")
    monkeypatch.setattr("llm_runtime.model.quantized_linear.kernels_unavailable_reason", lambda: "no compiler")
    monkeypatch.setattr("llm_runtime.model.quantized_embedding.kernels_unavailable_reason", lambda: "no compiler")
    assert not _dense_here(x, layer.packed)
    without = layer(x), Q8Head(table)(x[:3, :64]), Q8Head(table)(x[:, :64])
    for a, b in zip(with_kernels, without):
        assert (a.float() - b.float()).abs().max() < 2e-2 * float(b.float().abs().max())


def _q8_table(vocab: int, hidden: int, dtype: torch.dtype, seed: int = 0, with_minimum: bool = False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (vocab, hidden), generator=gen, dtype=torch.int8)
    d = torch.rand(vocab, hidden // 32, generator=gen) / 100
    m = torch.rand(vocab, hidden // 32, generator=gen) - 0.5 if with_minimum else None
    table = Q8Table(q, d, dtype, m)
    weight = q.view(vocab, -1, 32).float() * table.d.float().t()[..., None]  # (vocab, blocks, 32), d as stored
    if with_minimum:
        weight = weight + table.m.float().t()[..., None]
    return table, weight.view(vocab, hidden)


@pytest.mark.parametrize("with_minimum", [False, True], ids=["q8_0", "with-minimum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_q8_0_product_and_tiles_equal_the_float_weights(dtype: torch.dtype, with_minimum: bool) -> None:
    table, weight = _q8_table(1000, 96, dtype, with_minimum=with_minimum)  # 62 tiles of 16 rows, then 8 rows
    gen = torch.Generator().manual_seed(3)
    for num_rows in (1, 3, 4, 6):  # whole and partial groups of the kernel's 4 rows
        x = torch.randn(num_rows, 96, generator=gen).to(dtype)
        expected = x.float() @ weight.t()
        out = q8_matmul(x, table.q, table.d, table.m)
        tolerance = 1e-5 * float(expected.abs().max()) if dtype == torch.float32 else 1 / 128 * expected.abs() + 1e-3
        assert ((out.float() - expected).abs() <= tolerance).all(), num_rows  # one rounding to bfloat16 at most
    rows = q8_dequantize(table.q, table.d, 10, 700, table.m)
    if with_minimum:  # q * d + m in one fused multiply-add: within a rounding of the two-step reference
        torch.testing.assert_close(rows, weight[10:700].to(dtype))
    else:
        assert torch.equal(rows, weight[10:700].to(dtype))
    assert q8_dequantize(table.q, table.d, 5, 5).shape == (0, 96)


@pytest.mark.parametrize("flags", [("-O3", "-mavx2", "-mfma", "-fopenmp"), ("-O3",)], ids=["avx2", "plain-c"])
def test_the_avx2_and_plain_c_builds_give_the_same_results(monkeypatch, tmp_path, flags) -> None:
    layer, weight = _packed_layer(80, 128, 64, torch.float32)
    table, table_weight = _q8_table(300, 64, torch.float32)
    x = torch.randn(5, 64)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(quantized_kernels, "FLAG_SETS", (flags,))
    quantized_kernels.load_library.cache_clear()
    try:
        assert quantized_kernels.int4_layout_matches()
        read = int4_dequantize_t(layer.packed, layer.scales_and_zeros, 128, 64).t()[:80]
        torch.testing.assert_close(read, weight, rtol=1e-6, atol=1e-6)
        assert (q8_matmul(x, table.q, table.d) - x @ table_weight.t()).abs().max() < 1e-4
        assert torch.equal(q8_dequantize(table.q, table.d, 0, 300), table_weight)
        wide, _ = _packed_layer(64, 128, 32, torch.bfloat16)  # no VNNI in these builds: PyTorch's kernel
        assert int4_matmul(torch.randn(2, 128).bfloat16(), wide.packed, 32, wide.scales_and_zeros) is None
    finally:
        quantized_kernels.load_library.cache_clear()


def test_bad_inputs_are_refused_before_the_c_code_runs() -> None:
    layer, _ = _packed_layer(64, 128, 32, torch.float32)
    with pytest.raises(ValueError, match="packed must be uint8"):
        int4_dequantize_t(layer.packed, layer.scales_and_zeros, 256, 32)
    with pytest.raises(ValueError, match="scales_and_zeros must be"):
        int4_dequantize_t(layer.packed, layer.scales_and_zeros, 128, 64)
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        int4_dequantize_t(layer.packed, layer.scales_and_zeros.transpose(0, 1).contiguous().transpose(0, 1), 128, 32)
    table, _ = _q8_table(100, 64, torch.float32)
    with pytest.raises(ValueError, match=r"d \(blocks, V\) in torch.bfloat16"):
        q8_matmul(torch.randn(2, 64).bfloat16(), table.q, table.d)
    with pytest.raises(ValueError, match=r"x must be \(M, 64\)"):
        q8_matmul(torch.randn(2, 32), table.q, table.d)
    with pytest.raises(ValueError, match="outside a table of 100"):
        q8_dequantize(table.q, table.d, 50, 101)
    with pytest.raises(TypeError, match="compute in"):
        q8_dequantize(table.q, table.d.half(), 0, 10)


def test_a_packing_pytorch_changed_turns_the_kernels_off(monkeypatch) -> None:
    monkeypatch.setattr(quantized_kernels, "int4_layout_matches", lambda: False)
    quantized_kernels.kernels_unavailable_reason.cache_clear()
    try:
        assert "packs int4 weights in a layout" in quantized_kernels.kernels_unavailable_reason()
    finally:
        monkeypatch.undo()
        quantized_kernels.kernels_unavailable_reason.cache_clear()
    assert quantized_kernels.kernels_unavailable_reason() is None


@pytest.mark.parametrize("num_rows", [1, DENSE_ROWS + 8])  # PyTorch's int4 kernel, the weight turned back
def test_the_operators_for_compiled_graphs_are_the_layers_products(num_rows: int) -> None:
    """`int4_matmul` and `q8_matmul_t` (what a compiled forward pass calls, so that the choice of kernel by
    row count stays inside one node) give the eager products and pass PyTorch's operator checks."""
    from llm_runtime.model.quantized_embedding import q8_matmul_t, q8_product
    from llm_runtime.model.quantized_linear import int4_matmul, int4_product

    x = torch.randn(num_rows, 128).bfloat16()
    for rows in (80, 128):  # with a tail of rows (PyTorch's kernel at one row), whole blocks (this package's)
        layer, _ = _packed_layer(rows, 128, 32, torch.bfloat16)
        args = (x, layer.packed, 32, layer.scales_and_zeros)
        assert torch.equal(int4_matmul(*args), int4_product(*args))
        torch.library.opcheck(int4_matmul, args)
    table, _ = _q8_table(300, 64, torch.bfloat16)
    args = (x[:, :64].contiguous(), table.q, table.d)
    assert torch.equal(q8_matmul_t(*args), q8_product(*args))
    torch.library.opcheck(q8_matmul_t, args)
