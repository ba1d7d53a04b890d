"""causal_attention: each of its three cases equals explicit softmax(QK^T)V with a causal mask. And which
backend the selector picks on a GPU, asked on any machine with a pretend one (a capability, flash-attn
installed or not): only what can run with the block size, capability and dtype; a named one that cannot
says why.
"""

from __future__ import annotations

import pytest
import torch

from llm_runtime.attention import available_backends, causal_attention, flash, select_backend
from llm_runtime.attention.triton_backend import TritonBackend
from llm_runtime.config import ATTENTION_BACKEND_ENV

CUDA = torch.device("cuda")


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, H, S, d)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # (B, H, T, S)
    query_pos = torch.arange(num_cached, num_cached + q.shape[2])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[2])[None, :] > query_pos, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("num_cached,num_new", [(0, 7), (9, 1), (5, 4)], ids=["prefill", "decode", "chunk"])
def test_matches_naive_attention(num_cached: int, num_new: int) -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 6, num_new, 8, dtype=torch.float64)
    k = torch.randn(2, 2, num_cached + num_new, 8, dtype=torch.float64)
    v = torch.randn_like(k)
    out = causal_attention(q, k, v, num_cached)
    assert (out - naive_attention(q, k, v, num_cached)).abs().max() < 1e-12


def test_wrong_key_count_is_an_error() -> None:
    with pytest.raises(ValueError, match="keys"):
        causal_attention(torch.zeros(1, 2, 3, 4), torch.zeros(1, 1, 5, 4), torch.zeros(1, 1, 5, 4), num_cached=1)


@pytest.fixture
def pretend_gpu(monkeypatch: pytest.MonkeyPatch):
    """Set the pretend GPU's compute capability (flash-attn counts as installed); no GPU is touched."""
    monkeypatch.setattr(flash, "_installed_reason", lambda: None)

    def set_capability(capability: tuple[int, int]) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)

    return set_capability


def test_flash_attention_requirements() -> None:
    assert "8.0" in flash.capability_reason((7, 5), torch.float16)  # a T4
    assert "float16 or bfloat16" in flash.capability_reason((9, 0), torch.float32)
    assert flash.capability_reason((8, 0), torch.bfloat16) is None
    assert flash.capability_reason((9, 0), torch.float16) is None
    assert "multiple of 256" in flash.FlashAttentionBackend.supports_block_size(16)  # the engine's default block
    assert flash.FlashAttentionBackend.supports_block_size(512) is None


def test_auto_on_cuda_picks_only_what_can_run(pretend_gpu) -> None:
    """flash-attn first where it can run (sm80+, half precision, blocks of 256); else Triton (block-wise without it)."""
    fallback = "triton" if TritonBackend.is_available(CUDA, torch.float16) is None else "blockwise"
    cases = [((9, 0), torch.bfloat16, 256, "flash-attn"), ((8, 0), torch.float16, 512, "flash-attn"),
             ((9, 0), torch.bfloat16, 16, fallback),  # the default block: flash-attn's paged mode refuses it
             ((7, 5), torch.float16, 256, fallback),  # a T4
             ((9, 0), torch.float32, 256, fallback)]
    for capability, dtype, block_size, expected in cases:
        pretend_gpu(capability)
        assert select_backend("auto", "cuda", dtype, block_size=block_size).name == expected, (capability, dtype,
                                                                                                block_size)
        assert (available_backends("cuda", dtype, block_size)["flash-attn"] is None) == (expected == "flash-attn")


def test_a_named_backend_that_cannot_run_says_why(pretend_gpu) -> None:
    pretend_gpu((9, 0))
    with pytest.raises(ValueError, match="flash-attn.*blocks of 16 tokens.*multiple of 256"):
        select_backend("flash-attn", "cuda", torch.bfloat16, block_size=16)
    with pytest.raises(ValueError, match="multiple of 256"):  # named by the environment: the same answer
        select_backend("auto", "cuda", torch.bfloat16, {ATTENTION_BACKEND_ENV: "flash-attn"}, block_size=16)
    assert select_backend("flash-attn", "cuda", torch.bfloat16, block_size=256).name == "flash-attn"
    pretend_gpu((7, 5))
    with pytest.raises(ValueError, match="compute capability 8.0"):
        select_backend("flash-attn", "cuda", torch.float16, block_size=256)
