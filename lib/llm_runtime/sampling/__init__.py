"""Sampling: `SamplingParams` (what a request asks for), the batched `Sampler` (how tokens are drawn) and
the rejection sampler that keeps speculative drafts exactly (`rejection.py`); `StructuredOutputsParams`, the
grammar a request's output must follow (lesson 15)."""

from .params import FIELD_BOUNDS, GREEDY_TEMPERATURE, Bounds, RequestOutputKind, SamplingParams
from .rejection import RejectionOutput, one_hot_greedy, rejection_sample
from .sampler import (Logprobs, Sampler, SamplerOutput, apply_min_p, apply_penalties, apply_top_k, apply_top_k_top_p, apply_top_p,
                      sampling_probs)
from .seeded import SeededGenerator
from .structured_outputs import StructuredOutputsParams

__all__ = [
    "FIELD_BOUNDS",
    "Bounds",
    "RequestOutputKind",
    "GREEDY_TEMPERATURE",
    "Logprobs",
    "RejectionOutput",
    "Sampler",
    "SamplerOutput",
    "SamplingParams",
    "SeededGenerator",
    "StructuredOutputsParams",
    "apply_min_p",
    "apply_penalties",
    "apply_top_k",
    "apply_top_k_top_p",
    "apply_top_p",
    "one_hot_greedy",
    "rejection_sample",
    "sampling_probs",
]
