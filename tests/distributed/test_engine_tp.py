"""The engine at tensor_parallel_size > 1 (executor/rank_processes.py, lesson 17), on gloo ranks on the CPU, in float32:
the same greedy tokens as one rank and logprobs within 1e-4, with chunked prefill, prefix caching, preemption,
n-gram speculation and prompt logprobs on; the bundled model at 3 ranks, tiny models of every family at 2 (one
with a single KV head, replicated); the compiled forward pass, a draft model and 8-bit KV pools at 2 ranks. Refusals, and faults: a worker killed mid-run makes the engine dead within
seconds (its requests fail, nothing hangs), and no worker outlives the engine, even when the parent is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from llm_runtime import LLM, EngineConfig, SamplingParams, load_model
from llm_runtime.errors import EngineDeadError

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Write a haiku about autumn:", "1, 2, 3, 4,",
           "The quick brown fox jumps over the lazy dog. The quick brown fox", "Once upon a time"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def _descendants() -> list[int]:
    """This process's live children and theirs: the workers (forked from the fork server, this process's child, on
    the CPU; spawned by this process itself on CUDA)."""
    found, parents = [], [os.getpid()]
    while parents:
        try:
            out = subprocess.run(["pgrep", "-P", str(parents.pop())], capture_output=True, text=True).stdout
        except FileNotFoundError:
            pytest.skip("pgrep is not installed")
        found += [int(pid) for pid in out.split()]
        parents += [int(pid) for pid in out.split()]
    return found


def _compare(one, many) -> float:
    """Same tokens for every request; the largest logprob difference of the generated tokens and the prompts'."""
    worst = 0.0
    for a, b in zip(one, many, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for x, y, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            worst = max(worst, abs(x[t] - y[t]))
        if a.prompt_logprobs is not None:
            for x, y, t in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], a.prompt_token_ids[1:]):
                worst = max(worst, abs(x[t] - y[t]))
    return worst


@pytest.fixture(scope="module")
def bundled_tp1():
    params = [SamplingParams(temperature=0, max_tokens=40, logprobs=0, prompt_logprobs=0 if i % 2 else None)
              for i in range(len(PROMPTS))]
    options = dict(dtype="float32", max_num_batched_tokens=40, max_num_seqs=8, num_kv_blocks=10,
                   enable_prefix_caching=True, speculative_config=NGRAM)
    with LLM(compile_model=False, **options) as llm:
        return params, options, llm.generate(PROMPTS + PROMPTS[:2], params + params[:2], use_tqdm=False)


def test_the_bundled_model_at_3_ranks_gives_one_ranks_tokens(bundled_tp1) -> None:
    params, options, expected = bundled_tp1
    with LLM(tensor_parallel_size=3, **options) as llm:
        engine = llm.llm_engine
        assert engine.model.config.num_heads == 3 and engine.model.config.num_kv_heads == 1  # 9 heads, 3 KV
        workers = [p.pid for p in engine.workers.processes]
        assert len(workers) == 2 and set(workers) <= set(_descendants())  # ranks 1 and 2, started here
        got = llm.generate(PROMPTS + PROMPTS[:2], params + params[:2], use_tqdm=False)
        assert engine.scheduler.num_preemptions > 0  # 10 blocks of 16 tokens for 7 requests: some were preempted
        assert engine.spec_stats is not None and engine.spec_stats.num_draft_tokens > 0
        assert engine.scheduler.num_prefix_hit_tokens > 0  # the repeated prompts
    assert _compare(expected, got) < 1e-4
    assert not [pid for pid in workers if _alive(pid)], "a worker outlived its engine"


@pytest.mark.parametrize("family", ["llama3", "smollm2", "qwen3"])  # smollm2: one KV head on 2 ranks
def test_tiny_models_at_2_ranks_give_one_ranks_tokens(tiny_checkpoints, family: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=0, prompt_logprobs=0)
    prompts = [{"prompt_token_ids": [5, 17, 3, 42, 8, 11, 60, 96, 0, 50]}, {"prompt_token_ids": [1, 2, 3, 4]}]
    folder = tiny_checkpoints[family]
    results = []
    for size in (1, 2):
        model, _ = _tiny(folder)
        with LLM.from_model(model, None, tensor_parallel_size=size, num_kv_blocks=32, compile_model=False,
                            max_num_batched_tokens=32, max_num_seqs=4) as llm:
            results.append(llm.generate(prompts, params, use_tqdm=False))
    assert _compare(*results) < 1e-4


