"""A CPU playing a T4 computes float16 products summed in float32 (model/half_products.py): the float32 product
rounded once, PyTorch's own float16 product to the last bit of a few outputs, a float32 copy of the weight that
follows the weight, and the loader's model made of such layers with its head still tied."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llm_runtime import load_model
from llm_runtime.model.half_products import (CACHE_SIZED_WEIGHT, FLOAT32_FROM_ROWS, HalfProductLinear,
                                             emulate_half_products_)


def _within_an_ulp(out: torch.Tensor, exact: torch.Tensor, ulps: int = 1) -> bool:
    """|out - exact| within `ulps` float16 steps of `exact` (plus float32's own error near zero)."""
    return bool(((out.double() - exact).abs() <= ulps * torch.finfo(torch.float16).eps * exact.abs() + 1e-5).all())


def _half_layer(out_features: int, in_features: int, bias: bool = True) -> HalfProductLinear:
    layer = nn.Linear(in_features, out_features, bias=bias).half()
    emulate_half_products_(layer)
    return layer  # type: ignore[return-value]


@pytest.mark.parametrize("rows", [1, 4, 33])
def test_the_product_is_the_float32_one_rounded_once(rows: int) -> None:
    torch.manual_seed(0)
    layer = _half_layer(96, 160)
    assert isinstance(layer, HalfProductLinear)
    x = torch.randn(rows, 160).half()
    out = layer(x)
    assert out.dtype == torch.float16
    exact = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    assert _within_an_ulp(out, exact)  # float32 sums, one rounding to float16
    native = F.linear(x, layer.weight, layer.bias)  # PyTorch's float16 product: float32 sums in another order
    assert _within_an_ulp(out, native.double(), ulps=2)
    assert (out != native).float().mean() < 0.05


def test_a_weight_too_big_for_the_cache_keeps_the_float16_product_for_few_rows() -> None:
    layer = _half_layer(CACHE_SIZED_WEIGHT // 64 + 64, 64, bias=False)
    few = torch.randn(FLOAT32_FROM_ROWS - 1, 64).half()
    assert torch.equal(layer(few), F.linear(few, layer.weight))
    many = torch.randn(FLOAT32_FROM_ROWS, 64).half()
    exact = F.linear(many.double(), layer.weight.double())
    assert _within_an_ulp(layer(many), exact)


def test_the_float32_copy_follows_the_weight() -> None:
    layer = _half_layer(8, 16)
    x = torch.randn(2, 16).half()
    before = layer(x)
    with torch.no_grad():
        layer.weight.mul_(2)  # in place: same storage, a new version
    twice = layer(x)
    assert torch.allclose(twice.float() - layer.bias.float(), 2 * (before.float() - layer.bias.float()), rtol=2e-3,
                          atol=2e-3)
    copied = copy.deepcopy(layer)  # its own float32 weight, made on its first product
    assert torch.equal(copied(x), twice)
    layer.float()  # another dtype: a plain nn.Linear's product
    assert torch.equal(layer(x.float()), F.linear(x.float(), layer.weight, layer.bias))


def test_the_loader_gives_a_played_t4_such_layers_and_the_same_greedy_first_token(monkeypatch) -> None:
    monkeypatch.setenv("LLM_RUNTIME_DEVICE_PROFILE", "t4")
    model, tokenizer = load_model(None, device="auto", dtype="auto")
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert model.dtype == torch.float16 and linears and all(type(m) is HalfProductLinear for m in linears)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie kept
    ids = torch.tensor([tokenizer.encode("The capital of France is")])
    with torch.inference_mode():
        emulated = model.compute_logits(model(ids)[0])[0, -1]
        native_model = copy.deepcopy(model)
        for module in native_model.modules():
            if type(module) is HalfProductLinear:
                module.__class__ = nn.Linear
        native = native_model.compute_logits(native_model(ids)[0])[0, -1]
    assert emulated.argmax() == native.argmax()
    assert (emulated.float() - native.float()).abs().max() < 0.1  # logits of size ~20: a few float16 steps
    monkeypatch.delenv("LLM_RUNTIME_DEVICE_PROFILE")
    plain, _ = load_model(None, device="cpu", dtype="float16")  # a CPU run in float16 is not a played T4
    assert not any(isinstance(m, HalfProductLinear) for m in plain.modules())
