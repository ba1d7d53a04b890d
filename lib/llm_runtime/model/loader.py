"""`load_model`: a name or folder in, our `CausalLM` and its tokenizer out.

Where the weights come from, in order: `None` is the bundled SmolLM2 (converted once into a cache
folder); an existing folder is read as a Hugging Face checkpoint (config.json + *.safetensors);
anything shaped like `org/name` is downloaded from the Hugging Face hub. Failures say what was tried.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from ..config import ModelConfig
from ..device import device_profile, resolve_device, resolve_dtype
from ..distributed.sharding import Shard, plan_shards, shard_model_
from .tokenizer import Tokenizer, load_tokenizer
from .bundled import find_bundled_gguf, prepare_bundled_model
from .causal_lm import CausalLM
from .gguf import load_gguf_embedding_, load_gguf_linears_
from .half_products import emulate_half_products_
from .quantized_linear import QUANTIZATIONS, quantize_linears_

if TYPE_CHECKING:
    from ..distributed.group import TensorParallelGroup

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


class ModelLoadError(ValueError):
    """A model could not be found or loaded; the message lists every place that was tried."""


def load_model(
    name_or_path: str | Path | None = None,
    *,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    cache_dir: str | Path | None = None,
    quantization: str | None = None,
    group_size: int | None = None,
    tensor_parallel: TensorParallelGroup | None = None,
) -> tuple[CausalLM, Tokenizer]:
    """Load (model, tokenizer): None = bundled SmolLM2-135M-Instruct, else a local folder or a hub id.

    `quantization` (lesson 13): "int8" (per output channel; with `group_size=32`, in groups of 32 input
    columns with a zero) or "int4" (groups of `group_size` input columns, default 32) quantizes the linear
    layers at load time; "gguf" runs the bundled model's own Q4_1 blocks as
    int4 and keeps its Q8_0 embedding (tied to the head) as int8. A quantized model computes in bfloat16 unless `dtype` says float32 (the kernels' fast path).
    `tensor_parallel` (lesson 17): load that rank's shard only (int8 and int4 quantize the shard's layers)."""
    model = load_model_weights(name_or_path, device=device, dtype=dtype, cache_dir=cache_dir,
                               quantization=quantization, group_size=group_size, tensor_parallel=tensor_parallel)
    return model, load_tokenizer(resolve_model_folder(name_or_path, cache_dir))


def load_model_weights(
    name_or_path: str | Path | None = None,
    *,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    cache_dir: str | Path | None = None,
    quantization: str | None = None,
    group_size: int | None = None,
    tensor_parallel: TensorParallelGroup | None = None,
) -> CausalLM:
    """`load_model`'s model without its tokenizer (what a tensor-parallel worker needs)."""
    resolved_device = resolve_device(device)
    if quantization == "gguf" and name_or_path is not None:
        raise ValueError("quantization='gguf' loads the bundled model's own GGUF blocks; pass no model name")
    resolved_dtype, reason = _load_dtype(resolved_device, dtype, quantization)
    if reason is not None:
        raise ValueError(reason)
    sharded = tensor_parallel is not None and tensor_parallel.size > 1
    if quantization == "gguf" and sharded:
        raise ValueError("quantization='gguf' loads the GGUF's blocks whole and does not shard them over ranks; "
                         "use quantization='int4' (the same group size, quantized per shard) or none")
    folder = resolve_model_folder(name_or_path, cache_dir)
    if sharded and quantization in ("int8", "int4"):
        assert tensor_parallel is not None
        _check_sharded_groups(read_model_config(folder), tensor_parallel.size, quantization, group_size)
    model = load_checkpoint(folder, device=resolved_device, dtype=resolved_dtype, tensor_parallel=tensor_parallel)
    if quantization == "gguf":
        load_gguf_linears_(model, find_bundled_gguf(), dtype=resolved_dtype)
        load_gguf_embedding_(model, find_bundled_gguf(), dtype=resolved_dtype)
    elif quantization is not None:
        quantize_linears_(model, quantization, group_size=group_size, dtype=resolved_dtype)
    elif resolved_dtype == torch.float16 and device_profile(resolved_device).emulated:
        emulate_half_products_(model)  # a played T4's float16 products, summed in float32 as its tensor cores do
    model.source = "" if name_or_path is None else str(name_or_path)
    return model


