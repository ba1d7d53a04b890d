"""Lesson 19's helpers (lessons/decode_limit.py) and the batched interleaved timing it uses."""

from __future__ import annotations

from llm_runtime import LLM
from llm_runtime.bench.decode_roofline import interleaved_step_seconds
from llm_runtime.lessons.decode_limit import gguf_step_bytes, half_block_rows, static_schedule, step_weight_bytes
from llm_runtime.model.bundled import find_bundled_gguf
from llm_runtime.model.gguf import read_gguf_tensors
from llm_runtime.model import load_model


def test_the_bytes_of_a_step_are_the_layers_the_head_and_the_final_norm() -> None:
    model, _ = load_model(quantization="gguf")
    layers = sum(t.numel() * t.element_size() for t in (*model.model.layers.parameters(), *model.model.layers.buffers()))
    head = sum(t.numel() * t.element_size() for t in model.lm_head.buffers())  # the tied Q8_0 table
    assert step_weight_bytes(model) == layers + head + model.config.hidden_size * 2
    assert head == 49152 * 576 + 18 * 49152 * 2  # int8 values and a bfloat16 scale per 32


def test_llamacpps_bytes_a_step_are_every_tensor_of_a_file_whose_head_is_its_embedding(monkeypatch) -> None:
    """The bundled GGUF has no output.weight: its Q8_0 embedding is the head, read whole; a file with its own head
    reads one embedding row a token, not counted."""
    import llm_runtime.lessons.decode_limit as decode_limit

    path = find_bundled_gguf()
    tensors = read_gguf_tensors(path)
    assert "output.weight" not in tensors
    everything = sum(t.data.nbytes for t in tensors.values())
    assert gguf_step_bytes(path) == everything
    embedding = tensors["token_embd.weight"].data.nbytes
    assert embedding == 49152 * (576 // 32) * 34  # Q8_0: 32 int8 values and a float16 scale a block
    with_a_head = {**tensors, "output.weight": tensors["token_embd.weight"]}
    monkeypatch.setattr(decode_limit, "read_gguf_tensors", lambda _: with_a_head)
    assert gguf_step_bytes(path) == everything  # its own head read whole, the embedding not


def test_half_blocks_cover_every_row_once() -> None:
    rows = [row for item in range(960 // 32) for row in half_block_rows(item)]
    assert sorted(rows) == list(range(960))
    assert half_block_rows(3)[:2] == [80, 81] and half_block_rows(3)[16] == 112


def test_the_static_schedule_is_libgomps() -> None:
    assert [list(r) for r in static_schedule(5, 4)] == [[0, 1], [2], [3], [4]]
    for items in range(0, 40):
        for threads in range(1, 9):
            runs = static_schedule(items, threads)
            assert [i for run in runs for i in run] == list(range(items))
            assert max(map(len, runs)) - min(map(len, runs)) <= 1
            assert [len(r) for r in runs] == sorted((len(r) for r in runs), reverse=True)


def test_interleaved_timing_of_a_batch() -> None:
    model, _ = load_model(quantization="gguf")
    with LLM.from_model(model, None, kv_cache_memory=64 << 20, enforce_eager=True) as first, \
            LLM.from_model(model, None, kv_cache_memory=64 << 20) as second:
        engines = {"first": first.llm_engine, "second": second.llm_engine}
        seconds = interleaved_step_seconds(engines, prompt_len=8, num_steps=3, warmup=1, batch_size=3)
        assert set(seconds) == set(engines) and all(s > 0 for s in seconds.values())
        assert not any(engine.has_unfinished_requests() for engine in engines.values())
        assert second.llm_engine.stats().num_native_steps >= 3  # 3 sequences decoding: one native step each
