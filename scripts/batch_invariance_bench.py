"""Batch invariance on the bundled model in bfloat16 (lesson 16; not in CI): what changes with the load, and what
the invariant mode costs, each measured side by side in one run.

    .venv/bin/python scripts/batch_invariance_bench.py                 # 100 copies under load; 48 requests
    .venv/bin/python scripts/batch_invariance_bench.py --copies 30 --copy-tokens 48 --batch 16

1. Under varying load: `--copies` identical greedy requests, in rounds of 1 to 4 beside a crowd of 0 to 20
   others that stop at different lengths, in the default mode and with batch_invariant=True; the distinct
   completions (tokens) and distinct logprob sequences among the copies, and where the copies first part from
   the most common completion.
2. Cost: `--batch` requests of `--tokens` tokens each (ignore_eos), alternated `--repeats` times; output tokens/s
   of each mode, best of the repeats, and their ratio.
Each mode loads its own copy of the model (an engine that owns its model packs and, by default, compiles it).
"""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter

from llm_runtime import LLM, SamplingParams, encode_chat, load_model

QUESTIONS = ["What is the capital of France?", "Write a haiku about autumn.", "Explain gravity simply.",
             "List the days of the week.", "Tell me a joke.", "Describe a cat in three sentences.",
             "Why is the sky blue?", "Give me a recipe for tea.", "What is Python?", "Who wrote Hamlet?",
             "How do planes fly?", "Write a short poem about the sea.", "What is a prime number?"]
SUBJECT = "Write a short story about a robot who learns to paint."


def under_load(llm: LLM, prompts: list[list[int]], copies: int, tokens: int, seed: int) -> list[tuple]:
    """(tokens, logprobs) of `copies` identical greedy requests, run in rounds: 1 to 4 copies at a time beside a
    crowd of 0 to 20 other requests, each stopping after its own 4 to 64 tokens (so the batch shrinks as it goes);
    a copy alone decodes one row a step."""
    engine, rng = llm.llm_engine, random.Random(seed)
    subject = encode_chat(llm.tokenizer, [{"role": "user", "content": SUBJECT}])
    greedy = SamplingParams(temperature=0, max_tokens=tokens, logprobs=0)
    added, finished, other = 0, {}, 0
    while added < copies:
        for _ in range(min(rng.choice([1, 1, 2, 4]), copies - added)):
            engine.add_request(f"s{added}", subject, greedy)
            added += 1
        for _ in range(rng.choice([0, 0, 2, 8, 20])):
            crowd = SamplingParams(temperature=0, max_tokens=rng.randint(4, 64), ignore_eos=True)
            engine.add_request(f"o{other}", rng.choice(prompts), crowd)
            other += 1
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished and output.request_id.startswith("s"):
                    o = output.outputs[0]
                    finished[int(output.request_id[1:])] = (tuple(o.token_ids),
                                                            tuple(e[t] for e, t in zip(o.logprobs, o.token_ids)))
    return [finished[i] for i in range(copies)]


def throughput(llm: LLM, prompts: list[list[int]], batch: int, tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    started = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompts[i % len(prompts)]} for i in range(batch)], params, use_tqdm=False)
    return batch * tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--copies", type=int, default=100)
    parser.add_argument("--copy-tokens", type=int, default=96, help="tokens each identical request generates")
    parser.add_argument("--batch", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    modes = {"default": {}, "batch_invariant": {"batch_invariant": True}}
    llms = {}
    for name, options in modes.items():
        model, tokenizer = load_model(dtype="bfloat16")
        llms[name] = LLM.from_model(model, tokenizer, owns_model=True, kv_cache_memory=512 << 20, **options)
    tokenizer = llms["default"].tokenizer
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    print(f"{args.copies} identical greedy requests of {args.copy_tokens} tokens under a changing load, bfloat16:")
    for name, llm in llms.items():
        results = under_load(llm, prompts, args.copies, args.copy_tokens, seed=16)
        completions = Counter(tokens for tokens, _ in results)
        common = completions.most_common(1)[0][0]
        parted = sorted(next((i for i, (a, b) in enumerate(zip(tokens, common)) if a != b), len(common))
                        for tokens, _ in results if tokens != common)
        print(f"  {name:16} {len(completions):3d} distinct completions, {len(set(r[1] for r in results)):3d} distinct "
              f"logprob sequences; the others part from the most common at tokens {parted}")
    rates: dict[str, list[float]] = {name: [] for name in llms}
    for name, llm in llms.items():  # warm-up
        throughput(llm, prompts, 4, 8)
    for _ in range(args.repeats):
        for name, llm in llms.items():
            rates[name].append(throughput(llm, prompts, args.batch, args.tokens))
    best = {name: max(values) for name, values in rates.items()}
    print(f"{args.batch} requests x {args.tokens} tokens, best of {args.repeats}: default {best['default']:.1f} tok/s, "
          f"batch_invariant {best['batch_invariant']:.1f} tok/s, ratio {best['batch_invariant'] / best['default']:.3f}")
    for llm in llms.values():
        llm.llm_engine.shutdown()


if __name__ == "__main__":
    main()