def _check_sharded_groups(config: ModelConfig, size: int, quantization: str, group_size: int | None) -> None:
    """A quantized shard must quantize as the whole model does: its row-parallel layers (o, down) hold a slice of
    each row's input columns, so their scales must come from groups that the slice holds whole."""
    if quantization == "int8" and group_size is None:
        raise ValueError("int8 with one scale per output channel does not shard: a row-parallel rank holds a slice "
                         "of each row, whose scale comes from the whole row; use group_size=32 or int4")
    group = group_size or 32
    for name, width in (("o_proj", config.num_heads // size * config.head_dim),
                        ("down_proj", config.intermediate_size // size)):
        if width % group:
            raise ValueError(f"{quantization} groups of {group} columns do not shard over {size} ranks: each holds "
                             f"{width} of {name}'s input columns")


def load_reason(device: str | torch.device = "auto", dtype: str | torch.dtype = "auto",
                quantization: str | None = None, **_: object) -> str | None:
    """None when `load_model(..., device=, dtype=, quantization=)` can load here; else the reason it would
    refuse (a T4 has no bfloat16 and no quantized kernels). Extra keywords (group_size) are accepted and
    ignored, so a lesson passes a configuration's options as they are: `load_reason(DEVICE, **options)`."""
    return _load_dtype(resolve_device(device), dtype, quantization)[1]


def _load_dtype(device: torch.device, dtype: str | torch.dtype,
                quantization: str | None) -> tuple[torch.dtype, str | None]:
    """The dtype a model loads in on `device`, and the reason it cannot (None: it can)."""
    profile = device_profile(device)
    if quantization is None:
        resolved = resolve_dtype(dtype, device)
        return resolved, profile.dtype_reason(resolved)
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} or None, got {quantization!r}")
    resolved = torch.bfloat16 if dtype == "auto" else resolve_dtype(dtype, device)  # the kernels' dtype
    return resolved, profile.quantized_reason(resolved)


def resolve_model_folder(name_or_path: str | Path | None, cache_dir: str | Path | None = None) -> Path:
    """The local folder that holds the checkpoint, downloading or converting it if needed."""
    if name_or_path is None:
        try:
            return prepare_bundled_model(cache_dir)
        except FileNotFoundError as error:
            raise ModelLoadError(f"could not load the bundled model: {error}") from error
    tried: list[str] = []
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    tried.append(f"local folder {str(path)!r}: does not exist")
    name = str(name_or_path)
    if _HUB_ID.match(name):
        try:
            return _download_from_hub(name, cache_dir)
        except Exception as error:  # any hub failure (offline, unknown repo, gated) is reported the same way
            tried.append(f"Hugging Face hub id {name!r}: {type(error).__name__}: {error}")
    else:
        tried.append(f"Hugging Face hub id {name!r}: not of the form 'organisation/name'")
    raise ModelLoadError(f"could not load model {name!r}; tried:\n  - " + "\n  - ".join(tried))


def _download_from_hub(repo_id: str, cache_dir: str | Path | None) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES, cache_dir=cache_dir))


def read_model_config(folder: str | Path) -> ModelConfig:
    """ModelConfig from a folder's config.json (and generation_config.json, for the EOS ids)."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"no config.json in {str(folder)!r}: not a Hugging Face model folder")
    hf_config = json.loads(config_path.read_text())
    generation_path = folder / "generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.is_file() else None
    try:
        return ModelConfig.from_hf(hf_config, generation)
    except (KeyError, ValueError) as error:
        raise ModelLoadError(f"{str(config_path)!r}: {error}") from error


def load_checkpoint(folder: str | Path, *, device: torch.device, dtype: torch.dtype,
                    tensor_parallel: TensorParallelGroup | None = None) -> CausalLM:
    """Build a CausalLM from a Hugging Face folder, placing each weight straight on `device` in `dtype`. With
    `tensor_parallel`, the model is that rank's shard (distributed/sharding.py), and only the shard's rows or
    columns of each tensor are read from the files."""
    folder = Path(folder)
    config = read_model_config(folder)
    weight_files = sorted(folder.glob("*.safetensors"))
    if not weight_files:
        found = ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"
        raise ModelLoadError(f"no *.safetensors weights in {str(folder)!r} (found: {found})")

    # Build the skeleton without allocating or initialising weights, then adopt the checkpoint's.
    with torch.device("meta"):
        model = CausalLM(config)
    shards: dict[str, Shard] = {}
    if tensor_parallel is not None and tensor_parallel.size > 1:
        shards = plan_shards(config, tensor_parallel.rank, tensor_parallel.size)
        shard_model_(model, tensor_parallel)  # the rank's shapes, still on the meta device
    expected = set(model.state_dict())
    state: dict[str, torch.Tensor] = {}
    for file in weight_files:
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for key in reader.keys():
                if key in expected:
                    tensor = shards[key].read(reader.get_slice(key)) if key in shards else reader.get_tensor(key)
                    state[key] = tensor.to(device=device, dtype=dtype)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    missing = sorted(expected - set(state))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"checkpoint in {str(folder)!r} lacks weights: {shown}")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # The rotary buffer is not in checkpoints; compute it on the device (kept in float32).
    model.model.rotary_emb.inv_freq = config.rope.inverse_frequencies(config.head_dim).to(device)
    model.eval().requires_grad_(False)
    return model
