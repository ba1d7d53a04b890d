"""Speculative decoding in the engine (lesson 14): greedy output identical to the engine without it, under
continuous batching, chunked prefill, paging, prefix hits, forks, preemption and aborts, with no block leaked;
stop rules among kept drafts; logprobs; a seeded request's tokens exactly its tokens without speculation,
alone or in any batch, whatever its drafts (even a draft model whose distribution moves with its batch);
unseeded sampled output distributed as without speculation (a chi-square test per position on thousands of
draws); a draft model that agrees with the target keeps every guess; the counters the engine reports.

Tiny random-weight models in float64 (batch composition cannot flip an argmax there); their greedy output
falls into loops within a few tokens, which is where prompt lookup finds its guesses.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from llm_runtime import EngineConfig, LLMEngine, SamplingParams

from workloads import (BLOCK_SIZE, NGRAM, assert_no_leak, blocks_unconstrained, repetitive_workload, run_all,
                       shared_prefix_workload)

def _pressed(workload, **options) -> EngineConfig:
    """A pool small enough for preemption, prefix caching on, small steps (chunked prefill)."""
    largest = max(-(-(len(prompt) + p.max_tokens) // BLOCK_SIZE) for prompt, p in workload)
    return EngineConfig(max_num_seqs=8, max_num_batched_tokens=48, block_size=BLOCK_SIZE,
                        num_kv_blocks=max(blocks_unconstrained(workload) * 12 // 100, largest + 2),
                        enable_prefix_caching=True, **options)


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_greedy_output_is_the_engines_without_speculation(tiny_pairs, family: str) -> None:
    model, _ = tiny_pairs[family]
    workload = repetitive_workload(model.config.vocab_size) + shared_prefix_workload(model.config.vocab_size, 8)
    expected = run_all(LLMEngine(model, None, _pressed(workload)), workload, arrive_every=1)
    engine = LLMEngine(model, None, _pressed(workload, speculative_config=NGRAM))
    assert run_all(engine, workload, arrive_every=1) == expected
    stats = engine.stats()
    assert stats.num_draft_tokens > 50 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert sum(stats.accepted_length_counts) > 0 and len(stats.accepted_length_counts) == 5
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0
    assert 1 < stats.mean_acceptance_length <= 5 and 0 < stats.acceptance_rate < 1
    assert_no_leak(engine)


def test_rejected_drafts_leave_no_block_and_are_never_cached(tiny_pairs) -> None:
    """After every step each running sequence holds no block past its tokens' (rejected drafts' blocks
    went back), and every block named in the prefix cache holds tokens the sequence really has."""
    model, _ = tiny_pairs["llama3"]
    workload = repetitive_workload(model.config.vocab_size, 12, seed=8)
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=8, block_size=4, num_kv_blocks=256,
                                                 speculative_config={**NGRAM, "num_speculative_tokens": 9}))
    for i, (prompt, params) in enumerate(workload):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
        blocks = engine.block_manager
        for seq in engine.scheduler.running:
            held = len(blocks.block_tables[seq])  # its computed tokens' blocks, at most its next slot's more
            assert blocks.blocks_needed(seq.num_computed_tokens) <= held <= blocks.blocks_needed(seq.num_tokens), seq
            assert seq.num_computed_tokens <= seq.num_tokens
            tokens = seq.prompt_token_ids + seq.output_token_ids
            for index, entry in enumerate(blocks._chains[seq]):
                if entry is not None:
                    assert list(entry.token_ids) == tokens[index * 4 : (index + 1) * 4]
    assert engine.stats().num_accepted_tokens > 0
    assert_no_leak(engine)


def test_aborts_in_the_middle_leak_nothing(tiny_pairs) -> None:
    model, _ = tiny_pairs["qwen3"]
    workload = repetitive_workload(model.config.vocab_size, 16, seed=9)
    engine = LLMEngine(model, None, _pressed(workload, speculative_config=NGRAM))
    for i, (prompt, params) in enumerate(workload):
        engine.add_request(str(i), prompt, params)
    step = 0
    while engine.has_unfinished_requests():
        engine.step()
        step += 1
        for request_id in list(engine.requests)[: 1 if step % 3 == 0 else 0]:
            engine.abort_request(request_id)
    assert engine.stats().num_draft_tokens > 0
    assert_no_leak(engine)


def test_stop_tokens_and_max_tokens_among_kept_drafts(tiny_pairs) -> None:
    """A stop token that a kept draft (or the token after it) hits ends the request there, with what followed
    dropped; max_tokens is never passed; both exactly as without speculation, logprobs included."""
    model, _ = tiny_pairs["llama3"]
    workload = repetitive_workload(model.config.vocab_size, 16, seed=11)
    alone = LLMEngine(model, None, EngineConfig(num_kv_blocks=256))
    greedy = {str(i): run_all(alone, [(prompt, params)])["0"] for i, (prompt, params) in enumerate(workload)}
    # Stop on a token each output has at its 3rd to 6th place: the step that emits it may hold several.
    stopping = []
    for i, (prompt, params) in enumerate(workload):
        output = greedy[str(i)][0]
        stop = output[min(len(output) - 1, 2 + i % 4)]
        stopping.append((prompt, SamplingParams(temperature=0, max_tokens=params.max_tokens, stop_token_ids=[stop],
                                                logprobs=2)))
    results = {}
    for options in ({}, {"speculative_config": NGRAM}):
        engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=256, **options))
        for i, (prompt, params) in enumerate(stopping):
            engine.add_request(str(i), prompt, params)
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
        results[bool(options)] = {i: (o.token_ids, o.finish_reason, o.stop_reason, o.logprobs) for i, o in outputs.items()}
        assert_no_leak(engine)
    for i, (tokens, reason, stop_reason, logprobs) in results[True].items():
        expected = results[False][i]
        assert (tokens, reason, stop_reason) == expected[:3], i
        assert len(logprobs) == len(tokens) and [set(e) for e in logprobs] == [set(e) for e in expected[3]]
        for ours, theirs in zip(logprobs, expected[3]):
            assert all(abs(ours[t] - theirs[t]) < 1e-9 for t in ours)
        assert len(tokens) <= stopping[int(i)][1].max_tokens


def _draws(model, prompts, params, num_draws: int, engine_seed: int, **options) -> list[list[int]]:
    """The output of `num_draws` unseeded requests per prompt, all in one engine whose own generator draws from
    `engine_seed`."""
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=256, max_num_batched_tokens=4096, num_kv_blocks=2048,
                                                 block_size=BLOCK_SIZE, enable_prefix_caching=True, seed=engine_seed,
                                                 **options))
    requests = [(prompt, SamplingParams(**params)) for prompt in prompts for _ in range(num_draws)]
    results = run_all(engine, requests, arrive_every=1)
    assert_no_leak(engine)
    return [results[str(i)][0] for i in range(len(requests))], engine.stats()


def _chi_square_two_samples(a: list[int], b: list[int]) -> tuple[float, int]:
    """Pearson's two-sample statistic over the tokens both samples hold (rare ones pooled), and its degrees."""
    counts_a = torch.bincount(torch.tensor(a), minlength=256).double()
    counts_b = torch.bincount(torch.tensor(b), minlength=256).double()
    total = counts_a + counts_b
    common = total >= 20
    bins_a = torch.cat([counts_a[common], counts_a[~common].sum()[None]])
    bins_b = torch.cat([counts_b[common], counts_b[~common].sum()[None]])
    keep = (bins_a + bins_b) > 0
    bins_a, bins_b = bins_a[keep], bins_b[keep]
    n_a, n_b = bins_a.sum(), bins_b.sum()
    expected_a = (bins_a + bins_b) * n_a / (n_a + n_b)
    expected_b = (bins_a + bins_b) * n_b / (n_a + n_b)
    return float(((bins_a - expected_a) ** 2 / expected_a + (bins_b - expected_b) ** 2 / expected_b).sum()), \
        int(keep.sum()) - 1


