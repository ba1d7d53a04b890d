"""KV blocks from one engine to another (kv_transfer/payload.py, lesson 18), in one process: the producer prefills
a prompt, its whole blocks travel as frames, the consumer takes them into its pool and prefix cache and decodes
the same greedy tokens as an engine that computed everything, computing only the prompt's tail. Every pool
storage (the model's dtype, bfloat16, int8 with its scales, fp8); a payload of another model, dtype or block
size, or cut on the wire, is refused with nothing taken."""

from __future__ import annotations

import pytest
import torch

from llm_runtime import LLM, SamplingParams
from llm_runtime.core.block_manager import BlockManager
from llm_runtime.kv_transfer.payload import KVPayload
from llm_runtime.lessons.disaggregation import shipped_kv_bytes
from llm_runtime.model.loader import load_model_weights

PROMPT = [5, 17, 3, 42, 8, 11, 60, 96, 0, 50, 7, 7, 31, 2, 64, 19, 23, 88, 4, 45, 12, 9]  # 22 tokens: 5 blocks of 4
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
OPTIONS = dict(num_kv_blocks=32, block_size=4, compile_model=False)


def _engine(folder, dtype: str = "float32", **changes) -> LLM:
    model = load_model_weights(folder, device="cpu", dtype=dtype)
    return LLM.from_model(model, None, **{**OPTIONS, **changes})


@pytest.mark.parametrize("dtype, kv_cache_dtype", [("float32", "auto"), ("bfloat16", "auto"), ("float32", "int8"),
                                                   ("float32", "fp8")])
def test_a_consumer_decodes_a_producers_prompt_as_one_engine_does(tiny_checkpoints, dtype: str,
                                                                 kv_cache_dtype: str) -> None:
    folder = tiny_checkpoints["llama3"]
    with _engine(folder, dtype, kv_cache_dtype=kv_cache_dtype) as alone:
        expected = alone.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)[0].outputs[0]
    with _engine(folder, dtype, kv_cache_dtype=kv_cache_dtype) as producer:
        producer.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=1),
                          use_tqdm=False)
        payload = producer.llm_engine.export_prefix(PROMPT, "t1")
    assert payload.num_tokens == 20 and payload.num_blocks == 5  # whole blocks before the last prompt token
    config = producer.llm_engine.model.config
    assert payload.keys.nbytes + payload.values.nbytes == shipped_kv_bytes(
        len(PROMPT), 4, config.num_layers, config.num_kv_heads, config.head_dim, payload.keys.element_size())
    assert payload.keys.element_size() == (1 if kv_cache_dtype != "auto" else torch.empty((), dtype=getattr(
        torch, dtype)).element_size())
    shipped = KVPayload.from_frames([bytes(frame) for frame in payload.to_frames()])
    assert torch.equal(shipped.keys.view(torch.uint8), payload.keys.view(torch.uint8))
    with _engine(folder, dtype, kv_cache_dtype=kv_cache_dtype) as consumer:
        engine = consumer.llm_engine
        assert engine.import_prefix(shipped) == 20
        got = consumer.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)[0].outputs[0]
        assert engine.stats().prefix_cache_hit_tokens == 20  # the consumer computed 2 of the 22 prompt tokens
        engine.release_import("t1")
        engine.block_manager.check_invariants()
    assert got.token_ids == expected.token_ids
    worst = max(abs(a[t] - b[t]) for a, b, t in zip(expected.logprobs, got.logprobs, expected.token_ids))
    assert worst < 1e-5  # the same bytes of KV: the logprobs agree to the rounding of a different batch, or bitwise


def test_a_payload_of_another_layout_is_refused_and_nothing_is_taken(tiny_checkpoints) -> None:
    folder = tiny_checkpoints["llama3"]
    with _engine(folder) as producer:
        producer.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        payload = producer.llm_engine.export_prefix(PROMPT, "t2")
    other = load_model_weights(folder, device="cpu", dtype="float32")
    with torch.no_grad():
        other.model.layers[0].mlp.down_proj.weight[0, 0] += 1.0  # another model of the very same shape
    refusals = [(_engine(folder, block_size=8), "block_size"), (_engine(folder, "bfloat16"), "dtype"),
                (_engine(folder, kv_cache_dtype="fp8"), "storage"),
                (_engine(tiny_checkpoints["qwen3"]), "head_dim"),
                (LLM.from_model(other, None, **OPTIONS), "model")]
    for consumer, what in refusals:
        with consumer:
            free = consumer.llm_engine.block_manager.num_free_blocks
            with pytest.raises(ValueError, match=f"refused KV transfer 't2': the sender's {what}"):
                consumer.llm_engine.import_prefix(payload)
            assert consumer.llm_engine.block_manager.num_free_blocks == free
    with _engine(folder, enable_prefix_caching=False) as no_cache:
        with pytest.raises(ValueError, match="goes through the prefix cache"):
            no_cache.llm_engine.import_prefix(payload)


def test_frames_that_are_not_a_payload_are_refused(tiny_checkpoints) -> None:
    with _engine(tiny_checkpoints["llama3"]) as producer:
        producer.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        frames = [bytes(f) for f in producer.llm_engine.export_prefix(PROMPT, "t3").to_frames()]
    with pytest.raises(ValueError, match="3 frames"):
        KVPayload.from_frames(frames[:2])
    with pytest.raises(ValueError, match="holds .* bytes; its header says"):
        KVPayload.from_frames([frames[0], frames[1][:-4], frames[2]])
    with pytest.raises(ValueError, match="header is not valid"):
        KVPayload.from_frames([b"{not json", frames[1], frames[2]])


def test_imported_blocks_are_held_then_cached() -> None:
    blocks = BlockManager(num_blocks=8, block_size=2)
    tokens = [1, 2, 3, 4, 5, 6]
    taken, cached = blocks.import_prefix("x", tokens)
    assert len(taken) == 3 and cached == 0 and blocks.num_free_blocks == 5
    blocks.check_invariants()
    again, cached_again = blocks.import_prefix("y", tokens)  # the same prefix again: two blocks are cached
    assert again[:2] == taken[:2] and cached_again == 2
    assert blocks.num_cached_tokens(tokens + [7]) == 6  # a prompt that starts with them finds all three
    blocks.release_import("x")
    blocks.release_import("y")
    blocks.check_invariants()
    assert blocks.num_free_blocks == 8 and blocks.num_cached_tokens(tokens + [7]) == 6  # parked, still named
    with pytest.raises(ValueError, match="whole blocks"):
        blocks.import_prefix("z", [1, 2, 3])


def test_the_fingerprint_reads_what_the_weights_are_not_how_they_are_kept() -> None:
    """The bundled checkpoint quantized two ways has two fingerprints (before, only parameters were read: the
    int8 and the GGUF models, whose weights are buffers, matched, and a consumer would decode on KV of other
    weights); packed and unpacked, one (before, they never matched and every transfer was refused)."""
    from llm_runtime import load_model
    from llm_runtime.kv_transfer.payload import model_fingerprint
    from llm_runtime.model.packed_linear import pack_linears_

    plain, _ = load_model(None, dtype="float32")
    unpacked = model_fingerprint(plain)
    pack_linears_(plain)
    assert model_fingerprint(plain) == unpacked
    quantized = {q: model_fingerprint(load_model(None, dtype="bfloat16", quantization=q)[0]) for q in ("int8", "gguf")}
    assert quantized["int8"] != quantized["gguf"]
    assert unpacked not in quantized.values()
