"""The server speculating with prompt lookup (lesson 14), through the `openai` client: the same greedy text as
`LLM.generate` without speculation, streamed or not, several requests at once, and the speculation counters
in /metrics."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from llm_runtime import LLM, SamplingParams
from servers import MODEL_NAME, TEST_KV_MEMORY, bundled_server, engine_events, openai_client, wait_idle

pytestmark = pytest.mark.slow

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
# Prompts a model continues by repeating them: prompt lookup has something to find.
PROMPTS = ["Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
           "def add(a, b):\n    return a + b\n\n\ndef add3(a, b, c):\n    return a + b + c\n\n\ndef add4(a, b, c, d):",
           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def reference(bundled) -> dict[str, str]:
    model, tokenizer = bundled
    with LLM.from_model(model, tokenizer, kv_cache_memory=TEST_KV_MEMORY) as llm:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return {o.prompt: o.outputs[0].text for o in outputs}


def test_speculating_server_answers_as_the_engine_without_it(bundled, reference) -> None:
    with bundled_server(bundled, speculative_config=NGRAM) as (base, engine, _):
        client = openai_client(base)
        for prompt in PROMPTS:
            response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            assert response.choices[0].text == reference[prompt]
            assert response.usage.completion_tokens == MAX_TOKENS or response.choices[0].finish_reason == "stop"
        stream = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True)
        chunks = [c.choices[0].text for c in stream if c.choices]
        assert "".join(chunks) == reference[PROMPTS[1]]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # side by side: verified in one batch
            texts = list(pool.map(lambda p: client.completions.create(
                model=MODEL_NAME, prompt=p, max_tokens=MAX_TOKENS, temperature=0).choices[0].text, PROMPTS))
        assert texts == [reference[p] for p in PROMPTS]
        wait_idle(engine)
        metrics = httpx.get(f"{base}/metrics").text
        drafts = _metric(metrics, "llm_runtime_spec_decode_num_draft_tokens_total")
        accepted = _metric(metrics, "llm_runtime_spec_decode_num_accepted_tokens_total")
        assert 0 < accepted < drafts
        assert 'llm_runtime_spec_decode_num_verifications_total{num_accepted="4"}' in metrics
        assert _metric(metrics, "llm_runtime_spec_decode_acceptance_rate") == pytest.approx(accepted / drafts)
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0  # no block held
        hello, state = engine_events(base)  # the live view knows it speculates, and counts as /metrics does
        assert hello["speculative"] == {"method": "ngram", "num_speculative_tokens": 4}
        assert (state["counters"]["draft_tokens"], state["counters"]["accepted_tokens"]) == (drafts, accepted)


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")
