"""The model: one Llama-family decoder in pure PyTorch, and loading it from checkpoints."""

from .bundled import BUNDLED_MODEL_NAME, prepare_bundled_model
from .causal_lm import CausalLM
from .loader import ModelLoadError, load_checkpoint, load_model, load_reason, read_model_config, resolve_model_folder

__all__ = [
    "BUNDLED_MODEL_NAME",
    "CausalLM",
    "ModelLoadError",
    "load_checkpoint",
    "load_model",
    "load_reason",
    "prepare_bundled_model",
    "read_model_config",
    "resolve_model_folder",
]
