"""Lesson 13 exercises: a weight matrix quantized in groups by hand, a GGUF Q4_1 block read from its bytes, and
keys quantized to int8 as the KV cache stores them.

- `quantize_groups(weight, group_size)`: 4-bit asymmetric quantization per group of input columns, returned
  de-quantized, against `quantized_linear.quantize_int4` / `dequantize_int4`.
- `read_q4_1_block(block)`: the 32 weights of one 20-byte Q4_1 block, against `gguf.q4_1_blocks`.
- `quantize_kv_int8(x)`: keys (tokens, heads, head_dim) through int8 with a scale per token and head, returned
  de-quantized, against the rule written here (the package's pool keeps its scales per channel instead:
  `attention.kv_quant.ChannelScale`, which the lesson sets beside this one).
"""

from __future__ import annotations

import numpy as np
import torch

from ...model.gguf import dequantize_q4_1, q4_1_blocks
from ...model.quantized_linear import dequantize_int4, quantize_int4
from .check import Case, Verdict, close_tensors, run_cases


def check_quantize_groups(fn: object) -> Verdict:
    """`quantize_groups(weight, group_size) -> tensor`: weight (out, in) float32, `in` a multiple of
    `group_size`. Quantize each group of `group_size` consecutive input columns of a row to 4 bits,
    asymmetrically: scale = (max - min) / 15, q = round((w - min) / scale) in [0, 15], and return the
    de-quantized matrix q * scale + min, of the weight's shape."""

    def cases() -> list[Case]:
        generator = torch.Generator().manual_seed(13)
        out = []
        for rows, columns, group, note in [(1, 32, 32, "one group"), (4, 64, 32, "two groups a row"),
                                           (3, 96, 16, "groups of 16"), (8, 128, 64, "groups of 64")]:
            weight = torch.randn(rows, columns, generator=generator) * torch.rand(rows, 1, generator=generator) * 4
            out.append(Case({"weight": weight, "group_size": group},
                            dequantize_int4(*quantize_int4(weight, group)), note))
        shifted = torch.randn(2, 32, generator=generator) + 10  # every weight positive: the minimum is not 0
        out.append(Case({"weight": shifted, "group_size": 32}, dequantize_int4(*quantize_int4(shifted, 32)),
                        "all weights positive"))
        return out

    return run_cases("quantize_groups", fn, cases, close_tensors(rtol=1e-5, atol=1e-5),
                     "llm_runtime.model.quantized_linear.quantize_int4")


def check_read_q4_1_block(fn: object) -> Verdict:
    """`read_q4_1_block(block) -> list[float]`: `block` is 20 bytes: d (float16, little-endian), m (float16),
    then 16 bytes, byte j holding weight j in its low 4 bits and weight j + 16 in its high 4 bits. Weight i is
    d * q_i + m. Return the 32 weights in order (`np.frombuffer(block[:2], dtype=np.float16)` reads d)."""

    def cases() -> list[Case]:
        rng = np.random.default_rng(13)
        out = []
        for note in ("a random block", "another", "negative scale"):
            d = np.float16(rng.normal() * (-1 if note == "negative scale" else 1) * 0.1)
            m = np.float16(rng.normal())
            nibbles = rng.integers(0, 256, 16, dtype=np.uint8)
            block = bytes(np.array([d, m], dtype=np.float16).view(np.uint8)) + bytes(nibbles)
            expected = dequantize_q4_1(*q4_1_blocks(np.frombuffer(block, dtype=np.uint8)[None]))[0]
            out.append(Case({"block": block}, expected, note))
        return out

    tensors = close_tensors(rtol=1e-6, atol=1e-6)

    def compare(expected: torch.Tensor, got: object) -> str | None:
        try:
            got = torch.tensor(list(got), dtype=torch.float32)  # type: ignore[call-overload]
        except (TypeError, ValueError):
            return "expected 32 numbers"
        return tensors(expected, got)

    return run_cases("read_q4_1_block", fn, cases, compare, "llm_runtime.model.gguf.q4_1_blocks")


def check_quantize_kv_int8(fn: object) -> Verdict:
    """`quantize_kv_int8(x) -> tensor`: x (tokens, heads, head_dim) float32. Per token and head, scale =
    max |x| / 127 over head_dim, q = round(x / scale) in [-127, 127]; return q * scale, of x's shape."""

    def per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = (x.abs().amax(-1) / 127).clamp_min(2.0**-24)  # (tokens, heads)
        return (x / scale[..., None]).round().clamp(-127, 127) * scale[..., None], scale

    def cases() -> list[Case]:
        generator = torch.Generator().manual_seed(13)
        out = []
        for tokens, heads, dim, note in [(1, 1, 8, "one token, one head"), (5, 3, 64, "three heads"),
                                         (4, 2, 16, "tokens a thousand times apart")]:
            x = torch.randn(tokens, heads, dim, generator=generator)
            if note.startswith("tokens"):
                x = x * torch.tensor([1e-3, 1.0, 1e3, 0.5])[:, None, None]  # one scale for all would lose the small
            out.append(Case({"x": x}, per_token(x), note))
        return out

    def compare(expected: tuple[torch.Tensor, torch.Tensor], got: object) -> str | None:
        values, scale = expected
        if not isinstance(got, torch.Tensor) or got.shape != values.shape:
            return f"expected a tensor of shape {tuple(values.shape)}"
        error = (got.float() - values).abs() / scale[..., None]  # in steps of each token and head's scale
        if not bool((error <= 0.51).all()):
            worst = int(error.flatten(1).amax(1).argmax())
            return f"token {worst} is off by {float(error[worst].max()):.1f} steps of its scale"
        return None

    return run_cases("quantize_kv_int8", fn, cases, compare, "llm_runtime.lessons.exercises.lesson13 (per token)")