def _sharpened(model, factor: float):
    """A copy whose next-token distributions are sharper (the head's weights scaled): at temperature 1 it
    follows its own loops often enough for prompt lookup to guess, and wanders often enough to be refused."""
    sharp = copy.deepcopy(model)
    with torch.no_grad():
        sharp.lm_head.weight.mul_(factor)
    return sharp


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_sampled_output_is_distributed_as_without_speculation(tiny_pairs, top_p: float) -> None:
    """Temperature 1 (and top-p 0.8): the first 6 tokens of 2 x 1,000 unseeded requests, with and without prompt
    lookup (rejection sampling), by position. The engines draw from other seeds, so the samples are
    independent; a chi-square test per position, each bin at least 20 draws in all: far below the 0.1 %
    quantile of its degrees of freedom. (A seeded request keeps exactly its tokens: the next test.)"""
    model = _sharpened(tiny_pairs["llama3"][0], 3.0)
    vocab, num_seeds, length = model.config.vocab_size, 1000, 6
    prompts = [[11, 12, 13, 11, 12, 13, 11, 12], [40, 41, 40, 41, 40]]
    params = dict(temperature=1.0, top_p=top_p, max_tokens=length, ignore_eos=True)
    plain, _ = _draws(model, prompts, params, num_seeds, engine_seed=1)
    speculative, stats = _draws(model, prompts, params, num_seeds, engine_seed=2, speculative_config=NGRAM)
    assert stats.num_draft_tokens > 1000 and 300 < stats.num_accepted_tokens < stats.num_draft_tokens - 300
    for position in range(length):
        for p in range(len(prompts)):
            a = [tokens[position] for tokens in plain[p * num_seeds : (p + 1) * num_seeds]]
            b = [tokens[position] for tokens in speculative[p * num_seeds : (p + 1) * num_seeds]]
            statistic, degrees = _chi_square_two_samples(a, b)
            # The 0.999 quantile of chi-square is below degrees + 3.1 sqrt(2 degrees) + 10 for these sizes.
            assert statistic < degrees + 3.1 * (2 * degrees) ** 0.5 + 10, (position, p, statistic, degrees)
            assert all(0 <= t < vocab for t in b)


