"""Speculative decoding (lesson 14): proposers that guess the next tokens cheaply. The target model verifies the
guesses in one forward pass and `sampling/rejection.py` keeps them exactly; `config.SpeculativeConfig` says which
proposer guesses, and how far."""

from ..config import SpeculativeConfig
from .draft_model import DraftModelProposer, load_draft_model
from .ngram import NgramProposer, propose_ngram
from .proposer import Proposer
from .stats import SpeculationStats, expected_tokens_per_verification

__all__ = ["DraftModelProposer", "NgramProposer", "Proposer", "SpeculationStats", "SpeculativeConfig",
           "expected_tokens_per_verification", "load_draft_model", "propose_ngram"]
