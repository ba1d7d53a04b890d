"""Shared fixtures: tiny random-weight checkpoints of each supported family, and the bundled model."""

from __future__ import annotations

import os

# Tests never touch the network: make hub look-ups fail at once instead of timing out.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# Without CUDA, the Triton kernels' tests run under Triton's interpreter. Triton reads the switch when a
# function is decorated, its own library's included, so it is set here, before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from llm_runtime.model import load_checkpoint  # noqa: E402

_COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    eos_token_id=2,
    bos_token_id=1,
)

# One tiny config per supported family (and per rope variant that changes the math).
TINY_FAMILIES: dict[str, tuple[str, dict]] = {
    "llama2": ("LlamaConfig", dict(rope_theta=10000.0)),
    "llama3": ("LlamaConfig", dict(
        rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64),
    )),
    "llama_linear_rope": ("LlamaConfig", dict(rope_scaling=dict(rope_type="linear", factor=2.0))),
    "smollm2": ("LlamaConfig", dict(rope_theta=100000.0, tie_word_embeddings=True, num_key_value_heads=1)),
    "qwen2": ("Qwen2Config", dict(rope_theta=1000000.0, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(rope_theta=1000000.0, head_dim=32, tie_word_embeddings=False)),
}


def make_hf_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A transformers model of `family` with random weights (norms and biases included), in float64."""
    import transformers

    config_class, extra = TINY_FAMILIES[family]
    config = getattr(transformers, config_class)(**{**_COMMON, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.3 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15)
    return model.to(torch.float64).eval()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A saved Hugging Face folder per family."""
    folders = {}
    for family in TINY_FAMILIES:
        folder = tmp_path_factory.mktemp(family)
        make_hf_model(family).save_pretrained(str(folder))
        folders[family] = folder
    return folders


@pytest.fixture(scope="session")
def tiny_pairs(tiny_checkpoints: dict[str, Path]) -> dict[str, tuple[torch.nn.Module, torch.nn.Module]]:
    """(ours, transformers') for each family, both float64 on CPU, loaded from the same folder."""
    import transformers

    pairs = {}
    for family, folder in tiny_checkpoints.items():
        reference = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=torch.float64, attn_implementation="sdpa"
        ).eval()
        ours = load_checkpoint(folder, device=torch.device("cpu"), dtype=torch.float64)
        pairs[family] = (ours, reference)
    return pairs


@pytest.fixture(scope="session")
def bundled():
    """(model, tokenizer) of the bundled SmolLM2-135M-Instruct, float32 on CPU."""
    from llm_runtime import load_model

    return load_model(None, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def bundled_tokenizer():
    """The bundled model's tokenizer alone (no weights loaded)."""
    from llm_runtime import load_tokenizer
    from llm_runtime.model import resolve_model_folder

    return load_tokenizer(resolve_model_folder(None))


@pytest.fixture(scope="session")
def bundled_reference(bundled):
    """transformers' own model loaded from the same converted folder, float32 on CPU."""
    import transformers

    from llm_runtime.model import resolve_model_folder

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(resolve_model_folder(None)), dtype=torch.float32
    ).eval()


def transformers_greedy(reference: torch.nn.Module, prompt: list[int], num_tokens: int) -> list[int]:
    """transformers' `generate`, greedy, exactly `num_tokens` new tokens (EOS does not stop it)."""
    import copy

    config = copy.deepcopy(reference.generation_config)
    config.eos_token_id = []  # an empty list disables stopping; None would fall back to the model's EOS
    config.pad_token_id = 0
    config.do_sample = False
    config.max_new_tokens = num_tokens
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), generation_config=config)
    return out[0, len(prompt):].tolist()


@pytest.fixture(autouse=True)
def engine_invariants(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every engine a test builds (directly, through LLM, the server or a benchmark) checks its books
    after every step, as `EngineConfig(check_invariants=True)` does."""
    from llm_runtime.engine.engine import LLMEngine

    step = LLMEngine.step

    def checked_step(self: LLMEngine):
        outputs = step(self)
        self.check_invariants()
        return outputs

    monkeypatch.setattr(LLMEngine, "step", checked_step)


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory):
    """(model, tokenizer): a 2-layer random-weight float64 Llama over the bundled model's tokenizer and chat
    template, for tests that exercise the serving path, not the model (milliseconds per step)."""
    import shutil

    import transformers

    from llm_runtime import load_model
    from llm_runtime.model import resolve_model_folder

    bundled = resolve_model_folder(None)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(bundled))
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny_chat")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (bundled / name).exists():
            shutil.copy(bundled / name, folder)
    return load_model(folder, device="cpu", dtype="float64")  # float64: batching cannot flip an argmax


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Say out loud that the dashboard's browser test did not run, and why (`-q` counts skips without reasons)."""
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if "dashboard browser test skipped" in reason:
            terminalreporter.write_line(reason.removeprefix("Skipped: "), yellow=True, bold=True)
            return