def test_seeded_requests_are_reproducible_whatever_runs_beside_them(tiny_pairs) -> None:
    model, _ = tiny_pairs["qwen3"]
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]
    params = SamplingParams(temperature=0.9, top_k=20, seed=123, max_tokens=16, ignore_eos=True)
    config = dict(num_kv_blocks=128, speculative_config=NGRAM)
    alone = run_all(LLMEngine(model, None, EngineConfig(**config)), [(prompt, params)])["0"]
    others = [([5, 6, 5, 6, 5], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True))] * 5
    crowded = run_all(LLMEngine(model, None, EngineConfig(**config)), others + [(prompt, params)] + others)
    assert crowded["5"] == alone


def test_a_draft_model_that_agrees_keeps_every_guess(tiny_pairs) -> None:
    """The target itself as its draft: greedy guesses are the target's argmaxes, all kept; a different model of
    the same vocabulary as the draft keeps fewer, and the output is the same either way."""
    model, _ = tiny_pairs["llama3"]
    workload = repetitive_workload(model.config.vocab_size, 8, seed=13)
    expected = run_all(LLMEngine(model, None, EngineConfig(num_kv_blocks=256)), workload)
    draft = {"method": "draft", "model": "unused: a draft model is given", "num_speculative_tokens": 3}
    same = LLMEngine(model, None, EngineConfig(num_kv_blocks=256, speculative_config=draft),
                     draft_model=copy.deepcopy(model))
    assert run_all(same, workload) == expected
    assert same.stats().acceptance_rate == 1.0 and same.stats().num_draft_tokens > 30
    other = LLMEngine(model, None, EngineConfig(num_kv_blocks=256, speculative_config=draft),
                      draft_model=tiny_pairs["llama2"][0])
    assert run_all(other, workload) == expected
    assert other.stats().acceptance_rate < 1.0
    assert_no_leak(other)
    other.step()  # nothing to run: the draft's caches go with their sequences
    assert not other.proposer.cached and not other.proposer.block_manager.block_tables


