"""Speculative decoding (lesson 14): proposers that guess the next tokens cheaply, and their configuration.
The target model verifies the guesses in one forward pass and `sampling/rejection.py` keeps them exactly."""

from .config import SpeculativeConfig
from .ngram import propose_ngram

__all__ = ["SpeculativeConfig", "propose_ngram"]
