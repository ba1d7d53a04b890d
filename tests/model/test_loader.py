"""load_model: the bundled model, local folders, and one clear error for each way loading can fail."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from llm_runtime import ModelLoadError, load_model
from llm_runtime.model import load_checkpoint, resolve_model_folder
from llm_runtime.model.bundled import bundled_model_folder


@pytest.mark.slow
def test_bundled_model_loads_with_its_shape_and_tokenizer(bundled) -> None:
    model, tokenizer = bundled
    config = model.config
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (30, 576, 9, 3)
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # 135M, embeddings counted once
    assert tokenizer.chat_template is not None
    assert tokenizer.decode(tokenizer.encode("Hello, world!")) == "Hello, world!"


def test_bundled_folder_is_a_cache_outside_the_repo(tmp_path: Path) -> None:
    folder = resolve_model_folder(None)
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    assert Path(__file__).resolve().parents[1] not in folder.resolve().parents
    assert bundled_model_folder(tmp_path) == tmp_path / folder.name


def test_local_folder_loads_in_requested_dtype(tiny_checkpoints) -> None:
    model = load_checkpoint(tiny_checkpoints["qwen3"], device=torch.device("cpu"), dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32  # positions stay precise
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_unknown_name_says_what_was_tried() -> None:
    with pytest.raises(ModelLoadError) as error:
        load_model("no-such-org/no-such-model-xyz", device="cpu")
    message = str(error.value)
    assert "local folder" in message and "hub" in message and "no-such-org/no-such-model-xyz" in message


def test_name_that_is_neither_folder_nor_hub_id() -> None:
    with pytest.raises(ModelLoadError, match="organisation/name"):
        load_model("definitely not a model", device="cpu")


def test_folder_without_weights(tmp_path: Path, tiny_checkpoints) -> None:
    shutil.copy(tiny_checkpoints["llama2"] / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_checkpoint(tmp_path, device=torch.device("cpu"), dtype=torch.float32)


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path, device="cpu")


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*gpt2.*supported"):
        load_model(tmp_path, device="cpu")


def test_missing_weights_are_named(tmp_path: Path, tiny_checkpoints) -> None:
    from safetensors.torch import load_file, save_file

    source = tiny_checkpoints["llama2"]
    shutil.copy(source / "config.json", tmp_path / "config.json")
    weights = load_file(str(source / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.up_proj.weight"):
        load_checkpoint(tmp_path, device=torch.device("cpu"), dtype=torch.float32)