def test_a_sampling_draft_model_keeps_the_distribution(tiny_pairs) -> None:
    """Drafts drawn from another model's distribution (q is not p), kept by rejection sampling: the 4 tokens of
    1,500 unseeded requests follow the target's distribution as without speculation (chi-square per position,
    the engines drawing from other seeds)."""
    model, _ = tiny_pairs["llama3"]
    prompts, num_seeds, length = [[21, 22, 23, 24]], 1500, 4
    params = dict(temperature=1.0, max_tokens=length, ignore_eos=True)
    plain, _ = _draws(model, prompts, params, num_seeds, engine_seed=1)
    draft = {"method": "draft", "model": "given", "num_speculative_tokens": 2}
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=256, num_kv_blocks=1024, speculative_config=draft,
                                                 seed=2), draft_model=tiny_pairs["llama2"][0])
    requests = [(prompts[0], SamplingParams(**params)) for _ in range(num_seeds)]
    results = run_all(engine, requests, arrive_every=1)
    speculative = [results[str(i)][0] for i in range(num_seeds)]
    stats = engine.stats()
    assert stats.num_draft_tokens > 1000 and 100 < stats.num_accepted_tokens < stats.num_draft_tokens - 100
    for position in range(length):
        statistic, degrees = _chi_square_two_samples([t[position] for t in plain], [t[position] for t in speculative])
        assert statistic < degrees + 3.1 * (2 * degrees) ** 0.5 + 10, (position, statistic, degrees)
    assert_no_leak(engine)


def test_bad_speculative_settings_are_refused(tiny_pairs) -> None:
    model, _ = tiny_pairs["llama2"]
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="unknown speculative_config key"):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3})
    with pytest.raises(ValueError, match="draft_model is for"):
        LLMEngine(model, None, EngineConfig(num_kv_blocks=8), draft_model=model)
    with pytest.raises(ValueError, match="vocabulary"):
        other = copy.deepcopy(model)
        other.config = type(model.config)(**{**vars(model.config), "vocab_size": 50})
        LLMEngine(model, None, EngineConfig(num_kv_blocks=8, speculative_config={
            "method": "draft", "model": "x", "num_speculative_tokens": 2}), draft_model=other)
    with pytest.raises(ValueError, match="was not loaded by load_model"):
        LLMEngine(model, None, EngineConfig(num_kv_blocks=8, speculative_config={
            "method": "draft", "model": "self", "num_speculative_tokens": 2}))


def test_speculation_in_bfloat16(tiny_pairs) -> None:
    """What a GPU runs: a verification chunk adds in another order than a one-token step, so near-ties may flip
    in bfloat16; nearly every token still agrees with the engine without speculation, and nothing leaks."""
    model = copy.deepcopy(tiny_pairs["llama3"][0]).to(torch.bfloat16)
    workload = repetitive_workload(model.config.vocab_size, 12, seed=21)
    expected = run_all(LLMEngine(model, None, _pressed(workload)), workload, arrive_every=1)
    engine = LLMEngine(model, None, _pressed(workload, speculative_config=NGRAM))
    got = run_all(engine, workload, arrive_every=1)
    pairs = [(a, b) for key in expected for x, y in zip(expected[key], got[key]) for a, b in zip(x, y)]
    assert len(pairs) > 200 and sum(a == b for a, b in pairs) >= 0.9 * len(pairs)
    assert all(len(x) == len(y) for key in expected for x, y in zip(expected[key], got[key]))
    assert engine.stats().num_accepted_tokens > 20
    assert_no_leak(engine)


