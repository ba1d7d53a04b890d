"""How often constrained JSON comes back valid within its max_tokens, and what constraining costs (lesson 15; not in
CI): requests as a new user writes them, on the bundled model, at temperature 1.

    .venv/bin/python scripts/structured_valid_rate.py                  # 62 requests, whitespace as a JSON encoder
    .venv/bin/python scripts/structured_valid_rate.py --whitespace any,compact --rounds 2

Eight kinds of request (a person with nested address, enums and a union; a product with a SKU pattern; an order with
an enum and an array of objects; 3 to 5 cities; a union of shapes; an event with a date pattern; any JSON object; a
weather report of numbers and booleans), each with its own question and max_tokens (96 to 300; `--max-tokens` sets
every one), taken in turn with seeds 0, 1, ... up to `--num-requests`. Each batch runs at once in one engine, once
per whitespace rule (`any`: xgrammar's any whitespace between tokens, vLLM's default; `compact`: what a JSON encoder
writes, `disable_any_whitespace=True`, this engine's default). A completion is valid when it parses and validates
against its schema (jsonschema). The cost: each batch's output tokens/s against the same prompts unconstrained,
each held to its constrained completion's length (so both batches hold the same sequences at every step; against
free completions of other lengths the ratio would measure how long each batch stays full), taking turns `--rounds`
times. Prints a table: valid, cut at max_tokens, mean tokens, tok/s of each batch, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jsonschema

from llm_runtime import EngineConfig, LLMEngine, SamplingParams, StructuredOutputsParams, encode_chat, load_model

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from structured_cases import PERSON  # noqa: E402

PRODUCT = {"type": "object", "properties": {
    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}, "name": {"type": "string", "maxLength": 30},
    "price": {"type": "number", "minimum": 0, "maximum": 10000},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}},
    "required": ["sku", "name", "price", "tags"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "order_id": {"type": "integer", "minimum": 1}, "status": {"enum": ["pending", "shipped", "delivered", "returned"]},
    "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                         "quantity": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["name", "quantity"], "additionalProperties": False}}},
    "required": ["order_id", "status", "items"], "additionalProperties": False}
CITIES = {"type": "array", "minItems": 3, "maxItems": 5, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                     "country": {"type": "string", "maxLength": 20},
                                     "population_millions": {"type": "number", "minimum": 0, "maximum": 50}},
    "required": ["name", "country", "population_millions"], "additionalProperties": False}}
SHAPE = {"anyOf": [
    {"type": "object", "properties": {"kind": {"const": "circle"}, "radius": {"type": "number", "minimum": 0}},
     "required": ["kind", "radius"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "rectangle"}, "width": {"type": "number", "minimum": 0},
                                      "height": {"type": "number", "minimum": 0}},
     "required": ["kind", "width", "height"], "additionalProperties": False}]}
EVENT = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40}, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
    "location": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                  "country": {"type": "string", "maxLength": 20}},
                 "required": ["city", "country"], "additionalProperties": False},
    "attendees": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4}},
    "required": ["title", "date", "location", "attendees"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20}, "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
    "raining": {"type": "boolean"}, "wind_kph": {"type": "integer", "minimum": 0, "maximum": 200}},
    "required": ["city", "temperature_c", "raining", "wind_kph"], "additionalProperties": False}
# (question, schema or None for any JSON object, max_tokens)
KINDS = [
    ("Describe a person as JSON: name, age, role, tags, address and a contact.", PERSON, 200),
    ("Give me a product from an online shop as JSON.", PRODUCT, 160),
    ("Show an online order as JSON.", ORDER, 240),
    ("List a few large cities as JSON.", CITIES, 300),
    ("Describe a shape as JSON.", SHAPE, 96),
    ("Describe an upcoming event as JSON.", EVENT, 240),
    ("Return a JSON object that describes your favourite book.", None, 160),
    ("Give today's weather in a city as JSON.", WEATHER, 128),
]


def requests(tokenizer, count: int, whitespace: str | None, max_tokens_of_all: int | None = None):
    """(prompt ids, SamplingParams, schema) for `count` requests; whitespace None: unconstrained; max_tokens_of_all:
    every request's max_tokens (else each kind's own)."""
    out = []
    for i in range(count):
        question, schema, max_tokens = KINDS[i % len(KINDS)]
        max_tokens = max_tokens_of_all or max_tokens
        structured = None
        if whitespace is not None:
            compact = whitespace == "compact"
            structured = (StructuredOutputsParams(json_object=True, disable_any_whitespace=compact) if schema is None
                          else StructuredOutputsParams(json=schema, disable_any_whitespace=compact))
        prompt = encode_chat(tokenizer, [{"role": "user", "content": question}])
        out.append((prompt, SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens,
                                           structured_outputs=structured), schema))
    return out


def valid(text: str, schema: dict | None) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if schema is None:
        return isinstance(value, dict)
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


def run(engine: LLMEngine, batch) -> tuple[float, list]:
    """Seconds for the whole batch (added at once), and its completions in order."""
    started = time.perf_counter()
    for i, (prompt, params, _) in enumerate(batch):
        engine.add_request(str(i), prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[int(output.request_id)] = output.outputs[0]
    return time.perf_counter() - started, [finished[i] for i in range(len(batch))]


def matched(batch, outputs):
    """The same prompts unconstrained, each held to its constrained completion's length (ignore_eos): the same work
    step by step, so the two batches' tokens/s differ only by what constraining costs."""
    return [(prompt, SamplingParams(temperature=1.0, seed=params.seed, max_tokens=len(out.token_ids), ignore_eos=True),
             None) for (prompt, params, _), out in zip(batch, outputs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=62)
    parser.add_argument("--whitespace", default="compact,any", help="comma-separated: compact, any")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", type=int, default=None, help="every request's (default: each kind's own)")
    args = parser.parse_args()
    model, tokenizer = load_model(dtype=args.dtype)
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=args.num_requests,
                                                      max_num_batched_tokens=max(2048, args.num_requests)))
    modes = [w.strip() for w in args.whitespace.split(",")]
    batches = {mode: requests(tokenizer, args.num_requests, mode, args.max_tokens) for mode in modes}
    for mode in modes:  # compile the schemas first: a compile is not a step's cost
        for _, params, _ in batches[mode]:
            engine.input_processor.grammar_compiler().compile(params.structured_outputs)
    results = {mode: run(engine, batches[mode])[1] for mode in modes}  # (seeded: every round gives these)
    rates: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for mode in modes:
            for name, batch in ((mode, batches[mode]), (f"{mode}, unconstrained", matched(batches[mode],
                                                                                         results[mode]))):
                seconds, outputs = run(engine, batch)
                rates.setdefault(name, []).append(sum(len(o.token_ids) for o in outputs) / seconds)
    print(f"{args.num_requests} requests, temperature 1, {args.dtype}, max_tokens "
          f"{args.max_tokens or 'per kind (96-300)'}; tok/s: median of {args.rounds} rounds taking turns, against the "
          f"same prompts unconstrained, each held to its constrained completion's length")
    print(f"{'whitespace':11} {'valid':>7} {'cut':>4} {'tokens':>7} {'tok/s':>7} {'free tok/s':>10} {'ratio':>6}")
    for mode in modes:
        outputs = results[mode]
        good = sum(valid(o.text, schema) for o, (_, _, schema) in zip(outputs, batches[mode]))
        cut = sum(o.finish_reason == "length" for o in outputs)
        tokens = statistics.mean(len(o.token_ids) for o in outputs)
        rate, free = statistics.median(rates[mode]), statistics.median(rates[f"{mode}, unconstrained"])
        print(f"{mode:11} {f'{good}/{len(outputs)}':>7} {cut:4} {tokens:7.1f} {rate:7.1f} {free:10.1f} "
              f"{rate / free:6.3f}")
    engine.shutdown()


if __name__ == "__main__":
    main()
