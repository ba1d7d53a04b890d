"""A consumer's agent (serving/kv_agent.py) behind a running loop (serving/async_engine.py), over a tiny
random-weight model (milliseconds a step): payloads that pass the wire's checks but not the engine's (token ids
past the vocabulary, another layout) are refused alone and the loop serves on; an idle consumer takes blocks in
and lets unclaimed ones go at the timeout though no step runs; a busy consumer refuses arriving blocks instead of
pinning them, and a refused request's blocks go at once; a request may claim blocks only of its own prompt; a
claim whose request fails to join is let go."""

from __future__ import annotations

import asyncio
import time

import pytest

from llm_runtime import EngineConfig, LLMEngine, SamplingParams
from llm_runtime.errors import EngineBusyError
from llm_runtime.serving.kv_agent import KVTransferAgent
from llm_runtime.kv_transfer.config import KVTransferConfig
from llm_runtime.kv_transfer.payload import KVPayload
from llm_runtime.kv_transfer.zmq_connector import KVSender
from llm_runtime.serving.async_engine import AsyncLLMEngine

OPTIONS = dict(num_kv_blocks=64, block_size=4, compile_model=False)
PROMPT = list(range(300, 322))  # 22 tokens: 5 whole blocks of 4 before the last
OTHER = list(range(500, 522))


@pytest.fixture
def producer(tiny_chat_model):
    model, tokenizer = tiny_chat_model
    engine = LLMEngine(model, tokenizer, EngineConfig(**OPTIONS))
    yield engine
    engine.shutdown()