DRAFT = {"method": "draft", "model": "given", "num_speculative_tokens": 4}


def _finals(engine: LLMEngine, requests) -> dict:
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    return finals


def test_siblings_never_verify_their_drafts_in_each_others_blocks(tiny_pairs) -> None:
    """n = 4 with a sampling draft model: right after the fork each sibling writes its last prompt token and 4
    guesses of its own, a write that starts in the block the siblings share and ends in a new one. Every sibling's
    logprobs (the target's, as it verified) equal a plain forward pass over its own text; before, all four wrote
    their guesses into the one shared block and verified against each other's keys."""
    model, _ = tiny_pairs["llama3"]
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_kv_blocks=256, speculative_config=DRAFT),
                       draft_model=tiny_pairs["llama2"][0])
    requests = [([20 + i, 21, 22, 23, 24, 25][: 3 + i], SamplingParams(n=4, temperature=1.0, seed=i, max_tokens=12,
                                                                       ignore_eos=True, logprobs=0)) for i in range(3)]
    finals = _finals(engine, requests)
    assert engine.stats().num_draft_tokens > 40
    for output in finals.values():
        assert len({tuple(c.token_ids) for c in output.outputs}) > 1  # the siblings went their own ways
        for completion in output.outputs:
            ids = output.prompt_token_ids + completion.token_ids
            with torch.no_grad():
                logprobs = model.compute_logits(model(torch.tensor([ids])))[0].log_softmax(-1)  # (T, vocab)
            start = len(output.prompt_token_ids)
            for t, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
                assert abs(entry[token] - float(logprobs[start + t - 1, token])) < 1e-5, (output.request_id, t)  # float32
    assert_no_leak(engine)


def test_seeded_requests_are_reproducible_with_a_draft_model(tiny_pairs) -> None:
    """A seeded request's guesses come from its own seed: alone or among other sampled requests, the same tokens."""
    model, draft = tiny_pairs["llama3"][0], tiny_pairs["llama2"][0]
    request = ([7, 8, 9, 10], SamplingParams(temperature=1.0, seed=123, max_tokens=16, ignore_eos=True))
    alone = _finals(LLMEngine(model, None, EngineConfig(num_kv_blocks=128, speculative_config=DRAFT),
                              draft_model=draft), [request])["0"]
    others = [([5, 6, 5, 6, 5], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True))] * 4
    crowded = _finals(LLMEngine(model, None, EngineConfig(num_kv_blocks=128, speculative_config=DRAFT),
                                draft_model=draft), others + [request] + others)["4"]
    assert crowded.outputs[0].token_ids == alone.outputs[0].token_ids


