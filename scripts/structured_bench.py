"""Structured output's cost and jump-forward's gain (lesson 15; not in CI), on the bundled model, each measured
side by side in one run.

    .venv/bin/python scripts/structured_bench.py            # batch 32, 64 tokens each; jump-forward at batch 1
    .venv/bin/python scripts/structured_bench.py --batch 8 --tokens 32

1. Cost: `--batch` requests at temperature 1 under a JSON schema that cannot end before `--tokens` tokens (an
   array of at least 200 small objects) against as many unconstrained ones of the same length (ignore_eos),
   alternated `--repeats` times; output tokens/s of each, their ratio, and the grammar phase's share of step
   time (StepProfile.grammar: filling and applying masks, drafts and forced tokens).
2. Jump-forward: one greedy request under a schema whose keys are most of its output, without whitespace,
   with `max_forced_tokens=0` and 16; seconds, steps, forced tokens accepted, and whether the outputs are equal.
"""

from __future__ import annotations

import argparse
import json
import time

from llm_runtime import EngineConfig, LLMEngine, SamplingParams, StructuredOutputsParams, encode_chat, load_model

ITEMS = {"type": "array", "minItems": 200, "items": {
    "type": "object", "properties": {"word": {"type": "string", "maxLength": 10},
                                     "count": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["word", "count"], "additionalProperties": False}}
LONG_KEYS = {"type": "object", "properties": {
    "the_name_of_the_city_in_english": {"type": "string", "maxLength": 10},
    "the_country_that_the_city_is_in": {"type": "string", "maxLength": 10},
    "the_population_in_millions_of_people": {"type": "integer", "minimum": 0, "maximum": 99},
    "whether_it_is_the_capital_city": {"type": "boolean"}},
    "required": ["the_name_of_the_city_in_english", "the_country_that_the_city_is_in",
                 "the_population_in_millions_of_people", "whether_it_is_the_capital_city"],
    "additionalProperties": False}


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, list]:
    """Seconds to finish every request (added at once), and their completions in order."""
    engine.profile.reset()  # a fresh breakdown for this run
    started = time.perf_counter()
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[int(output.request_id)] = output.outputs[0]
    return time.perf_counter() - started, [finished[i] for i in range(len(prompts))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model, tokenizer = load_model()
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=args.batch))
    prompt = encode_chat(tokenizer, [{"role": "user", "content": "List some words and how often you use them."}])
    prompts = [prompt] * args.batch
    free = [SamplingParams(temperature=1.0, seed=s, max_tokens=args.tokens, ignore_eos=True) for s in range(args.batch)]
    constrained = [SamplingParams(temperature=1.0, seed=s, max_tokens=args.tokens,
                                  structured_outputs=StructuredOutputsParams(json=ITEMS))
                   for s in range(args.batch)]
    run(engine, prompts[:2], constrained[:2])  # warm-up: compile the schema, first steps
    rates: dict[str, list[float]] = {"free": [], "constrained": []}
    share = []
    for _ in range(args.repeats):
        for name, params in (("free", free), ("constrained", constrained)):
            seconds, outputs = run(engine, prompts, params)
            assert all(len(o.token_ids) == args.tokens for o in outputs), [len(o.token_ids) for o in outputs]
            rates[name].append(args.batch * args.tokens / seconds)
            if name == "constrained":
                share.append(engine.profile.fractions()["grammar"])
    best = {name: max(values) for name, values in rates.items()}
    print(f"batch {args.batch}, {args.tokens} tokens each, temperature 1, best of {args.repeats}:")
    print(f"  unconstrained {best['free']:.1f} tok/s, constrained {best['constrained']:.1f} tok/s, "
          f"ratio {best['constrained'] / best['free']:.3f}")
    print(f"  grammar share of step time: {', '.join(f'{s:.2%}' for s in share)}")

    prompt = encode_chat(tokenizer, [{"role": "user", "content": "Describe Paris as JSON."}])
    params = SamplingParams(temperature=0, max_tokens=160,
                            structured_outputs=StructuredOutputsParams(json=LONG_KEYS, disable_any_whitespace=True))
    engine.shutdown()
    engines = {limit: LLMEngine(model, tokenizer, EngineConfig(max_forced_tokens=limit, kv_cache_memory=256 << 20))
               for limit in (0, 16)}
    results: dict[int, tuple[float, int, object]] = {}
    for _ in range(args.repeats):
        for limit, jf_engine in engines.items():
            seconds, (output,) = run(jf_engine, [prompt], [params])
            previous = results.get(limit)
            if previous is None or seconds < previous[0]:
                results[limit] = (seconds, jf_engine.profile.num_steps, output)
    forced = engines[16].stats().num_accepted_forced_tokens // args.repeats
    (plain_s, plain_steps, plain), (jump_s, jump_steps, jumped) = results[0], results[16]
    keys = sum(len(tokenizer.encode(f'"{k}":')) for k in LONG_KEYS["properties"])
    print(f"jump-forward, batch 1, greedy, best of {args.repeats} (keys ~{keys} of {len(plain.token_ids)} tokens):")
    print(f"  without {plain_s * 1000:.0f} ms / {plain_steps} steps, with {jump_s * 1000:.0f} ms / {jump_steps} steps, "
          f"speed-up {plain_s / jump_s:.2f}x, same output: {plain.token_ids == jumped.token_ids}, "
          f"forced tokens accepted per run: {forced}")
    print(f"  output: {jumped.text}")
    json.loads(jumped.text)
    for jf_engine in engines.values():
        jf_engine.shutdown()


if __name__ == "__main__":
    main()
