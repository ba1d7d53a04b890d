"""Sampling: `SamplingParams` (what a request asks for) and the batched `Sampler` (how tokens are drawn)."""

from .params import FIELD_BOUNDS, GREEDY_TEMPERATURE, Bounds, RequestOutputKind, SamplingParams
from .sampler import Sampler, SamplerOutput, apply_min_p, apply_penalties, apply_top_k, apply_top_k_top_p, apply_top_p
from .seeded import SeededGenerator

__all__ = [
    "FIELD_BOUNDS",
    "Bounds",
    "RequestOutputKind",
    "GREEDY_TEMPERATURE",
    "Sampler",
    "SamplerOutput",
    "SamplingParams",
    "SeededGenerator",
    "apply_min_p",
    "apply_penalties",
    "apply_top_k",
    "apply_top_k_top_p",
    "apply_top_p",
]
