"""Structured output in the engine (lesson 15).

On the bundled model: every constraint kind (a JSON schema with nested objects, enums, bounded arrays,
patterns and anyOf; a regex; a choice; an EBNF grammar; any JSON object) gives output that parses and
validates, greedy and sampled. On a tiny random-weight model over the bundled tokenizer (milliseconds a step;
float64, so batching cannot flip an argmax): the grammar's masks and matchers follow each sequence through
continuous batching, chunked prefill, prefix hits, forks (n > 1), preemption and speculation (drafts cut to
what the grammar allows before they are verified), with greedy output identical to an unpressed engine's;
jump-forward gives the same greedy output as without it; stop strings and max_tokens end a constrained
request as any other; a grammar that is complete stops the sequence even with ignore_eos; and constrained
sampling draws from the model's distribution renormalised over the allowed tokens (a chi-square test).
"""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from llm_runtime import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from llm_runtime.sampling import StructuredOutputsParams as Structured
from llm_runtime.structured_output import GrammarState, allocate_bitmask, unpack_bitmask

from structured_cases import CONSTRAINTS, finished_valid
from workloads import assert_no_leak

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")


@pytest.fixture
def make_engine():
    """LLMEngine(...), shut down after the test (each engine's pool counts against the emulated device)."""
    made: list[LLMEngine] = []

    def make(*args, **kwargs) -> LLMEngine:
        made.append(LLMEngine(*args, **kwargs))
        return made[-1]

    yield make
    for engine in made:
        engine.shutdown()


def _chat(tokenizer, text: str) -> list[int]:
    from llm_runtime import encode_chat

    return encode_chat(tokenizer, [{"role": "user", "content": text}])


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Every request at once, to the end: id -> its final RequestOutput."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


@pytest.mark.slow
def test_every_constraint_kind_gives_valid_output_on_the_bundled_model(bundled, make_engine) -> None:
    model, tokenizer = bundled
    engine = make_engine(model, tokenizer, EngineConfig(max_num_seqs=16))
    requests = {}
    for kind, (question, structured) in CONSTRAINTS.items():
        prompt = _chat(tokenizer, question)
        requests[f"{kind}/greedy"] = (prompt, SamplingParams(temperature=0, max_tokens=160,
                                                             structured_outputs=structured))
        for seed in (1, 2):
            requests[f"{kind}/seed{seed}"] = (prompt, SamplingParams(temperature=1.0, seed=seed, max_tokens=160,
                                                                     structured_outputs=structured))
    outputs = _run(engine, requests)
    for request_id, output in outputs.items():
        completion = output.outputs[0]
        kind, how = request_id.split("/")
        assert finished_valid(kind, completion.text, completion.finish_reason, sampled=how != "greedy"), (
            request_id, completion.finish_reason, completion.text)
    assert_no_leak(engine)


# ------------------------------------------------------------------ the tiny model: interactions
WORDS = r"[a-z]{1,5}( [a-z]{1,5}){1,4}\."


def _workload(tokenizer, num_requests: int = 14, seed: int = 3):
    """Constrained requests (a regex, a choice, a schema) beside unconstrained ones; a shared system prompt;
    n = 2 for some; greedy."""
    rng = random.Random(seed)
    system = tokenizer.encode("You are a careful assistant who answers in few words. " * 4)
    kinds = [Structured(regex=WORDS), Structured(choice=["red", "green", "blue sky"]),
             Structured(json={"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
                              "required": ["n"]}, disable_any_whitespace=True), None]
    workload = []
    for i in range(num_requests):
        prompt = (system if i % 2 == 0 else []) + [rng.randrange(100, 40000) for _ in range(rng.randint(3, 40))]
        workload.append((prompt, SamplingParams(n=2 if i % 5 == 4 else 1, temperature=0, max_tokens=48,
                                                structured_outputs=kinds[i % len(kinds)])))
    return workload


def _outputs(engine: LLMEngine, workload) -> dict[str, list[tuple[list[int], str]]]:
    outputs = _run(engine, {str(i): request for i, request in enumerate(workload)})
    return {i: [(c.token_ids, c.finish_reason) for c in out.outputs] for i, out in outputs.items()}


def _check_valid(tokenizer, workload, outputs) -> None:
    for i, (prompt, params) in enumerate(workload):
        structured = params.structured_outputs
        for tokens, reason in outputs[str(i)]:
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            if structured is None:
                continue
            assert reason == "stop", (i, text)
            if structured.regex:
                assert re.fullmatch(WORDS, text), text
            elif structured.choice:
                assert text in structured.choice, text
            else:
                assert isinstance(json.loads(text)["n"], int), text


