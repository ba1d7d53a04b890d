"""Soak test (not in CI): many streaming clients against a real server for minutes, mixing valid
requests, invalid ones, hostile ones and hang-ups; then the server must be as it was.

    .venv/bin/python scripts/soak.py                       # 64 clients, 180 s, the bundled model
    .venv/bin/python scripts/soak.py --clients 16 --duration 30
    .venv/bin/python scripts/soak.py --duration 600 --kv-cache-dtype int8 \
        --speculative-config '{"method": "draft", "model": "self", "quantization": "gguf", "num_speculative_tokens": 3}'

Hostile, but valid, requests: seeds at both ends of the 64-bit range with n > 1 (the siblings' seeds wrap),
n = max_num_seqs, the most stop strings of the longest length allowed; each must be served (200). Invalid
ones must get 400 (413 for a body over the limit), and every error answer must be an OpenAI error object.

The server runs as its own process (`python -m llm_runtime serve --check-invariants`). The report:
requests served, answers by status, chunks streamed, the server's resident memory sampled every 15 s
(before, during, after), KV blocks in use at the end (must be 0), and whether the greedy answer to a
fixed prompt is unchanged. It fails on any 5xx but 503 busy, any answer of an unexpected status, any
error that is not an OpenAI error object, and any request the engine failed (finish_reason "error").
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "日本の首都は", "1, 2, 3, 4,",
           "Write a haiku about the sea.", "The three primary colors are", "Explain what a KV cache is."]
GREEDY = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def metrics(base: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def invalid_body(rng: random.Random) -> dict:
    """A request the server must refuse with 400 (each names a different field)."""
    return rng.choice([
        {"prompt": "Hi", "temperature": -1}, {"prompt": "Hi", "top_p": 0}, {"prompt": [[False]]},
        {"prompt": [1, 2, 10**9]}, {"prompt": "Hi", "stop_token_ids": [10**9], "min_tokens": 3},
        {"prompt": "Hi", "logprobs": 10**6}, {"prompt": "Hi", "seed": 2**64}, {"prompt": "Hi", "stop": ["x"] * 100},
        {"prompt": "Hi", "n": 10**4}, {"prompt": "Hi", "max_tokens": 10**7}, {"prompt": ["Hi", [10**9]]},
        {"prompt": "Hi", "frobnicate": True}, {"prompt": ""}, {"messages": []},
    ])


def hostile_body(rng: random.Random, max_num_seqs: int) -> dict:
    """A request at the edge of what is allowed, which the server must serve (200)."""
    prompt = rng.choice(PROMPTS)
    return rng.choice([
        {"prompt": prompt, "seed": 2**63 - 1, "n": rng.randint(2, 4), "temperature": 1.0, "max_tokens": 8},
        {"prompt": prompt, "seed": -(2**63), "n": 2, "temperature": 0.7, "max_tokens": 8},
        {"prompt": prompt, "n": max_num_seqs, "temperature": 1.0, "max_tokens": 4},
        {"prompt": prompt, "max_tokens": 16, "stop": [rng.choice("xyz") * 256 for _ in range(16)]},
        {"prompt": prompt, "max_tokens": 8, "stop": ["\n", ".", " the", "a" * 256] * 4, "temperature": 0.9,
         "seed": rng.randrange(-(2**63), 2**63)},
    ])


def is_error_object(response: httpx.Response) -> bool:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and {"message", "type"} <= set(error)


async def client(base: str, name: int, deadline: float, counts: collections.Counter, rng: random.Random,
                 max_num_seqs: int) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=300) as http:
        while time.time() < deadline:
            kind = rng.choices(["stream", "chat", "plain", "invalid", "hostile", "hangup", "plain_hangup", "huge"],
                               [36, 14, 13, 14, 10, 9, 2, 2])[0]
            body = {"prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(4, 48),
                    "temperature": rng.choice([0, 0.8]), "stream": kind in ("stream", "hangup")}
            path = "/v1/completions"
            if kind == "hostile":
                body = hostile_body(rng, max_num_seqs)
            if kind == "chat":
                body = {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "max_tokens": rng.randint(4, 32),
                        "stream": True, "logprobs": True, "top_logprobs": 2}
                path = "/v1/chat/completions"
            elif kind == "invalid":
                body = invalid_body(rng)
                path = "/v1/chat/completions" if "messages" in body else path
            elif kind == "huge":
                body = {"prompt": "a " * (3 * 2**20)}
            try:
                if body.get("stream"):
                    async with http.stream("POST", path, json=body) as response:
                        chunks = 0
                        async for line in response.aiter_lines():
                            if line.startswith("data: ") and line != "data: [DONE]":
                                chunks += 1
                                counts["chunks"] += 1
                                if '"error"' in line and "error" in json.loads(line[6:]):
                                    counts["UNEXPECTED error event in a stream"] += 1
                                if kind == "hangup" and chunks >= rng.randint(1, 5):
                                    counts["hung up (stream)"] += 1
                                    break
                        counts[f"status {response.status_code}"] += 1
                elif kind == "plain_hangup":
                    try:
                        await http.post(path, json={**body, "max_tokens": 400, "ignore_eos": True}, timeout=0.5)
                    except httpx.TimeoutException:
                        counts["hung up (non-streaming)"] += 1
                else:
                    response = await http.post(path, json=body)
                    counts[f"status {response.status_code}"] += 1
                    expected = {"invalid": 400, "huge": 413}.get(kind, 200)
                    if response.status_code != expected and response.status_code != 503:
                        counts[f"UNEXPECTED {kind} -> {response.status_code}"] += 1
                    if response.status_code >= 400 and not is_error_object(response):
                        counts[f"UNEXPECTED {kind} -> {response.status_code} without an error object"] += 1
                    if kind == "hostile" and response.status_code == 200:
                        counts["hostile served"] += 1
                counts["requests"] += 1
            except httpx.HTTPError as error:
                counts[f"client error {type(error).__name__}"] += 1


async def sample_rss(pid: int, deadline: float, samples: list[float], every: float = 15.0) -> None:
    while time.time() < deadline:
        await asyncio.sleep(min(every, max(0.0, deadline - time.time())))
        samples.append(round(rss_mib(pid), 1))


async def load(base: str, clients: int, duration: float, seed: int, max_num_seqs: int, pid: int,
               rss: list[float]) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    deadline = time.time() + duration
    await asyncio.gather(sample_rss(pid, deadline, rss),
                         *(client(base, i, deadline, counts, random.Random(seed + i), max_num_seqs)
                           for i in range(clients)))
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of load")
    parser.add_argument("--model", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-log", default="soak-server.log", help="the server's stderr")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--kv-cache-dtype", default="auto", help="the server's KV pool: auto, int8 or fp8")
    parser.add_argument("--speculative-config", default=None, metavar="JSON", help="the server's speculation")
    args = parser.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "llm_runtime", "serve", "--port", str(port), "--device", "cpu",
               "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-dtype", args.kv_cache_dtype,
               "--check-invariants"] + (["--model", args.model] if args.model else []) + (
        ["--speculative-config", args.speculative_config] if args.speculative_config else [])
    log = open(args.server_log, "w")
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, text=True)
    try:
        deadline = time.time() + 300
        while True:
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.time() > deadline:
                raise SystemExit(f"the server did not start (see {args.server_log})")
            time.sleep(0.5)
        before = httpx.post(f"{base}/v1/completions", json=GREEDY).json()["choices"][0]["text"]
        rss_before = rss_mib(server.pid)
        started = time.time()
        rss_during: list[float] = []
        counts = asyncio.run(load(base, args.clients, args.duration, args.seed, args.max_num_seqs, server.pid,
                                  rss_during))
        elapsed = time.time() - started
        for _ in range(120):  # aborts are applied between steps; let the last ones land
            final = metrics(base)
            if final["llm_runtime_num_requests_running"] == 0 and final["llm_runtime_num_requests_waiting"] == 0:
                break
            time.sleep(0.5)
        after = httpx.post(f"{base}/v1/completions", json=GREEDY).json()["choices"][0]["text"]
        final = metrics(base)
        report = {
            "clients": args.clients, "seconds": round(elapsed, 1), "requests": counts.pop("requests", 0),
            "chunks streamed": counts.pop("chunks", 0), "answers": dict(sorted(counts.items())),
            "rss_mib_before": round(rss_before, 1), "rss_mib_during": rss_during,
            "rss_mib_after": round(rss_mib(server.pid), 1),
            "kv_blocks_used_at_end": final["llm_runtime_kv_blocks_used"],
            "requests_finished_total": sum(v for k, v in final.items() if k.startswith(
                "llm_runtime_requests_finished_total")),
            "requests_aborted_total": final["llm_runtime_requests_aborted_total"],
            "requests_failed_total": final["llm_runtime_requests_failed_total"],
            "health": httpx.get(f"{base}/health").status_code, "same_greedy_answer": before == after,
        }
        print(json.dumps(report, indent=2))
        ok = (report["kv_blocks_used_at_end"] == 0 and report["same_greedy_answer"] and report["health"] == 200
              and report["requests_failed_total"] == 0
              and not any(k.startswith("UNEXPECTED") or (k.startswith("status 5") and k != "status 503")
                          for k in counts))
        return 0 if ok else 1
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


if __name__ == "__main__":
    sys.exit(main())