def _exported(engine: LLMEngine, prompt: list[int], transfer_id: str) -> KVPayload:
    engine.add_request(transfer_id, prompt, SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    return engine.export_prefix(prompt, transfer_id)


def _consumer(tiny_chat_model, timeout_s: float = 30.0, **options):
    model, tokenizer = tiny_chat_model
    engine = LLMEngine(model, tokenizer, EngineConfig(**OPTIONS))
    holder: list[AsyncLLMEngine] = []
    config = KVTransferConfig(kv_role="kv_consumer", kv_port=0, kv_transfer_timeout_s=timeout_s)
    agent = KVTransferAgent(engine, config, on_message=lambda: holder[0].wake())
    holder.append(AsyncLLMEngine(engine, kv_transfer=agent, **options))
    return engine, agent, holder[0]


async def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def _tokens(stream) -> list[int]:
    tokens = []
    async for output in stream:
        tokens = output.outputs[0].token_ids
    return tokens


def test_payloads_the_engine_refuses_end_only_themselves(tiny_chat_model, producer) -> None:
    """A payload with token ids past the vocabulary (2**31 - 1 passes the wire's check, not the model's) and one of
    another layout are refused and counted; the good one after them is taken and claimed, and the loop serves."""
    good = _exported(producer, PROMPT, "good")
    beyond = KVPayload("beyond", good.layout, [2**31 - 1] * good.num_tokens, good.keys, good.values)
    other = KVPayload("other", type(good.layout)(**{**good.layout.__dict__, "model": "another"}), good.token_ids,
                      good.keys, good.values)
    engine, agent, async_engine = _consumer(tiny_chat_model)
    sender = KVSender()

    async def scenario():
        await async_engine.start()
        for payload in (beyond, other, good):
            sender.send(payload, *agent.address)
        await _until(lambda: agent.ready("good") and agent.snapshot().refused_transfers == 2)
        streams = await async_engine.add_requests([PROMPT], SamplingParams(temperature=0, max_tokens=4),
                                                  kv_transfer_params={"do_remote_prefill": True, "transfer_id": "good"})
        tokens = await _tokens(streams[0])
        running = async_engine.is_running
        await async_engine.stop()
        return tokens, running

    try:
        tokens, running = asyncio.run(asyncio.wait_for(scenario(), 60))
        assert running and len(tokens) == 4 and agent.snapshot().received_transfers == 1
        assert engine.stats().prefix_cache_hit_tokens == 20 and not engine.block_manager.imports
    finally:
        sender.close()
        agent.close()
        engine.shutdown()


def test_an_idle_consumer_lets_unclaimed_blocks_go_at_the_timeout(tiny_chat_model, producer) -> None:
    """No request ever comes, so no step runs: the blocks are still taken in as they arrive, and let go when the
    timeout passes (before, an idle server held them, and its inbox grew, until some request ran a step)."""
    payload = _exported(producer, PROMPT, "idle")
    engine, agent, async_engine = _consumer(tiny_chat_model, timeout_s=0.5)
    sender = KVSender()

    async def scenario():
        await async_engine.start()
        sender.send(payload, *agent.address)
        await _until(lambda: bool(engine.block_manager.imports))
        held = engine.block_manager.num_free_blocks
        await _until(lambda: not engine.block_manager.imports, timeout_s=5)
        freed = engine.block_manager.num_free_blocks
        await async_engine.stop()
        return held, freed

    try:
        held, freed = asyncio.run(asyncio.wait_for(scenario(), 60))
        assert held == 64 - 5 and freed == 64 and agent.snapshot().expired_transfers == 1
        assert not engine.has_unfinished_requests()
    finally:
        sender.close()
        agent.close()
        engine.shutdown()


def test_a_busy_consumer_pins_no_blocks(tiny_chat_model, producer) -> None:
    """While a request waits for blocks that never come, the queue (max_waiting_requests=1) is full: blocks that
    arrive then are refused, not pinned; a request that is refused as busy lets its arrived blocks go at once."""
    arrived_first = _exported(producer, PROMPT, "first")
    during = _exported(producer, OTHER, "during")
    engine, agent, async_engine = _consumer(tiny_chat_model, max_waiting_requests=1)
    sender = KVSender()
    params = SamplingParams(temperature=0, max_tokens=2)

    async def scenario():
        await async_engine.start()
        sender.send(arrived_first, *agent.address)
        await _until(lambda: agent.ready("first"))
        waiting = asyncio.create_task(async_engine.add_requests(
            [[7, 8, 9, 10, 11]], params, kv_transfer_params={"do_remote_prefill": True, "transfer_id": "never"}))
        await _until(lambda: async_engine.is_full)
        with pytest.raises(EngineBusyError):
            await async_engine.add_requests([PROMPT], params, kv_transfer_params={"do_remote_prefill": True,
                                                                                   "transfer_id": "first"})
        await _until(lambda: not engine.block_manager.imports)  # its blocks went at the next boundary
        sender.send(during, *agent.address)
        await _until(lambda: agent.snapshot().refused_transfers == 1)
        assert not engine.block_manager.imports
        waiting.cancel()
        await async_engine.stop()

    try:
        asyncio.run(asyncio.wait_for(scenario(), 60))
        assert engine.block_manager.num_free_blocks == 64
    finally:
        sender.close()
        agent.close()
        engine.shutdown()


def test_a_request_claims_only_blocks_of_its_own_prompt(tiny_chat_model, producer) -> None:
    """A client that names another request's transfer does not get (or release) its blocks: its prompt differs, so
    it computes its own, and the request the blocks are for still finds them."""
    payload = _exported(producer, PROMPT, "theirs")
    engine, agent, async_engine = _consumer(tiny_chat_model)
    sender = KVSender()
    params = SamplingParams(temperature=0, max_tokens=2)
    claim = {"do_remote_prefill": True, "transfer_id": "theirs"}

    async def scenario():
        await async_engine.start()
        sender.send(payload, *agent.address)
        await _until(lambda: agent.ready("theirs"))
        intruder = await _tokens((await async_engine.add_requests([OTHER], params, kv_transfer_params=claim))[0])
        hits_after_intruder = engine.stats().prefix_cache_hit_tokens
        still_held = bool(engine.block_manager.imports)
        owner = await _tokens((await async_engine.add_requests([PROMPT], params, kv_transfer_params=claim))[0])
        await async_engine.stop()
        return intruder, hits_after_intruder, still_held, owner

    try:
        intruder, hits_after_intruder, still_held, owner = asyncio.run(asyncio.wait_for(scenario(), 60))
        assert len(intruder) == len(owner) == 2 and hits_after_intruder == 0 and still_held
        assert engine.stats().prefix_cache_hit_tokens == 20 and not engine.block_manager.imports
    finally:
        sender.close()
        agent.close()
        engine.shutdown()


def test_a_request_that_fails_to_join_lets_its_claimed_blocks_go(tiny_chat_model, producer) -> None:
    """The claim is made as the request is added between steps; when adding it fails, the blocks it claimed go
    with it (before, they stayed held, out of everyone's reach, for the server's life)."""
    payload = _exported(producer, PROMPT, "joins-not")
    engine, agent, async_engine = _consumer(tiny_chat_model)
    sender = KVSender()
    add = engine.add_processed

    def failing(request):
        raise RuntimeError("injected: this request cannot join")

    async def scenario():
        await async_engine.start()
        sender.send(payload, *agent.address)
        await _until(lambda: agent.ready("joins-not"))
        engine.add_processed = failing
        streams = await async_engine.add_requests([PROMPT], SamplingParams(max_tokens=2), kv_transfer_params={
            "do_remote_prefill": True, "transfer_id": "joins-not"})
        with pytest.raises(RuntimeError, match="cannot join"):
            await _tokens(streams[0])
        engine.add_processed = add
        await async_engine.stop()

    try:
        asyncio.run(asyncio.wait_for(scenario(), 60))
        assert not engine.block_manager.imports and engine.block_manager.num_free_blocks == 64
    finally:
        sender.close()
        agent.close()
        engine.shutdown()


def test_the_tables_of_refused_and_unwanted_transfers_are_bounded(monkeypatch) -> None:
    from collections import OrderedDict

    from llm_runtime.serving import kv_agent as agent_module

    monkeypatch.setattr(agent_module, "MAX_REMEMBERED", 8)
    table: OrderedDict[str, float] = OrderedDict()
    for i in range(100):  # a flood of refused payloads under fresh transfer ids
        agent_module._remember(table, f"t{i}")
    assert list(table) == [f"t{i}" for i in range(92, 100)]


def test_payloads_of_no_block_are_refused(tiny_chat_model, producer) -> None:
    """A payload of 0 tokens passes the wire's checks; taken, each would add an entry no request ever claims, under
    transfer ids of the sender's choosing, and weigh nothing against the pool's share: refused."""
    good = _exported(producer, PROMPT, "good")
    empty = KVPayload("empty", good.layout, [], good.keys[:, :0], good.values[:, :0])
    engine, agent, async_engine = _consumer(tiny_chat_model)
    sender = KVSender()

    async def scenario():
        await async_engine.start()
        for i in range(20):
            sender.send(KVPayload(f"empty-{i}", empty.layout, [], empty.keys, empty.values), *agent.address)
        sender.send(good, *agent.address)
        await _until(lambda: agent.ready("good"))
        await async_engine.stop()

    try:
        asyncio.run(asyncio.wait_for(scenario(), 60))
        assert agent.snapshot().refused_transfers == 20 and list(engine.block_manager.imports) == [
            ("kv-import", "good")]
    finally:
        sender.close()
        agent.close()
        engine.shutdown()