@pytest.mark.parametrize("options", [
    dict(max_num_seqs=6, max_num_batched_tokens=32, num_kv_blocks=24),  # chunked prefill, preemption
    dict(num_kv_blocks=400, max_num_batched_tokens=64, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                "prompt_lookup_max": 2}),
    dict(max_num_seqs=6, max_num_batched_tokens=32, num_kv_blocks=24,
         speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}),
], ids=["pressed", "ngram", "pressed+ngram"])
def test_grammars_follow_each_sequence_through_the_engine(tiny_chat_model, options: dict, make_engine) -> None:
    model, tokenizer = tiny_chat_model
    workload = _workload(tokenizer)
    plain = _outputs(make_engine(model, tokenizer, EngineConfig(num_kv_blocks=400, enable_prefix_caching=False,
                                                              max_forced_tokens=0)), workload)
    _check_valid(tokenizer, workload, plain)
    engine = make_engine(model, tokenizer, EngineConfig(block_size=8, **options))
    assert _outputs(engine, workload) == plain
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens > 0
    if "max_num_seqs" in options:
        assert stats.num_preemptions > 0
    if "speculative_config" in options:
        assert stats.num_draft_tokens > 0
    assert stats.num_forced_tokens > 0 and stats.num_accepted_forced_tokens > 0
    assert_no_leak(engine)


def test_jump_forward_keeps_the_greedy_output_and_saves_steps(bundled, make_engine) -> None:
    model, tokenizer = bundled
    schema = {"type": "object", "properties": {"name_of_the_city": {"type": "string", "maxLength": 12},
                                               "population_in_millions": {"type": "integer", "maximum": 99}},
              "required": ["name_of_the_city", "population_in_millions"]}
    params = SamplingParams(temperature=0, max_tokens=64,
                            structured_outputs=Structured(json=schema, disable_any_whitespace=True))
    prompt = _chat(tokenizer, "Describe Paris as JSON.")
    results = {}
    for limit in (0, 16):
        engine = make_engine(model, tokenizer, EngineConfig(max_forced_tokens=limit))
        output = _run(engine, {"a": (prompt, params)})["a"].outputs[0]
        results[limit] = (output.token_ids, output.text, engine.profile.num_steps, engine.stats())
        engine.shutdown()
    assert results[16][:2] == results[0][:2]
    value = json.loads(results[0][1])
    assert set(value) == {"name_of_the_city", "population_in_millions"}
    stats = results[16][3]
    assert stats.num_accepted_forced_tokens >= 10 and results[16][2] <= results[0][2] - 10
    assert results[0][3].num_forced_tokens == 0


def test_stop_strings_max_tokens_and_a_complete_grammar_end_a_request(tiny_chat_model, make_engine) -> None:
    model, tokenizer = tiny_chat_model
    engine = make_engine(model, tokenizer, EngineConfig(num_kv_blocks=200))
    prompt = tokenizer.encode("Say three words.")
    regex = Structured(regex=r"alpha beta gamma delta")
    outputs = _run(engine, {
        "stop": (prompt, SamplingParams(temperature=0, max_tokens=32, stop=[" gamma"], structured_outputs=regex)),
        "length": (prompt, SamplingParams(temperature=0, max_tokens=2, structured_outputs=regex)),
        "ignore_eos": (prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True,
                                              structured_outputs=regex)),
    })
    stop, length, ignored = (outputs[k].outputs[0] for k in ("stop", "length", "ignore_eos"))
    assert (stop.text, stop.finish_reason, stop.stop_reason) == ("alpha beta", "stop", " gamma")
    assert length.finish_reason == "length" and "alpha beta gamma delta".startswith(length.text)
    assert ignored.finish_reason == "stop" and ignored.text == "alpha beta gamma delta"
    assert_no_leak(engine)


@pytest.mark.parametrize("structured, options, field", [
    (Structured(json='{"type": "object", "properties": {"a": {"type": "nonsense"}}}'), {}, "structured_outputs.json"),
    (Structured(regex="(a"), {}, "structured_outputs.regex"),
    (Structured(grammar="root ::= undefined_rule"), {}, "structured_outputs.grammar"),
    (Structured(regex="a+"), {"min_tokens": 2}, "min_tokens"),
])
def test_a_bad_constraint_is_refused_naming_its_field_and_nothing_runs(tiny_chat_model, structured, options,
                                                                       field: str, make_engine) -> None:
    model, tokenizer = tiny_chat_model
    engine = make_engine(model, tokenizer, EngineConfig(num_kv_blocks=64))
    with pytest.raises(InvalidRequestError) as refused:
        engine.add_request("a", "Hi", SamplingParams(structured_outputs=structured, **options))
    assert refused.value.param == field and not engine.has_unfinished_requests()
    no_tokenizer = make_engine(model, None, EngineConfig(num_kv_blocks=64))
    with pytest.raises(InvalidRequestError) as refused:
        no_tokenizer.add_request("a", [1, 2, 3], SamplingParams(structured_outputs=Structured(regex="a+")))
    assert refused.value.param == "structured_outputs"


