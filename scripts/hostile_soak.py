"""A soak of disaggregated serving with constrained requests and speculation, first calm, then with hostile
clients beside the normal ones (issue 52; not in CI).

    .venv/bin/python scripts/hostile_soak.py                    # 2 x 180 s, the bundled model
    .venv/bin/python scripts/hostile_soak.py --duration 60 --rate 1

A prefill server (kv_producer) and a decode server (kv_consumer), each on a core of its own with one thread,
both speculating by prompt lookup, behind a router. Normal clients stream chat completions through the router
at `--rate` requests a second (Poisson arrivals; a third of them under a JSON schema, a third under a regex,
the rest free), each timed to its first token. The same load runs twice: calm, then beside hostile clients:

- a flood of fresh constraints (schemas of 150 to 250 patterned properties, seconds to compile each, a new one
  every time) through the router, and straight at the decode server: each compile is new work, and the
  compiler's bound answers 503 past it;
- forged kv_transfer_params: to the producer, naming a peer it must not connect to (a Redis port elsewhere) and
  the consumer's own port under a forged transfer id; to the consumer, claims of random transfer ids; to the
  router, params it must drop;
- malformed ZeroMQ frames at the consumer's KV port (random bytes, a header of wrong types, cut frames);
- junk bodies (not JSON, the wrong types, over the size limit) at the router and both servers.

The report: every answer by source and status; the 5xx outside the documented ones (503 busy, 503 when
compiles are full) must be 0; the normal requests' TTFT p50 and p99 in each phase and their ratio (target:
p99 within 2x); the KV blocks in use on both servers after the run, once unclaimed received blocks have
expired (must be 0); each server's resident memory at the start of each phase and after each quarter of it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import sys
import time
from pathlib import Path

import httpx
import zmq

from llm_runtime.lessons.disaggregation import ServerProcess, counters

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
TIMEOUT_S = 5.0  # kv_transfer_timeout_s: how long blocks wait for their request, and a request for its blocks
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                         "country": {"type": "string", "maxLength": 16},
                                         "population_millions": {"type": "integer", "minimum": 0, "maximum": 40}},
        "required": ["city", "country", "population_millions"], "additionalProperties": False}
QUESTIONS = ["Tell me about a large city.", "What is the capital of Italy?", "Describe a river.",
             "Name a famous painter.", "What is a KV cache?", "Write one sentence about the sea."]
DOCUMENTED_5XX = {503}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def normal_body(rng: random.Random) -> dict:
    body = {"messages": [{"role": "user", "content": rng.choice(QUESTIONS)}], "max_tokens": 24,
            "temperature": 0.8, "seed": rng.randrange(1000), "stream": True}
    kind = rng.randrange(3)
    if kind == 0:
        body["structured_outputs"] = {"json": CITY}
    elif kind == 1:
        body["structured_outputs"] = {"regex": "(yes|no), because [a-z ]{5,40}\\."}
    return body


async def normal_client(router: str, rate: float, deadline: float, rng: random.Random, ttfts: list[float],
                        counts: collections.Counter) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        tasks = []
        while time.monotonic() < deadline:
            tasks.append(asyncio.create_task(one_normal(http, router, normal_body(rng), ttfts, counts)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)


async def one_normal(http: httpx.AsyncClient, router: str, body: dict, ttfts: list[float],
                     counts: collections.Counter) -> None:
    started = time.perf_counter()
    try:
        async with http.stream("POST", f"{router}/v1/chat/completions", json=body) as response:
            first = None
            async for line in response.aiter_lines():
                if first is None and line.startswith("data: {") and '"content"' in line:
                    first = time.perf_counter() - started
                if '"error"' in line:
                    counts[("normal", "error event")] += 1
            counts[("normal", response.status_code)] += 1
            if response.status_code == 200 and first is not None:
                ttfts.append(first)
    except httpx.HTTPError as error:
        counts[("normal", type(error).__name__)] += 1


def slow_constraint(rng: random.Random) -> dict:
    """A schema no one sent before that takes xgrammar seconds to compile: 150 to 250 properties, each a pattern
    (200 of them: 9.4 s on this course's 2-core CPU with nothing else running)."""
    return {"json": {"type": "object", "properties": {
        f"key_{rng.randrange(10**6)}_{i}": {"type": "string", "pattern": "^[a-z]{3,40}$"}
        for i in range(rng.randrange(150, 250))}}}


async def hostile_clients(urls: dict[str, str], kv_address: tuple[str, int], deadline: float, rng: random.Random,
                          counts: collections.Counter) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        async def post(name: str, url: str, **kwargs) -> None:
            try:
                response = await http.post(url, **kwargs)
                counts[(name, response.status_code)] += 1
            except httpx.HTTPError as error:
                counts[(name, type(error).__name__)] += 1

        async def flood() -> None:
            sent = []
            while time.monotonic() < deadline:
                for target in ("router", "decode"):
                    body = {"prompt": "Say it:", "max_tokens": 4, "structured_outputs": slow_constraint(rng)}
                    sent.append(asyncio.create_task(post(f"slow schema -> {target}", f"{urls[target]}/v1/completions",
                                                         json=body)))
                await asyncio.sleep(0.25)
            await asyncio.gather(*sent)

        async def forged() -> None:
            host, port = kv_address
            while time.monotonic() < deadline:
                transfer = f"forged-{rng.randrange(10**9)}"
                await post("forged params -> prefill", f"{urls['prefill']}/v1/completions", json={
                    "prompt": "Hello", "max_tokens": 1, "kv_transfer_params": {
                        "do_remote_decode": True, "transfer_id": transfer, "remote_host": "10.0.0.9",
                        "remote_port": 6379}})
                await post("forged params -> prefill (to the consumer)", f"{urls['prefill']}/v1/completions", json={
                    "prompt": "Hello there", "max_tokens": 1, "kv_transfer_params": {
                        "do_remote_decode": True, "transfer_id": transfer, "remote_host": host, "remote_port": port}})
                await post("forged claim -> decode", f"{urls['decode']}/v1/completions", json={
                    "prompt": "Hello", "max_tokens": 2, "kv_transfer_params": {
                        "do_remote_prefill": True, "transfer_id": f"stolen-{rng.randrange(10**9)}"}})
                await post("forged params -> router", f"{urls['router']}/v1/completions", json={
                    "prompt": "Hello", "max_tokens": 2, "kv_transfer_params": {
                        "do_remote_decode": True, "transfer_id": "x", "remote_host": "10.0.0.9", "remote_port": 22}})
                await asyncio.sleep(0.5)

        async def junk() -> None:
            bodies = [b"{not json", json.dumps({"prompt": 5, "max_tokens": "many"}).encode(),
                      json.dumps({"messages": "hi"}).encode(), b"x" * (3 << 20)]
            while time.monotonic() < deadline:
                for name in ("router", "prefill", "decode"):
                    await post(f"junk -> {name}", f"{urls[name]}/v1/completions", content=rng.choice(bodies),
                               headers={"content-type": "application/json"})
                await asyncio.sleep(0.5)

        await asyncio.gather(flood(), forged(), junk(), frames(kv_address, deadline, rng, counts))


async def frames(kv_address: tuple[str, int], deadline: float, rng: random.Random, counts: collections.Counter) -> None:
    """Malformed messages at the consumer's KV port, from a raw PUSH socket."""
    socket = zmq.Context.instance().socket(zmq.PUSH)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDTIMEO, 100)
    socket.connect(f"tcp://{kv_address[0]}:{kv_address[1]}")
    header = {"transfer_id": "t", "layout": {"model": "m", "num_layers": "30", "num_kv_heads": 3, "head_dim": 64,
                                             "block_size": 16, "dtype": "float32", "storage": "float32",
                                             "kv_cache_dtype": "auto", "scales": None}, "token_ids": [1e999] * 16}
    messages = [[rng.randbytes(64)], [json.dumps(header).encode(), b"k", b"v"], [b"{}", b"", b"", b""],
                [json.dumps({**header, "token_ids": [2**63] * 16}).encode(), rng.randbytes(4096), b"v"]]
    try:
        while time.monotonic() < deadline:
            try:
                socket.send_multipart(rng.choice(messages))
                counts[("malformed frames", "sent")] += 1
            except zmq.Again:
                counts[("malformed frames", "held back")] += 1
            await asyncio.sleep(0.05)
    finally:
        socket.close()


