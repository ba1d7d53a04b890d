"""What watching costs: the server's throughput under 32 concurrent streams with nobody watching, with 4 raw
subscribers on `/v1/engine/events`, and with the dashboard open in a headless Chromium; and how often the page
updates meanwhile.

    .venv/bin/python scripts/dashboard_benchmark.py                   # 3 rounds per condition, interleaved
    .venv/bin/python scripts/dashboard_benchmark.py --rounds 6 --dtype bfloat16 --server-cores 0

One server process (`llm_runtime serve`, the bundled model) serves every round. A round is 32 clients, each
streaming `--requests-per-client` completions of `--max-tokens` tokens one after another (greedy, EOS ignored), so
32 streams run for the whole round; its throughput is output tokens over the round's wall time. Conditions take
turns round by round (none, feed, page, none, ...), so the machine's drift falls on all of them alike; the table
gives each condition's median and its ratio to "none". In the page condition the page's own counter of state
events applied (`window.dashboard.updates`) gives its updates per second. The browser runs on the same cores as
the server: on a 2-core machine its drawing competes with the model, which is part of what attaching costs here.

`--server-cores 0` pins the server to the cores named (one thread per core) and this script, its clients, feed
readers and browser to the others, as a server and a reader's laptop on different machines would be: what is left
of the cost is the engine's own (building and sending the events), not the browser's drawing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

from llm_runtime.lessons.disaggregation import ServerProcess

CONDITIONS = ("none", "feed", "page")


async def _stream(http: httpx.AsyncClient, base: str, prompt: str, max_tokens: int) -> int:
    """One streamed completion; the number of tokens it brought."""
    body = {"model": "served", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True}
    tokens = 0
    async with http.stream("POST", f"{base}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                tokens += 1
    return tokens


async def _load(base: str, clients: int, per_client: int, max_tokens: int) -> tuple[int, float]:
    """(output tokens, seconds) of `clients` streams, each `per_client` completions in turn."""
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 8)) as http:
        async def client(i: int) -> int:
            return sum([await _stream(http, base, f"Client {i}, request {j}: tell me a story about the sea.",
                                      max_tokens) for j in range(per_client)])

        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(client(i) for i in range(clients))))
        return tokens, time.perf_counter() - start


async def _subscriber(base: str, counts: list[int], index: int) -> None:
    """A raw reader of the event feed, parsing every event as a page would."""
    async with httpx.AsyncClient(timeout=None) as http:
        async with http.stream("GET", f"{base}/v1/engine/events") as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    json.loads(line[len("data: "):])
                    counts[index] += 1


async def _round(condition: str, base: str, args: argparse.Namespace) -> dict[str, float]:
    if condition == "none":
        tokens, seconds = await _load(base, args.clients, args.requests_per_client, args.max_tokens)
        return {"tok_s": tokens / seconds, "seconds": seconds}
    if condition == "feed":
        counts = [0] * args.subscribers
        readers = [asyncio.create_task(_subscriber(base, counts, i)) for i in range(args.subscribers)]
        await asyncio.sleep(0.5)
        before = sum(counts)
        tokens, seconds = await _load(base, args.clients, args.requests_per_client, args.max_tokens)
        events = sum(counts) - before
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        return {"tok_s": tokens / seconds, "seconds": seconds, "events_s": events / seconds / args.subscribers}
    from llm_runtime.serving.dashboard import headless_page

    async with headless_page(f"{base}/dashboard") as page:
        await page.wait_for_selector('#connection[data-state="live"]')
        before = await page.evaluate("() => [window.dashboard.updates, window.dashboard.draws, window.dashboard.drawMs]")
        tokens, seconds = await _load(base, args.clients, args.requests_per_client, args.max_tokens)
        after = await page.evaluate("() => [window.dashboard.updates, window.dashboard.draws, window.dashboard.drawMs]")
        assert page.errors == [], page.errors
    return {"tok_s": tokens / seconds, "seconds": seconds, "updates_s": (after[0] - before[0]) / seconds,
            "draws_s": (after[1] - before[1]) / seconds, "draw_ms": (after[2] - before[2]) / max(1, after[1] - before[1])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per condition")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests-per-client", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--subscribers", type=int, default=4, help="raw readers in the feed condition")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--conditions", default=",".join(CONDITIONS))
    parser.add_argument("--output", default=None, help="also write the results as JSON there")
    parser.add_argument("--table", default=None, metavar="JSON", help="only print the table of an --output file")
    parser.add_argument("--server-cores", default=None, metavar="LIST",
                        help="e.g. 0: the server on these cores (a thread each), everything else on the rest (Linux)")
    parser.add_argument("server_args", nargs="*", help="more `serve` options, after --")
    args = parser.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.table).read_text())["results"]))
        return 0
    conditions = args.conditions.split(",")
    placement: dict = {}
    if args.server_cores is not None:
        cores = {int(c) for c in args.server_cores.split(",")}
        rest = os.sched_getaffinity(0) - cores
        if not rest or not cores <= os.sched_getaffinity(0):
            parser.error(f"--server-cores {args.server_cores}: must name some, not all, of "
                         f"{sorted(os.sched_getaffinity(0))}")
        placement = {"cores": sorted(cores), "threads": len(cores)}
    server = ServerProcess.serve(["--served-model-name", "served", "--dtype", args.dtype, *args.server_args],
                                 timeout_s=600, **placement)
    if placement:  # this process and what it starts from now on (clients, the browser) keep off the server's cores
        os.sched_setaffinity(0, rest)
    base = server.url
    results: dict[str, list[dict[str, float]]] = {c: [] for c in conditions}
    try:
        asyncio.run(_load(base, 4, 1, 8))  # warm-up
        for r in range(args.rounds):
            for condition in conditions:
                result = asyncio.run(_round(condition, base, args))
                results[condition].append(result)
                print(f"round {r + 1} {condition:>4}: " + ", ".join(f"{k} {v:.1f}" for k, v in result.items()),
                      flush=True)
    finally:
        server.stop()
    print(f"\n{args.clients} streams x {args.requests_per_client} x {args.max_tokens} tokens, {args.rounds} rounds, "
          f"dtype {args.dtype}, {os.cpu_count()} CPUs" + (f", server on cores {placement['cores']}, the rest on "
                                                         f"{sorted(rest)}" if placement else ""))
    print(table(results))
    if args.output:
        Path(args.output).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return 0


def table(results: dict[str, list[dict[str, float]]]) -> str:
    """Per condition: the median throughput, its ratio to nobody watching (medians), each round's ratio to the
    "none" round run just before it (their median and range), and the page's or readers' update rates."""
    none = results.get("none")
    reference = statistics.median(r["tok_s"] for r in none) if none else None
    lines = ["| condition | output tok/s (median) | vs none (medians) | vs none, round by round: median (range) | "
             "rounds | page updates/s (median, range) | feed events/s per reader |", "|---|---|---|---|---|---|---|"]
    for condition, rows in results.items():
        tok_s = statistics.median(r["tok_s"] for r in rows)
        ratio = f"{tok_s / reference:.3f}" if reference else "-"
        paired = [r["tok_s"] / n["tok_s"] for r, n in zip(rows, none)] if none and condition != "none" else []
        by_round = f"{statistics.median(paired):.3f} ({min(paired):.2f} to {max(paired):.2f})" if paired else "-"
        updates = [r["updates_s"] for r in rows if "updates_s" in r]
        events = [r["events_s"] for r in rows if "events_s" in r]
        each = ", ".join(f"{r['tok_s']:.1f}" for r in rows)
        page = f"{statistics.median(updates):.1f} ({min(updates):.1f} to {max(updates):.1f})" if updates else "-"
        lines.append(f"| {condition} | {tok_s:.1f} | {ratio} | {by_round} | {each} | {page} | "
                     f"{f'{statistics.median(events):.1f}' if events else '-'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
