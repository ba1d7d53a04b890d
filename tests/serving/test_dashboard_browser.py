"""The dashboard in a real browser: headless Chromium (Playwright driving the system's `chromium`) opens
`/dashboard` against a live server, requests run, and the test checks what a person would see: each request's
row appears, every KV block is drawn in its state's colour and pointing at one names its holder and outlines that
request's blocks, a preemption is marked, every request finishes with its TTFT, and the page logs no error; a page
opened while requests run shows them running from its first state. Skipped, with the reason, where no Chromium is installed (`.ci/run` installs it).
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

# In the page: blocks whose centre pixel is not their state's colour (the pool is coloured by state), and how many
# blocks were read back from the canvas.
MISPAINTED = """() => {
  const d = window.dashboard;
  d.redraw();
  const canvas = document.getElementById("kv-canvas"), ctx = canvas.getContext("2d");
  const ratio = window.devicePixelRatio || 1, styles = getComputedStyle(document.documentElement);
  const probe = document.createElement("canvas").getContext("2d", {willReadFrequently: true});
  const rgb = css => {
    probe.fillStyle = css.trim(); probe.fillRect(0, 0, 1, 1);
    const [r, g, b] = probe.getImageData(0, 0, 1, 1).data;
    return `rgb(${r}, ${g}, ${b})`;
  };
  const expected = {".": rgb(styles.getPropertyValue("--free")), "c": rgb(styles.getPropertyValue("--cached")),
                    "u": rgb(styles.getPropertyValue("--used")), "s": rgb(styles.getPropertyValue("--shared"))};
  const wrong = [];
  for (let b = 0; b < d.kv.num_blocks; b++) {
    const cell = d.kvCell(b);
    const [r, g, bl] = ctx.getImageData(Math.round(cell.x * ratio), Math.round(cell.y * ratio), 1, 1).data;
    if (`rgb(${r}, ${g}, ${bl})` !== expected[d.kv.states[b]]) wrong.push([b, d.kv.states[b], `rgb(${r}, ${g}, ${bl})`]);
  }
  return {checked: d.kv.num_blocks, wrong, used: d.kvCounts.u + d.kvCounts.s};
}"""

# In the page: a block some running request holds, and where it is on the screen (for the pointer).
HELD_BLOCK = """() => {
  const d = window.dashboard, canvas = document.getElementById("kv-canvas"), box = canvas.getBoundingClientRect();
  for (const [block, owner] of d.owners) {
    if (d.kv.states[block] !== "u") continue;
    const cell = d.kvCell(block);
    return {block, owner, x: box.left + cell.x, y: box.top + cell.y};
  }
  return null;
}"""

# In the page, once the pointer is on a block: what the hover line says, and the colour of the outline drawn around
# the selected request's blocks (read at one block's edge) against that request's colour.
OUTLINE = """() => {
  const d = window.dashboard;
  d.redraw();
  const ctx = document.getElementById("kv-canvas").getContext("2d"), ratio = window.devicePixelRatio || 1;
  const mine = [...d.owners].filter(([b, owner]) => owner === d.selected).map(([b]) => b);
  const cell = d.kvCell(mine[0]);  // the outline is at least 2 pixels wide: 1 pixel in from the block's edge is on it
  const [r, g, b] = ctx.getImageData(Math.round((cell.x - cell.size / 2 + 1) * ratio),
                                     Math.round(cell.y * ratio), 1, 1).data;
  return {selected: d.selected, text: document.getElementById("kv-hover").textContent, blocks: mine.length,
          outline: `rgb(${r}, ${g}, ${b})`, colour: d.colourOf(d.selected)};
}"""


def _slow_engine(model, tokenizer, delay_s: float = 0.01, **options) -> LLMEngine:
    engine = LLMEngine(model, tokenizer, EngineConfig(**options))
    step = engine.step

    def slow_step():  # the tiny model steps in milliseconds; a person (and the page) needs time to see them
        time.sleep(delay_s)
        return step()

    engine.step = slow_step
    return engine


def test_the_page_shows_requests_their_blocks_a_preemption_and_their_end(tiny_chat_model, tmp_path) -> None:
    model, tokenizer = tiny_chat_model
    engine = _slow_engine(model, tokenizer, num_kv_blocks=20, max_num_seqs=6)
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
            painted = await page.evaluate(MISPAINTED)
            held = await page.evaluate(HELD_BLOCK)
            assert held is not None
            await page.mouse.move(held["x"], held["y"])
            await page.wait_for_function("() => window.dashboard.selected !== null")
            outline = await page.evaluate(OUTLINE)
            await page.screenshot(path=str(tmp_path / "running.png"))
            responses = await load
        assert all(response.status_code == 200 for response in responses)
        assert painted["used"] > 0 and painted["wrong"] == [], painted  # every block in its state's colour
        # Pointing at a held block names a holder and outlines that request's blocks in its colour.
        assert outline["text"].startswith("block ") and f"held by {outline['selected']}" in outline["text"], outline
        assert outline["blocks"] > 0 and outline["outline"] == outline["colour"], outline

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


def test_a_page_opened_mid_traffic_shows_what_runs_at_once(tiny_chat_model) -> None:
    """A reader opens the page while requests run: the first state it is sent holds them (the feed sends the engine's
    state to each new subscriber), and the page draws them running, their steps before it opened as one span."""
    model, tokenizer = tiny_chat_model
    # Every request fits at once (8 x 31 blocks) and runs for 440 steps of at least 20 ms: still running when the page,
    # opened after 20 of them, reads its first state.
    engine = _slow_engine(model, tokenizer, delay_s=0.02, num_kv_blocks=256, max_num_seqs=8)
    with running(create_app(engine, "tiny")) as base:
        asyncio.run(_opened_mid_traffic(base, engine))


async def _opened_mid_traffic(base: str, engine: LLMEngine) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        bodies = [{"model": "tiny", "prompt": PREFIX + [2000 + i] * 4, "max_tokens": 440, "ignore_eos": True,
                   "temperature": 0} for i in range(NUM_REQUESTS)]
        load = asyncio.gather(*(http.post(f"{base}/v1/completions", json=body) for body in bodies))
        while engine.profile.num_steps < 20:  # (read from this thread: a count, so a stale one only waits longer)
            await asyncio.sleep(0.02)
        async with headless_page(f"{base}/dashboard") as page:
            await page.wait_for_function("() => window.dashboard.updates >= 1")
            first = await page.evaluate("""() => {
              const d = window.dashboard;
              d.redraw();
              const counters = Object.fromEntries([...document.querySelectorAll("#counters div")].map(
                div => [div.dataset.counter, div.querySelector("dd").textContent]));
              return {rows: d.rows, counters, kv: d.kvCounts};
            }""")
            assert page.errors == [], page.errors
        responses = await load
    assert all(response.status_code == 200 for response in responses)
    running_rows = [row for row in first["rows"] if row["state"] == "running"]
    assert running_rows and all("earlier" in row["kinds"] and row["blocks"] > 0 for row in running_rows), first["rows"]
    assert int(first["counters"]["running"]) == len(running_rows) > 0, first["counters"]
    assert first["kv"]["u"] + first["kv"]["s"] > 0 and first["counters"]["KV in use"] != "–", first