def test_a_seeded_requests_tokens_are_a_function_of_its_prompt_params_and_model(tiny_pairs, monkeypatch) -> None:
    """A draft model whose distribution moves with the batch it runs in (its logits shifted by the number of
    rows, as a half-precision draft's rounding moves with its kernels' shapes): seeded requests alone, among
    other seeded and unseeded requests arriving at other times, and without speculation at all give exactly the
    same tokens, with sampled and with sure (prompt lookup) drafts. Before, rejection sampling's outcome depended
    on the draft's distribution: the bundled model's seeded request changed beside six others with its own
    weights in 4 bits as the draft."""
    model, draft = tiny_pairs["llama3"][0], copy.deepcopy(tiny_pairs["llama2"][0])
    compute_logits = type(draft).compute_logits
    shift = torch.randn(model.config.vocab_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def batch_sensitive(self, hidden):
        logits = compute_logits(self, hidden)  # (rows, vocab)
        return logits + 0.3 * logits.shape[0] * shift

    monkeypatch.setattr(draft, "compute_logits", batch_sensitive.__get__(draft))
    seeded = [([7, 8, 9, 10, 7, 8], SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True))
              for s in (123, 2**63 - 1, 0)]
    crowd = [([5, 6, 5, 6, 5], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)),
             ([30, 31, 32], SamplingParams(temperature=0.8, seed=9, max_tokens=20, ignore_eos=True))] * 3

    def tokens(requests, **options):
        engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=256, **options),
                           draft_model=draft if "speculative_config" in options and
                           options["speculative_config"]["method"] == "draft" else None)
        results = run_all(engine, requests, arrive_every=1)
        assert_no_leak(engine)
        return results, engine.stats()

    plain, _ = tokens(seeded)
    for spec in (DRAFT, NGRAM):
        alone, stats = tokens(seeded, speculative_config=spec)
        crowded, _ = tokens(crowd[:3] + seeded + crowd[3:], speculative_config=spec)
        assert stats.num_accepted_tokens > 0 or spec is NGRAM  # (at temperature 1 this model rarely loops)
        for i in range(len(seeded)):
            assert alone[str(i)] == plain[str(i)] == crowded[str(i + 3)], (spec["method"], i)


def test_the_draft_models_pool_is_inside_the_kv_budget(tiny_pairs) -> None:
    """Both pools come out of kv_cache_memory (the same number of blocks each), the CPU device's ledger counts the
    draft's pool and weights, and 16 requests that outgrow it take nothing more: the draft's memory is its pool
    (before, each sequence got a cache of its whole length, outside the budget)."""
    from llm_runtime.worker.kv_budget import CPU_DEVICE, tensor_bytes

    model, draft = tiny_pairs["llama3"][0], copy.deepcopy(tiny_pairs["llama2"][0])
    budget = 1 << 20
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=16, kv_cache_memory=budget, block_size=4,
                                                 speculative_config=DRAFT), draft_model=draft)
    pool, draft_pool = engine.kv_cache.nbytes, engine.proposer.nbytes
    assert engine.kv_pool_bytes == pool + draft_pool <= budget
    assert engine.proposer.kv_cache.num_blocks == engine.kv_cache.num_blocks
    held = CPU_DEVICE.held_bytes(model.device)
    assert held >= pool + draft_pool + tensor_bytes(model) + tensor_bytes(draft)
    rng = random.Random(3)
    requests = [([rng.randrange(3, 97) for _ in range(20)], SamplingParams(temperature=0, max_tokens=50,
                                                                           ignore_eos=True)) for _ in range(16)]
    expected = _finals(LLMEngine(model, None, EngineConfig(max_num_seqs=16, num_kv_blocks=engine.kv_cache.num_blocks,
                                                           block_size=4)), requests)
    got = _finals(engine, requests)
    assert {k: v.outputs[0].token_ids for k, v in got.items()} == {k: v.outputs[0].token_ids for k, v in expected.items()}
    assert engine.proposer.nbytes == draft_pool and engine.stats().num_preemptions > 0
    assert not engine.proposer.block_manager.block_tables
    engine.shutdown()