async def sample_memory(pids: dict[str, int], name: str, duration: float,
                        memory: dict[str, list[tuple[str, float]]]) -> None:
    """Each server's resident memory at the start of a phase and after each quarter of it."""
    for quarter in range(5):
        for server_name, pid in pids.items():
            memory[server_name].append((f"{name} {quarter * duration / 4:.0f} s", rss_mib(pid)))
        if quarter < 4:
            await asyncio.sleep(duration / 4)


async def phase(urls: dict[str, str], kv_address: tuple[str, int], duration: float, rate: float, seed: int,
                hostile: bool, sampling) -> tuple[list[float], collections.Counter]:
    rng, ttfts, counts = random.Random(seed), [], collections.Counter()
    deadline = time.monotonic() + duration
    work = [normal_client(urls["router"], rate, deadline, rng, ttfts, counts), sampling]
    if hostile:
        work.append(hostile_clients(urls, kv_address, deadline, random.Random(seed + 1), counts))
    await asyncio.gather(*work)
    return ttfts, counts


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of each phase")
    parser.add_argument("--rate", type=float, default=0.5, help="normal requests a second")
    parser.add_argument("--seed", type=int, default=52)
    args = parser.parse_args()
    common = ["--dtype", "float32", "--kv-cache-memory", str(256 << 20), "--speculative-config", json.dumps(NGRAM),
              "--max-waiting-requests", "64"]
    prefill = ServerProcess.serve([*common, "--kv-transfer-config", json.dumps({
        "kv_role": "kv_producer", "kv_transfer_timeout_s": TIMEOUT_S})], cores=[0], threads=1, wait=False)
    decode = ServerProcess.serve([*common, "--kv-transfer-config", json.dumps({
        "kv_role": "kv_consumer", "kv_port": 0, "kv_transfer_timeout_s": TIMEOUT_S})], cores=[1], threads=1,
        wait=False)
    servers = {"prefill": prefill, "decode": decode}
    try:
        for server in servers.values():
            server.wait_ready()
        router = ServerProcess.router(["--prefill", prefill.url, "--decode", decode.url])
        info = httpx.get(f"{decode.url}/v1/kv_transfer").json()
        kv_address = (info["kv_ip"], info["kv_port"])
        urls = {"router": router.url, "prefill": prefill.url, "decode": decode.url}
        memory: dict[str, list[tuple[str, float]]] = {name: [] for name in servers}
        results = {}
        pids = {name: server.pid for name, server in servers.items()}
        for name, hostile in (("calm", False), ("hostile", True)):
            results[name] = asyncio.run(phase(urls, kv_address, args.duration, args.rate, args.seed, hostile,
                                              sample_memory(pids, name, args.duration, memory)))
        time.sleep(TIMEOUT_S + 3)  # unclaimed received blocks expire, idle servers included
        used = {name: counters(server.url)["kv_blocks_used"] for name, server in servers.items()}
        refused = counters(decode.url).get("kv_transfer_refused_total", float("nan"))
        router.stop()
    finally:
        for server in servers.values():
            server.stop()
    print(f"two phases of {args.duration:.0f} s, normal load {args.rate} requests/s through the router "
          f"(streamed chat; a third JSON schema, a third regex; prompt lookup on both servers)")
    bad = 0
    for name, (ttfts, counts) in results.items():
        print(f"\n{name}: {len(ttfts)} normal requests timed; TTFT p50 {percentile(ttfts, 0.5) * 1e3:.0f} ms, "
              f"p99 {percentile(ttfts, 0.99) * 1e3:.0f} ms")
        for (source, status), count in sorted(counts.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
            undocumented = isinstance(status, int) and status >= 500 and status not in DOCUMENTED_5XX
            bad += count if undocumented or (source == "normal" and status != 200) else 0
            print(f"  {source:46} {status!s:>18} {count:6}{'   <- not documented' if undocumented else ''}")
    calm, hostile = (percentile(results[name][0], 0.99) for name in ("calm", "hostile"))
    print(f"\nnormal TTFT p99, hostile against calm: {hostile / calm:.2f}x (target <= 2)")
    print(f"KV blocks in use after the run: {used} (must be 0); malformed KV messages the consumer refused: "
          f"{refused:.0f}")
    for name, samples in memory.items():
        print(f"{name} server resident memory (MiB): " + ", ".join(f"{when} {mib:.0f}" for when, mib in samples))
    ok = bad == 0 and all(v == 0 for v in used.values()) and hostile / calm <= 2
    print("PASS" if ok else f"FAIL ({bad} answers out of place)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