def test_the_compiled_forward_at_2_ranks_gives_one_ranks_tokens(tiny_checkpoints) -> None:
    """compile_model=True at 2 ranks: every rank compiles its graph, with the collectives as operators in it, and
    runs the steps rank 0 runs compiled (chunks that sample nothing among them), the others eagerly (prompt
    logprobs); with chunked prefill, prefix hits, preemption and n-gram speculation, one rank's tokens."""
    long_prompt = [5, 17, 3, 42, 8, 11, 60, 96, 0, 50] * 3
    prompts = [{"prompt_token_ids": ids} for ids in (long_prompt, [1, 2, 3, 4] * 4, long_prompt, [7, 7, 8, 9])]
    params = [SamplingParams(temperature=0, max_tokens=24, logprobs=0, ignore_eos=True,
                             prompt_logprobs=0 if i == 1 else None) for i in range(len(prompts))]
    options = dict(num_kv_blocks=12, block_size=8, max_num_batched_tokens=16, max_num_seqs=4,
                   enable_prefix_caching=True, speculative_config=NGRAM)
    results, stats = [], []
    for size, compiled in ((1, False), (2, True)):
        model, _ = _tiny(tiny_checkpoints["llama3"])
        with LLM.from_model(model, None, tensor_parallel_size=size, compile_model=compiled, **options) as llm:
            results.append(llm.generate(prompts, params, use_tqdm=False))
            stats.append((llm.llm_engine.stats(), llm.llm_engine.scheduler.num_preemptions,
                          llm.llm_engine.scheduler.num_prefix_hit_tokens))
    engine_stats, preemptions, prefix_hits = stats[1]
    assert engine_stats.compiled_model and engine_stats.num_compiled_steps > 0
    assert preemptions > 0 and prefix_hits > 0 and engine_stats.num_draft_tokens > 0
    assert _compare(*results) < 1e-4


def test_a_draft_model_drafts_on_rank_0_for_a_sharded_target(tiny_checkpoints) -> None:
    """Draft-model speculation at 2 ranks: the draft runs whole on rank 0 (its own pool, no collectives), the
    sharded target verifies; one rank's tokens, every draft accepted (the draft is the target's own weights)."""
    from llm_runtime.engine.engine import LLMEngine

    folder = tiny_checkpoints["llama3"]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    results = []
    for size in (1, 2):
        engine = LLMEngine(_tiny(folder)[0], None, EngineConfig(
            tensor_parallel_size=size, num_kv_blocks=32, compile_model=False,
            speculative_config={"method": "draft", "model": str(folder), "num_speculative_tokens": 3}),
            draft_model=_tiny(folder)[0])
        try:
            engine.add_request("a", {"prompt_token_ids": [5, 17, 3, 42, 8, 11, 60, 96, 0, 50] * 2}, params)
            engine.add_request("b", {"prompt_token_ids": [1, 2, 3, 4]}, params)
            done = {}
            while engine.has_unfinished_requests():
                done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
            assert engine.spec_stats.num_draft_tokens > 0
            assert engine.spec_stats.num_accepted_tokens == engine.spec_stats.num_draft_tokens
            results.append(done)
        finally:
            engine.shutdown()
    assert results[1] == results[0]


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_an_8_bit_kv_pool_at_2_ranks_gives_one_ranks_tokens(tiny_checkpoints, kv_cache_dtype: str) -> None:
    """Each rank's pool holds its own heads in 8 bits; int8's scales are measured on every rank at once (the
    calibration's forward passes meet in their collectives), each rank's for its own heads. The tokens are one
    rank's; the logprobs only as close as 8-bit rounding of values that differ in their last float32 bits."""
    prompts = [{"prompt_token_ids": [5, 17, 3, 42, 8, 11, 60, 96, 0, 50]}, {"prompt_token_ids": [1, 2, 3, 4]}]
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=0, ignore_eos=True)
    results = []
    for size in (1, 2):
        with LLM.from_model(_tiny(tiny_checkpoints["qwen3"])[0], None, tensor_parallel_size=size, num_kv_blocks=32,
                            compile_model=False, kv_cache_dtype=kv_cache_dtype) as llm:
            assert llm.llm_engine.kv_cache.keys[0].element_size() == 1  # 8 bits an element
            results.append(llm.generate(prompts, params, use_tqdm=False))
    for one, two in zip(*results, strict=True):
        assert two.outputs[0].token_ids == one.outputs[0].token_ids