def test_a_failing_proposal_leaves_its_sequence_unspeculated(tiny_pairs, monkeypatch) -> None:
    """The draft model raises whenever a sequence's tokens hold a poison token: the step does not raise, that
    sequence decodes one token a step from then on (its blocks in the draft's pool given back), and every
    request, the poisoned one too, gets exactly the tokens it gets without speculation."""
    model, draft = tiny_pairs["llama3"][0], copy.deepcopy(tiny_pairs["llama2"][0])
    forward = type(draft).forward

    def failing(self, input_ids, *args, **kwargs):
        if bool((input_ids == 90).any()):
            raise RuntimeError("injected fault in the draft model")
        return forward(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(draft, "forward", failing.__get__(draft))
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    requests = [([5, 6, 7, 5, 6, 7], greedy), ([90, 91, 92], greedy), ([11, 12, 13, 11, 12], greedy)]
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=64, speculative_config=DRAFT), draft_model=draft)
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            finals[output.request_id] = output
        unspeculated = [seq.request_id for seq in engine.engine_core._unspeculated]
        assert unspeculated in ([], ["1"]) and all(seq.request_id != "1" for seq in engine.proposer.block_manager.block_tables)
    expected = _finals(LLMEngine(model, None, EngineConfig(num_kv_blocks=64)), requests)
    for key in ("0", "1", "2"):
        assert finals[key].outputs[0].token_ids == expected[key].outputs[0].token_ids
        assert finals[key].outputs[0].finish_reason == "length"
    assert engine.stats().num_accepted_tokens > 0 and engine.stats().num_failed_requests == 0
    assert not engine.proposer.block_manager.block_tables
    engine.shutdown()
    assert engine.kv_pool_bytes == 0


def test_the_draft_runs_on_a_backend_that_takes_its_dtype(tiny_pairs) -> None:
    """A float32 target on the CPU's C kernel with a float64 draft (the kernel takes float32 and bfloat16 only): the
    draft falls back to what the selector picks for it, instead of failing to start."""
    from llm_runtime.attention.selector import unavailable_reason

    if unavailable_reason("cpu", torch.device("cpu"), torch.float32) is not None:
        pytest.skip("no C kernel here")
    model = copy.deepcopy(tiny_pairs["llama3"][0]).to(torch.float32)
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=32, attention_backend="cpu", speculative_config=DRAFT),
                       draft_model=tiny_pairs["llama2"][0])
    assert engine.attention_backend.name == "cpu" and engine.proposer.attention_backend.name != "cpu"
    assert len(_finals(engine, [([5, 6, 7], SamplingParams(temperature=0, max_tokens=6))])["0"].outputs[0].token_ids) == 6


def test_an_early_exit_draft_shares_the_targets_layers_and_keeps_its_output(tiny_pairs) -> None:
    """`{"model": "self", "num_layers": n}`: the target's first n layers, its norm and head as the draft (LayerSkip's
    self-speculation): the very modules, not a copy (the device ledger counts the weights once), a draft pool of
    n layers, and the greedy output the engine's without speculation; a cut that keeps no layer or every layer is
    refused by name."""
    from llm_runtime.worker.kv_budget import CPU_DEVICE, tensor_bytes

    model, _ = tiny_pairs["llama3"]
    workload = repetitive_workload(model.config.vocab_size, 8, seed=13)
    expected = run_all(LLMEngine(model, None, EngineConfig(num_kv_blocks=256)), workload)
    early = {"method": "draft", "model": "self", "num_layers": 1, "num_speculative_tokens": 3}
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=256, speculative_config=early))
    draft = engine.proposer.model
    assert draft.config.num_layers == 1 and draft.model.layers[0] is model.model.layers[0]
    assert draft.lm_head is model.lm_head and len(engine.proposer.kv_cache.keys) == 1
    assert CPU_DEVICE.held_bytes(model.device) < engine.kv_pool_bytes + 2 * tensor_bytes(model)  # weights once
    assert run_all(engine, workload) == expected
    assert engine.stats().num_draft_tokens > 30
    assert_no_leak(engine)
    engine.shutdown()
    with pytest.raises(ValueError, match="num_layers must be in"):
        LLMEngine(model, None, EngineConfig(num_kv_blocks=8, speculative_config={
            **early, "num_layers": model.config.num_layers}))
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="num_layers must be a positive integer"):
            EngineConfig(speculative_config={**early, "num_layers": bad})
    with pytest.raises(ValueError, match="ngram proposer takes no"):
        EngineConfig(speculative_config={"method": "ngram", "num_layers": 2, "num_speculative_tokens": 2})