def test_constrained_sampling_draws_from_the_renormalised_distribution(tiny_chat_model, make_engine) -> None:
    """The first token of 1,200 seeded requests against softmax(logits) restricted to the tokens the grammar
    allows first, renormalised; rare tokens pooled; a chi-square test at p = 0.001."""
    model, tokenizer = tiny_chat_model
    structured = Structured(choice=["cat", "dog", "bird", "cow", "ant", "owl"])
    prompt = tokenizer.encode("An animal:")
    engine = make_engine(model, tokenizer, EngineConfig(max_num_seqs=64, num_kv_blocks=400))
    grammar = engine.input_processor.grammar_compiler().compile(structured)
    bitmask = allocate_bitmask(1, model.config.vocab_size)
    GrammarState(grammar).fill(bitmask, 0)
    allowed = unpack_bitmask(bitmask, model.config.vocab_size)[0]
    with torch.no_grad():
        hidden = model(torch.tensor([prompt]))  # (1, T, hidden), no cache
        logits = model.compute_logits(hidden[0, -1:])[0]  # (vocab,)
    probs = torch.where(allowed, logits.double(), -torch.inf).softmax(-1)
    num_draws = 1200
    outputs = _run(engine, {str(s): (prompt, SamplingParams(temperature=1.0, seed=s, max_tokens=4,
                                                            structured_outputs=structured))
                            for s in range(num_draws)})
    first = torch.tensor([out.outputs[0].token_ids[0] for out in outputs.values()])
    assert bool(allowed[first].all())
    counts = torch.bincount(first, minlength=len(probs)).double()
    common = (probs * num_draws >= 5).nonzero().flatten()
    expected = torch.cat([probs[common] * num_draws, (1 - probs[common].sum()).reshape(1) * num_draws])
    observed = torch.cat([counts[common], (num_draws - counts[common].sum()).reshape(1)])
    keep = expected > 0
    statistic = float((((observed - expected) ** 2)[keep] / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(statistic / 2)))  # chi2.sf
    assert dof >= 2 and p_value > 1e-3, (statistic, dof, p_value)



class _Completing:
    """A proposer that guesses the rest of `tokens` (an answer and the end of its turn) from wherever each sequence
    is: its last drafts end the grammar, as prompt lookup's do when it copies `}<|im_end|>` from an earlier turn."""

    num_speculative_tokens = 8

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, sequences) -> None:
        for seq in sequences:
            done = seq.num_output_tokens
            seq.draft_token_ids, seq.draft_probs = self.tokens[done : done + self.num_speculative_tokens], None

    def keep_only(self, running) -> None:
        pass


@pytest.mark.parametrize("structured", [Structured(regex="alpha beta gamma"), Structured(
    json={"type": "object", "properties": {"a": {"const": "alpha"}}, "required": ["a"], "additionalProperties": False},
    disable_any_whitespace=True)],
    ids=["regex", "json"])
def test_drafts_that_end_the_grammar_are_verified_and_the_matcher_left_where_it_was(tiny_chat_model, structured,
                                                                                   make_engine) -> None:
    """Drafts that complete the grammar and then take its stop token: the masks after them are not asked of a
    terminated matcher (xgrammar raises there), the request ends with its text and "stop", as without drafts, in
    fewer steps; and a matcher whose draft masks fail is rolled back to where it was."""
    model, tokenizer = tiny_chat_model
    prompt = tokenizer.encode("Say it.")
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=structured)
    plain = make_engine(model, tokenizer, EngineConfig(num_kv_blocks=64, max_forced_tokens=0))
    expected = _run(plain, {"a": (prompt, params)})["a"].outputs[0]
    assert expected.finish_reason == "stop" and expected.token_ids[-1] in model.config.eos_token_ids
    answer = expected.token_ids  # the text and the end of the turn
    engine = make_engine(model, tokenizer, EngineConfig(num_kv_blocks=64, max_forced_tokens=0, speculative_config={
        "method": "ngram", "num_speculative_tokens": 8}))
    engine.proposer = _Completing(answer)
    got = _run(engine, {"a": (prompt, params)})["a"].outputs[0]
    assert (got.token_ids, got.text, got.finish_reason) == (expected.token_ids, expected.text, "stop")
    stats = engine.stats()
    assert stats.num_failed_requests == 0 and stats.num_accepted_tokens == stats.num_draft_tokens > 0
    # The prompt's step, then steps that keep all 8 drafts and the token after them, the last one ending the turn.
    assert engine.profile.num_steps == 1 + -(-(len(answer) - 1) // 9) < plain.profile.num_steps
    assert_no_leak(engine)
    # A draft the grammar refuses: fill_drafts raises and leaves the matcher where it started.
    state = GrammarState(engine.input_processor.grammar_compiler().compile(structured))
    bitmask = allocate_bitmask(len(answer) + 1, model.config.vocab_size)
    with pytest.raises(ValueError, match="not allowed by the grammar"):
        state.fill_drafts(answer[:2] + [answer[0]] * 3, bitmask, 0)
    assert state.valid_prefix(answer) == answer and state.valid_prefix(answer + answer) == answer
    state.fill_drafts(answer, bitmask, 0)
    assert all(state.accept(token) for token in answer) and state.is_terminated


def test_the_grammar_compilers_workers_stop_with_the_engine(tiny_chat_model) -> None:
    model, tokenizer = tiny_chat_model
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64))
    compiler = engine.input_processor.grammar_compiler()
    compiler.compile(Structured(regex="a+"))
    engine.shutdown()
    assert compiler._workers._shutdown  # (before, its two threads lived on after every engine)