def _tiny(folder):
    from llm_runtime.model.loader import load_model_weights

    return load_model_weights(folder, device="cpu", dtype="float32"), None


def test_what_does_not_split_or_run_yet_is_refused(tiny_checkpoints) -> None:
    with pytest.raises(ValueError, match="4 attention heads do not divide over 3"):
        LLM.from_model(_tiny(tiny_checkpoints["llama3"])[0], None, tensor_parallel_size=3, num_kv_blocks=8)
    with pytest.raises(ValueError, match="does not run yet with cuda_graphs"):
        EngineConfig(tensor_parallel_size=2, cuda_graphs=True)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig(tensor_parallel_size=0)
    model = _tiny(tiny_checkpoints["llama3"])[0]
    model.source = None
    with pytest.raises(ValueError, match="load the model by its name"):
        LLM.from_model(model, None, tensor_parallel_size=2, num_kv_blocks=8)


def test_a_killed_worker_makes_the_engine_dead_quickly(tiny_checkpoints) -> None:
    model, _ = _tiny(tiny_checkpoints["llama3"])
    llm = LLM.from_model(model, None, tensor_parallel_size=2, num_kv_blocks=32, compile_model=False)
    try:
        engine = llm.llm_engine
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        engine.add_request("a", {"prompt_token_ids": [1, 2, 3]}, params)
        engine.step()
        os.kill(engine.workers.processes[0].pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(EngineDeadError):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - started < 30
        assert "exited" in repr(engine.dead_reason)
        with pytest.raises(EngineDeadError):
            engine.step()
    finally:
        llm.shutdown()
    assert not [p for p in llm.llm_engine.workers.processes if p.is_alive()]


def test_a_request_that_fails_in_sampling_fails_alone_at_2_ranks(tiny_checkpoints, monkeypatch) -> None:
    """A failure after the forward pass (a grammar's mask, the sampler: a SamplingError) leaves every rank done with
    the step's collectives: the step runs again one request at a time, the faulty request alone fails, and the
    engine and its workers serve on (a failure inside the forward pass still ends a sharded engine)."""
    from llm_runtime.worker import model_runner

    sample = model_runner.sample_sequences

    def failing(sampler, logits, seqs):
        if any(seq.request_id == "poison" for seq in seqs):
            raise RuntimeError("injected fault in sampling")
        return sample(sampler, logits, seqs)

    monkeypatch.setattr(model_runner, "sample_sequences", failing)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = {"a": [5, 17, 3, 42], "poison": [1, 2, 3], "b": [60, 96, 0, 50, 7]}
    results = []
    for size in (1, 2):
        model, _ = _tiny(tiny_checkpoints["llama3"])
        with LLM.from_model(model, None, tensor_parallel_size=size, num_kv_blocks=32, compile_model=False) as llm:
            engine = llm.llm_engine
            for request_id, prompt in prompts.items():
                engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
            finals = {}
            while engine.has_unfinished_requests():
                finals.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
            assert engine.dead_reason is None and engine.stats().num_failed_requests == 1
            assert finals["poison"].finish_reason == "error"
            results.append({k: finals[k].token_ids for k in ("a", "b")})
            if size == 2:
                assert engine.workers.check() is None
    assert results[0] == results[1] and all(len(tokens) == 8 for tokens in results[0].values())


def test_a_hung_worker_makes_the_engine_dead_at_the_step_timeout(tiny_checkpoints) -> None:
    """A worker that stops answering (SIGSTOP: alive, but never reaching the collective) fails the step at
    tensor_parallel_timeout_s, not never; shutdown then reaps it."""
    model, _ = _tiny(tiny_checkpoints["llama3"])
    llm = LLM.from_model(model, None, tensor_parallel_size=2, num_kv_blocks=32, compile_model=False,
                         tensor_parallel_timeout_s=2.0)
    engine = llm.llm_engine
    worker = engine.workers.processes[0].pid
    try:
        engine.add_request("a", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=400,
                                                                               ignore_eos=True))
        engine.step()
        os.kill(worker, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(EngineDeadError):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - started < 20
    finally:
        llm.shutdown()
    assert not _alive(worker)


def test_rank_0_sends_no_longer_than_the_step_timeout_to_a_rank_that_never_listens() -> None:
    """Gloo's root waits for each receiver to post its receive, and the control group's own timeout is a year: a
    worker stopped between steps once hung rank 0 in the next step's header. Rank 0's waits have the step's
    deadline (the group's `timeout`); the other ranks' waits between steps have none."""
    from llm_runtime.distributed.group import init_tensor_parallel
    from llm_runtime.distributed.launch import free_port

    port = free_port()
    script = textwrap.dedent(f"""
        import time
        from llm_runtime.distributed.group import init_tensor_parallel
        tp = init_tensor_parallel(1, 2, "cpu", "127.0.0.1", {port}, timeout_s=1.0)
        time.sleep(60)  # joined, and never receives
    """)
    other = subprocess.Popen([sys.executable, "-c", script])
    try:
        tp = init_tensor_parallel(0, 2, "cpu", "127.0.0.1", port, timeout_s=1.0)
        raised: list[BaseException] = []

        def send() -> None:
            try:
                tp.broadcast_from_first(torch.zeros(9, dtype=torch.int64), control=True)
            except BaseException as error:
                raised.append(error)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        sender.join(timeout=15)  # a regression hangs here: the other rank's end (finally) then releases it
        assert not sender.is_alive(), "rank 0 still waits for a rank that never receives"
        assert raised and isinstance(raised[0], RuntimeError) and "timed out" in str(raised[0]), raised
        tp.abort()
    finally:
        other.kill()
        other.wait()


def test_no_worker_outlives_a_killed_parent(tiny_checkpoints) -> None:
    script = textwrap.dedent(f"""
        import os, sys, time
        from llm_runtime import LLM
        from llm_runtime.model.loader import load_model_weights
        if __name__ == "__main__":
            model = load_model_weights({str(tiny_checkpoints["llama3"])!r}, device="cpu", dtype="float32")
            llm = LLM.from_model(model, None, tensor_parallel_size=2, num_kv_blocks=16, compile_model=False)
            print(llm.llm_engine.workers.processes[0].pid, flush=True)
            time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)  # and not reaped yet: a zombie, whose pid still answers
        deadline = time.monotonic() + 10
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker), "the worker outlived its killed parent"
        parent.wait(timeout=10)
    finally:
        parent.kill()


def test_an_engine_built_on_a_thread_that_retires_keeps_its_ranks(tiny_checkpoints) -> None:
    """Built on a thread that then ends (anyio's and thread pools' threads retire): its workers live on. Under
    PR_SET_PDEATHSIG the kernel killed them when that thread exited, and the engine's next step failed."""
    model, _ = _tiny(tiny_checkpoints["llama3"])
    built: list[LLM] = []
    builder = threading.Thread(target=lambda: built.append(LLM.from_model(
        model, None, tensor_parallel_size=2, num_kv_blocks=32, compile_model=False)))
    builder.start()
    builder.join()
    llm = built[0]
    try:
        time.sleep(1.5)  # past the kernel's signal, and the parent watch's poll
        assert llm.llm_engine.workers.check() is None
        outputs = llm.generate([{"prompt_token_ids": [5, 17, 3]}], SamplingParams(temperature=0, max_tokens=4),
                               use_tqdm=False)
        assert len(outputs[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()


def _threads_and_files() -> tuple[int, int]:
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def test_engines_leave_no_threads_sockets_or_thread_count_behind(tiny_checkpoints) -> None:
    """Three tensor-parallel engines, each shut down while a reference to it lives on: the process's threads and
    open files stay level (the groups' gloo threads and sockets were kept until garbage collection: 7 threads and
    21 files an engine); while one runs, a new thread of this process still computes with all the cores (rank 0
    takes its share only around its steps), and afterwards this thread's count is as before."""
    before_threads = torch.get_num_threads()
    kept, counts = [], []
    for _ in range(3):
        model, _ = _tiny(tiny_checkpoints["llama3"])
        llm = LLM.from_model(model, None, tensor_parallel_size=2, num_kv_blocks=32, compile_model=False)
        seen: list[int] = []
        other = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        other.start()
        other.join()
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)
        assert seen == [before_threads] and torch.get_num_threads() == before_threads
        llm.shutdown()
        kept.append(llm)
        time.sleep(0.5)
        counts.append(_threads_and_files())
    assert counts[2] == counts[1] == counts[0], counts


def test_leaving_a_group_waits_for_a_hung_rank_only_until_its_deadline(tiny_checkpoints) -> None:
    """A worker that is alive but never answers (SIGSTOP): leaving the group returns at the deadline, the groups
    torn down (the control group's own timeout is a year)."""
    model, _ = _tiny(tiny_checkpoints["llama3"])
    llm = LLM.from_model(model, None, tensor_parallel_size=2, num_kv_blocks=32, compile_model=False)
    workers = llm.llm_engine.workers
    worker = workers.processes[0]
    try:
        os.kill(worker.pid, signal.SIGSTOP)
        started = time.monotonic()
        workers.tp.close(timeout_s=2.0)
        assert 1.5 < time.monotonic() - started < 15 and workers.tp.group is None and workers.tp.control is None
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        workers.failed = True
        llm.shutdown()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_the_bench_runs_an_engine_at_3_ranks(bundled) -> None:
    """`bench --tensor-parallel-size 3`: each run's ranks load their shards anew; the bench's model stays whole."""
    from llm_runtime.bench.benchmark import EngineRunner, fixed_workload

    model, _ = bundled
    workload = fixed_workload(4, 12, 8, vocab_size=model.config.vocab_size)
    one = EngineRunner(model, kv_cache_memory=64 << 20).run(workload)
    three = EngineRunner(model, kv_cache_memory=64 << 20, tensor_parallel_size=3).run(workload)
    assert three.outputs == one.outputs and model.tp is None


def test_an_idle_engine_outlasts_the_step_timeout(tiny_checkpoints) -> None:
    """The workers wait for the next step without a timeout (only a collective inside a step has one)."""
    model, _ = _tiny(tiny_checkpoints["llama3"])
    params = SamplingParams(temperature=0, max_tokens=4)
    with LLM.from_model(model, None, tensor_parallel_size=2, num_kv_blocks=16, compile_model=False,
                        tensor_parallel_timeout_s=1.0) as llm:
        first = llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
        time.sleep(3)  # three times the timeout, idle
        again = llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids


def test_int4_shards_by_its_groups_and_int8_per_channel_is_refused() -> None:
    """int4's groups of 32 input columns lie whole inside each rank's slice (192 of o's, 512 of down's at 3
    ranks): the shards quantize as the whole model does, and give its tokens. One int8 scale per output channel
    comes from a whole row, which no row-parallel rank holds: refused."""
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=0)
    results = []
    for size in (1, 3):
        with LLM(dtype="float32", quantization="int4", kv_cache_memory=64 << 20, tensor_parallel_size=size,
                 compile_model=False) as llm:
            results.append(llm.generate(PROMPTS[:3], params, use_tqdm=False))
    assert _compare(*results) < 1e-4
    with pytest.raises(ValueError, match="one scale per output channel does not shard"):
        LLM(dtype="float32", quantization="int8", kv_cache_memory=64 << 20, tensor_parallel_size=3)


def _listening(pids: list[int]) -> list[str]:
    """The local addresses the processes `pids` listen on (TCP)."""
    try:
        out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    except FileNotFoundError:
        pytest.skip("ss is not installed")
    return [line.split()[3] for line in out.splitlines() if any(f"pid={pid}," in line for pid in pids)]


def test_the_ranks_listen_on_loopback_only(tiny_checkpoints) -> None:
    """The rendezvous store and gloo's sockets of an engine's ranks: on 127.0.0.1, where nothing from another
    machine reaches them (before: the store listened on every interface, gloo on the host name's address)."""
    model, _ = _tiny(tiny_checkpoints["llama3"])
    with LLM.from_model(model, None, tensor_parallel_size=2, num_kv_blocks=32, compile_model=False) as llm:
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)
        pids = [os.getpid()] + [p.pid for p in llm.llm_engine.workers.processes]
        addresses = _listening(pids)
    assert addresses and all(address.startswith("127.0.0.1:") for address in addresses), addresses
