"""The dashboard in a real browser: headless Chromium (Playwright driving the system's `chromium`) opens
`/dashboard` against a live server, requests run, and the test checks what a person would see: each request's
row appears, its KV blocks are drawn in its colour, a preemption is marked, every request finishes with its TTFT,
and the page logs no error. Skipped, with the reason, where no Chromium is installed (`.ci/run` installs it).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from llm_runtime import EngineConfig, LLMEngine
from llm_runtime.serving.dashboard import browser_unavailable_reason, headless_page
from llm_runtime.serving.server import create_app
from servers import running

REASON = browser_unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"dashboard browser test skipped: {REASON}")

PREFIX = list(range(1000, 1040))  # 40 tokens every prompt shares: 2 full blocks of 16
NUM_REQUESTS = 8

# In the page: the colour each running request's blocks are drawn in, read back from the canvas.
OWNED_PIXELS = """() => {
  const d = window.dashboard;
  d.redraw();
  const canvas = document.getElementById("kv-canvas"), ctx = canvas.getContext("2d");
  const ratio = window.devicePixelRatio || 1, seen = [];
  for (const [block, owner] of d.owners) {
    if (d.kv.states[block] !== "u") continue;
    const cell = d.kvCell(block);
    const [r, g, b] = ctx.getImageData(Math.round(cell.x * ratio), Math.round(cell.y * ratio), 1, 1).data;
    seen.push([owner, `rgb(${r}, ${g}, ${b})`, d.colourOf(owner)]);
  }
  return seen;
}"""


def test_the_page_shows_requests_their_blocks_a_preemption_and_their_end(tiny_chat_model, tmp_path) -> None:
    model, tokenizer = tiny_chat_model
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=20, max_num_seqs=6))
    step = engine.step

    def slow_step():  # the tiny model steps in milliseconds; a person (and the page) needs time to see them
        time.sleep(0.01)
        return step()

    engine.step = slow_step
    with running(create_app(engine, "tiny")) as base:
        asyncio.run(_scenario(base, tmp_path))


async def _scenario(base: str, tmp_path) -> None:
    async with headless_page(f"{base}/dashboard") as page:
        await page.wait_for_selector('#connection[data-state="live"]')
        async with httpx.AsyncClient(timeout=120) as http:
            bodies = [{"model": "tiny", "prompt": PREFIX + [2000 + i] * 4, "max_tokens": 60, "ignore_eos": True,
                       "temperature": 0} for i in range(NUM_REQUESTS)]
            load = asyncio.gather(*(http.post(f"{base}/v1/completions", json=body) for body in bodies))
            await page.wait_for_function("() => [...window.dashboard.requests.values()].some(r => r.blocks > 2)")
            owned = await page.evaluate(OWNED_PIXELS)
            await page.screenshot(path=str(tmp_path / "running.png"))
            responses = await load
        assert all(response.status_code == 200 for response in responses)
        assert owned and all(drawn == colour for _, drawn, colour in owned), owned[:3]

        await page.wait_for_function(
            f"() => (window.dashboard.redraw(), window.dashboard.rows.filter(r => r.state == 'finished').length) == "
            f"{NUM_REQUESTS}")
        await page.screenshot(path=str(tmp_path / "finished.png"), full_page=True)
        rows = await page.evaluate("() => window.dashboard.rows")
        assert len(rows) == NUM_REQUESTS and all(row["note"].startswith("length · 60 tok · TTFT") for row in rows), rows
        assert all("prefill" in row["kinds"] and "decode" in row["kinds"] for row in rows), rows
        assert any("preempted" in row["kinds"] for row in rows), "the pool is small enough to preempt"
        counters = await page.eval_on_selector_all("#counters div", "ds => ds.map(d => d.textContent)")
        assert "running0" in counters and any(c.startswith("preemptions") and c != "preemptions0" for c in counters)
        kv = await page.evaluate("() => window.dashboard.kvCounts")
        assert kv["u"] == kv["s"] == 0 and kv["c"] > 0, kv  # nothing held; the prompts' blocks stay cached
        assert await page.evaluate("() => window.dashboard.errors") == 0
        assert page.errors == [], page.errors
