"""Reference solutions to the lessons' exercises, and plausible wrong answers each checker must reject.

Written from each exercise's statement, without calling the package code the checker compares with,
so that a solution passing its checker shows that the statement, the checker and the package agree.
`SOLUTIONS["lesson02.top_p_filter"]` is the answer to `lesson02.check_top_p_filter`; `WRONG[...]` lists
answers with one classic mistake each (an off-by-one, eps in the wrong place, tiled instead of
grouped heads, ...).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch

# ------------------------------------------------------------------------------------------ lesson 01


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def rms_norm_eps_outside_the_root(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / (x.pow(2).mean(dim=-1, keepdim=True).sqrt() + eps) * weight


def rms_norm_centred(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm without its bias: subtracts the mean first."""
    centred = x - x.mean(dim=-1, keepdim=True)
    return centred / torch.sqrt(centred.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def kv_bytes_per_token(config, dtype_size: int) -> int:
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype_size


def kv_bytes_per_token_of_query_heads(config, dtype_size: int) -> int:
    return 2 * config.num_layers * config.num_heads * config.head_dim * dtype_size


def kv_bytes_per_token_from_hidden_size(config, dtype_size: int) -> int:
    return 2 * config.num_layers * config.num_kv_heads * (config.hidden_size // config.num_heads) * dtype_size


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, T, S)
    return scores.masked_fill(~allowed, -math.inf).softmax(dim=-1) @ v


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # head h reads KV head h // group
    num_new, num_keys = q.shape[2], k.shape[2]
    allowed = torch.arange(num_keys)[None, :] <= torch.arange(num_cached, num_cached + num_new)[:, None]  # (T, S)
    return _attention(q, k, v, allowed)


def gqa_attention_tiled_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int) -> torch.Tensor:
    """`repeat` tiles the KV heads (0, 1, 0, 1): query head h reads KV head h % num_kv_heads."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
    num_new, num_keys = q.shape[2], k.shape[2]
    allowed = torch.arange(num_keys)[None, :] <= torch.arange(num_cached, num_cached + num_new)[:, None]
    return _attention(q, k, v, allowed)


def gqa_attention_mask_from_the_top_left(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                         num_cached: int) -> torch.Tensor:
    """The square causal mask's corner at key 0: right without a cache, wrong after it."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    allowed = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    return _attention(q, k, v, allowed)


# ------------------------------------------------------------------------------------------ lesson 02


def top_p_filter(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    probs, order = logits.softmax(dim=-1).sort(dim=-1, descending=True)
    mass_above = probs.cumsum(dim=-1) - probs  # the probability of every more likely token
    remove = mass_above >= top_p  # the tokens before it already reach top_p
    return logits.masked_fill(torch.zeros_like(remove).scatter(1, order, remove), -math.inf)


def top_p_filter_one_token_too_few(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Drops the token that crosses top_p, where the nucleus includes it."""
    probs, order = logits.softmax(dim=-1).sort(dim=-1, descending=True)
    remove = probs.cumsum(dim=-1) > top_p
    remove[:, 0] = False
    return logits.masked_fill(torch.zeros_like(remove).scatter(1, order, remove), -math.inf)


def top_k_filter(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for row, k in enumerate(top_k[:, 0].tolist()):
        kth_largest = logits[row].topk(k).values[-1]
        out[row, logits[row] < kth_largest] = -math.inf
    return out


def top_k_filter_dropping_ties(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Exactly k tokens per row (torch.topk's indices): a token tied with the k-th may go."""
    out = torch.full_like(logits, -math.inf)
    for row, k in enumerate(top_k[:, 0].tolist()):
        index = logits[row].topk(k).indices
        out[row, index] = logits[row, index]
    return out


def apply_penalties(logits: torch.Tensor, prompt_token_ids: list[list[int]], output_token_ids: list[list[int]],
                    repetition_penalties: list[float], frequency_penalties: list[float],
                    presence_penalties: list[float]) -> torch.Tensor:
    out = logits.clone()
    for row in range(logits.shape[0]):
        for token in set(prompt_token_ids[row]) | set(output_token_ids[row]):
            value, penalty = out[row, token], repetition_penalties[row]
            out[row, token] = value / penalty if value > 0 else value * penalty
        for token, count in Counter(output_token_ids[row]).items():
            out[row, token] -= frequency_penalties[row] * count + presence_penalties[row]
    return out


def apply_penalties_always_dividing(logits: torch.Tensor, prompt_token_ids: list[list[int]],
                                    output_token_ids: list[list[int]], repetition_penalties: list[float],
                                    frequency_penalties: list[float], presence_penalties: list[float]) -> torch.Tensor:
    """Divides negative logits too, which makes a seen token with a negative logit *more* likely."""
    out = logits.clone()
    for row in range(logits.shape[0]):
        for token in set(prompt_token_ids[row]) | set(output_token_ids[row]):
            out[row, token] = out[row, token] / repetition_penalties[row]
        for token, count in Counter(output_token_ids[row]).items():
            out[row, token] -= frequency_penalties[row] * count + presence_penalties[row]
    return out


def apply_penalties_counting_the_prompt(logits: torch.Tensor, prompt_token_ids: list[list[int]],
                                        output_token_ids: list[list[int]], repetition_penalties: list[float],
                                        frequency_penalties: list[float], presence_penalties: list[float]
                                        ) -> torch.Tensor:
    """Frequency and presence penalties over the prompt too (vLLM counts only the output)."""
    both = [p + o for p, o in zip(prompt_token_ids, output_token_ids)]
    return apply_penalties(logits, prompt_token_ids, both, repetition_penalties, frequency_penalties,
                           presence_penalties)


# ------------------------------------------------------------------------------------------ lesson 03


def _earliest_stop(text: str, stop: list[str]) -> tuple[int, str] | None:
    found = [(text.find(s), s) for s in stop if s in text]
    return min(found) if found else None


def stop_text(pieces: list[str], stop: list[str]) -> tuple[str, str | None]:
    text = ""
    for piece in pieces:
        text += piece
        match = _earliest_stop(text, stop)  # earlier text held none, so a match ends in this piece
        if match is not None:
            return text[: match[0]], match[1]
    return text, None


def stop_text_searching_each_piece(pieces: list[str], stop: list[str]) -> tuple[str, str | None]:
    """Looks for stop strings in each new piece alone: misses one split across tokens."""
    text = ""
    for piece in pieces:
        match = _earliest_stop(piece, stop)
        if match is not None:
            return text + piece[: match[0]], match[1]
        text += piece
    return text, None


def _stream_deltas(pieces: list[str], stop: list[str], hold: int) -> list[str]:
    text, sent, deltas = "", 0, []
    for number, piece in enumerate(pieces, start=1):
        text += piece
        match = _earliest_stop(text, stop)
        if match is not None or number == len(pieces):  # the end: everything left goes out
            text = text[: match[0]] if match is not None else text
            deltas.append(text[sent:])
            return deltas
        release_to = max(sent, len(text) - hold)
        deltas.append(text[sent:release_to])
        sent = release_to
    return deltas


def stream_deltas(pieces: list[str], stop: list[str]) -> list[str]:
    return _stream_deltas(pieces, stop, hold=max((len(s) for s in stop), default=1) - 1)


def stream_deltas_holding_one_too_many(pieces: list[str], stop: list[str]) -> list[str]:
    return _stream_deltas(pieces, stop, hold=max((len(s) for s in stop), default=0))


def stream_deltas_holding_nothing(pieces: list[str], stop: list[str]) -> list[str]:
    """Sends text as it comes: the start of a stop string goes out before the stop string is complete."""
    return _stream_deltas(pieces, stop, hold=0)


# ------------------------------------------------------------------------------------------ lesson 04


def _fcfs_batches(prompt_lens: list[int], max_batch_size: int, max_num_batched_tokens: int,
                  padded: bool = True) -> list[list[int]]:
    batches, current, longest, total = [], [], 0, 0
    for index, length in enumerate(prompt_lens):
        tokens = max(longest, length) * (len(current) + 1) if padded else total + length
        if current and (len(current) == max_batch_size or tokens > max_num_batched_tokens):
            batches.append(current)
            current, longest, total = [], 0, 0
        current.append(index)
        longest, total = max(longest, length), total + length
    return batches + [current]


def _token_steps(batches: list[list[int]], max_tokens: list[int]) -> list[tuple[int, int]]:
    steps: list[tuple[int, int]] = [(0, 0)] * len(max_tokens)
    done = 0  # steps taken by the batches before this one
    for batch in batches:
        for i in batch:
            steps[i] = (done + 1, done + max_tokens[i])  # prefill gives the first token; one more per step
        done += max(max_tokens[i] for i in batch)  # the batch runs until its longest request is done
    return steps


def static_token_steps(prompt_lens: list[int], max_tokens: list[int], max_batch_size: int,
                       max_num_batched_tokens: int) -> list[tuple[int, int]]:
    return _token_steps(_fcfs_batches(prompt_lens, max_batch_size, max_num_batched_tokens), max_tokens)


def static_token_steps_unpadded_budget(prompt_lens: list[int], max_tokens: list[int], max_batch_size: int,
                                       max_num_batched_tokens: int) -> list[tuple[int, int]]:
    """Caps the sum of the prompt lengths, where the padded rectangle is what runs."""
    return _token_steps(_fcfs_batches(prompt_lens, max_batch_size, max_num_batched_tokens, padded=False), max_tokens)


def wasted_slots(prompt_lens: list[int], max_tokens: list[int], max_batch_size: int,
                 max_num_batched_tokens: int) -> int:
    total = 0
    for batch in _fcfs_batches(prompt_lens, max_batch_size, max_num_batched_tokens):
        longest = max(max_tokens[i] for i in batch)
        total += sum(longest - max_tokens[i] for i in batch)
    return total


def wasted_slots_against_the_longest_request_of_all(prompt_lens: list[int], max_tokens: list[int],
                                                    max_batch_size: int, max_num_batched_tokens: int) -> int:
    """Forgets that each batch ends with its own longest request."""
    return sum(max(max_tokens) - count for count in max_tokens)


# ------------------------------------------------------------------------------------------ lesson 05


def flatten_ragged(segments: list[tuple[list[int], int, int]]) -> tuple[list[int], list[int], list[int]]:
    input_ids: list[int] = []
    positions: list[int] = []
    logit_rows: list[int] = []
    for token_ids, start, count in segments:
        input_ids += token_ids[start : start + count]
        positions += range(start, start + count)
        if start + count == len(token_ids):
            logit_rows.append(len(input_ids) - 1)
    return input_ids, positions, logit_rows


def flatten_ragged_every_segment_samples(segments: list[tuple[list[int], int, int]]
                                         ) -> tuple[list[int], list[int], list[int]]:
    input_ids: list[int] = []
    positions: list[int] = []
    logit_rows: list[int] = []
    for token_ids, start, count in segments:
        input_ids += token_ids[start : start + count]
        positions += range(start, start + count)
        logit_rows.append(len(input_ids) - 1)
    return input_ids, positions, logit_rows


def flatten_ragged_positions_from_zero(segments: list[tuple[list[int], int, int]]
                                       ) -> tuple[list[int], list[int], list[int]]:
    """Positions as a padded batch's columns would number them: each segment from 0."""
    input_ids, _, logit_rows = flatten_ragged(segments)
    return input_ids, [p for _, _, count in segments for p in range(count)], logit_rows


def prefill_chunks(prompt_len: int, num_decodes: int, max_num_batched_tokens: int) -> list[int]:
    chunks, left = [], prompt_len
    while left:
        chunks.append(min(left, max_num_batched_tokens - num_decodes))  # the decodes go first
        left -= chunks[-1]
    return chunks


def prefill_chunks_ignoring_the_decodes(prompt_len: int, num_decodes: int, max_num_batched_tokens: int) -> list[int]:
    return prefill_chunks(prompt_len, 0, max_num_batched_tokens)


# ------------------------------------------------------------------------------------------ lesson 06


def pool_blocks(device_memory: int, gpu_memory_utilization: float, held_bytes: int, max_num_seqs: int,
                max_model_len: int, bytes_per_token: int, block_size: int) -> int:
    usable = int(device_memory * gpu_memory_utilization) - held_bytes
    per_sequence = -(-max_model_len // block_size)  # whole blocks
    return min(usable // (block_size * bytes_per_token), max_num_seqs * per_sequence)


def pool_blocks_without_the_cap(device_memory: int, gpu_memory_utilization: float, held_bytes: int,
                                max_num_seqs: int, max_model_len: int, bytes_per_token: int, block_size: int) -> int:
    return (int(device_memory * gpu_memory_utilization) - held_bytes) // (block_size * bytes_per_token)


def pool_blocks_in_tokens_not_blocks(device_memory: int, gpu_memory_utilization: float, held_bytes: int,
                                     max_num_seqs: int, max_model_len: int, bytes_per_token: int,
                                     block_size: int) -> int:
    usable = int(device_memory * gpu_memory_utilization) - held_bytes
    return min(usable, max_num_seqs * max_model_len * bytes_per_token) // (block_size * bytes_per_token)


def pool_blocks_ignoring_what_is_held(device_memory: int, gpu_memory_utilization: float, held_bytes: int,
                                      max_num_seqs: int, max_model_len: int, bytes_per_token: int,
                                      block_size: int) -> int:
    return pool_blocks(device_memory, gpu_memory_utilization, 0, max_num_seqs, max_model_len, bytes_per_token,
                       block_size)


def refusal(prompt_len: int, max_tokens: int, context_len: int, num_kv_blocks: int, block_size: int) -> str | None:
    if prompt_len >= context_len:  # no room for one new token
        return "prompt"
    if -(-(prompt_len + 1) // block_size) > num_kv_blocks:  # the prompt and one new token never fit the pool
        return "prompt"
    if prompt_len + max_tokens > min(context_len, num_kv_blocks * block_size):
        return "max_tokens"
    return None


def refusal_counting_prompt_blocks_only(prompt_len: int, max_tokens: int, context_len: int, num_kv_blocks: int,
                                        block_size: int) -> str | None:
    """Forgets the first new token needs a slot too."""
    if prompt_len >= context_len or -(-prompt_len // block_size) > num_kv_blocks:
        return "prompt"
    if prompt_len + max_tokens > min(context_len, num_kv_blocks * block_size):
        return "max_tokens"
    return None


# ------------------------------------------------------------------------------------------ lesson 07


def slot_mapping(block_table: list[int], start: int, num_tokens: int, block_size: int) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, start + num_tokens)]


def slot_mapping_block_not_scaled(block_table: list[int], start: int, num_tokens: int, block_size: int) -> list[int]:
    return [block_table[p // block_size] + p % block_size for p in range(start, start + num_tokens)]


def block_to_copy(block_table: list[int], ref_counts: list[int], num_tokens: int, block_size: int) -> int | None:
    write_block = (num_tokens - 1) // block_size
    if write_block < len(block_table) and ref_counts[block_table[write_block]] > 1:
        return block_table[write_block]
    return None


def block_to_copy_last_block(block_table: list[int], ref_counts: list[int], num_tokens: int,
                             block_size: int) -> int | None:
    """Copies the last block if shared, even when the new token opens a block of its own."""
    return block_table[-1] if ref_counts[block_table[-1]] > 1 else None


# ------------------------------------------------------------------------------------------ lesson 08


def _cached_blocks(cached_prompts: list[list[int]], prompt: list[int], block_size: int, limit: int) -> int:
    best = 0
    for cached in cached_prompts:
        n = 0
        while n < limit and (n + 1) * block_size <= len(cached) and \
                cached[n * block_size : (n + 1) * block_size] == prompt[n * block_size : (n + 1) * block_size]:
            n += 1
        best = max(best, n)
    return best


def num_cached_tokens(cached_prompts: list[list[int]], prompt: list[int], block_size: int) -> int:
    return _cached_blocks(cached_prompts, prompt, block_size, (len(prompt) - 1) // block_size) * block_size


def num_cached_tokens_whole_prompt(cached_prompts: list[list[int]], prompt: list[int], block_size: int) -> int:
    """Lets a fully cached prompt skip its last token too (then nothing produces the next token's logits)."""
    return _cached_blocks(cached_prompts, prompt, block_size, len(prompt) // block_size) * block_size


def num_cached_tokens_common_prefix(cached_prompts: list[list[int]], prompt: list[int], block_size: int) -> int:
    """The longest common prefix in tokens: a partial block cannot be reused."""
    best = 0
    for cached in cached_prompts:
        n = 0
        while n < min(len(cached), len(prompt) - 1) and cached[n] == prompt[n]:
            n += 1
        best = max(best, n)
    return best


def hit_rate(prompts: list[list[int]], block_size: int) -> float:
    hits = sum(num_cached_tokens(prompts[:i], prompt, block_size) for i, prompt in enumerate(prompts))
    return hits / sum(len(prompt) for prompt in prompts)


def hit_rate_by_common_prefix(prompts: list[list[int]], block_size: int) -> float:
    hits = sum(num_cached_tokens_common_prefix(prompts[:i], prompt, block_size) for i, prompt in enumerate(prompts))
    return hits / sum(len(prompt) for prompt in prompts)


# ------------------------------------------------------------------------------------------ lesson 09


def request_latencies(start: float, token_times: list[float]) -> tuple[float, float | None, list[float], float]:
    itls = [b - a for a, b in zip(token_times, token_times[1:])]
    tpot = (token_times[-1] - token_times[0]) / (len(token_times) - 1) if len(token_times) > 1 else None
    return token_times[0] - start, tpot, itls, token_times[-1] - start


def request_latencies_tpot_over_all_tokens(start: float, token_times: list[float]
                                           ) -> tuple[float, float | None, list[float], float]:
    """TPOT as end-to-end latency per token: the first token's wait counted in."""
    ttft, _, itls, e2el = request_latencies(start, token_times)
    return ttft, e2el / len(token_times), itls, e2el


def _goodput(requests: list[tuple[float, list[float]]], duration: float, ttft_target: float | None,
             tpot_target: float | None, strict: bool) -> float:
    def within(value: float | None, target: float | None) -> bool:
        if target is None or value is None:
            return True
        return value < target if strict else value <= target

    met = 0
    for start, times in requests:
        ttft, tpot, _, _ = request_latencies(start, times)
        met += within(ttft, ttft_target) and within(tpot, tpot_target)
    return met / duration


def goodput(requests: list[tuple[float, list[float]]], duration: float, ttft_target: float | None,
            tpot_target: float | None) -> float:
    return _goodput(requests, duration, ttft_target, tpot_target, strict=False)


def goodput_strictly_below(requests: list[tuple[float, list[float]]], duration: float, ttft_target: float | None,
                           tpot_target: float | None) -> float:
    return _goodput(requests, duration, ttft_target, tpot_target, strict=True)


def latency_percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    below = math.floor(rank)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (rank - below)


def latency_percentile_nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


# ------------------------------------------------------------------------------------------ lesson 10


def parse_chat_stream(body: str) -> list[tuple[str, str | None]]:
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    for event in body.split("\n\n"):
        if not event.startswith("data: "):
            continue
        data = event[len("data: "):]
        if data == "[DONE]":
            break
        for choice in json.loads(data)["choices"]:
            index = choice["index"]
            texts[index] = texts.get(index, "") + (choice["delta"].get("content") or "")
            reasons[index] = choice.get("finish_reason") or reasons.get(index)
    return [(texts[i], reasons[i]) for i in sorted(texts)]


def parse_chat_stream_first_choice_only(body: str) -> list[tuple[str, str | None]]:
    """Reads choices[0] of every chunk: a usage chunk has none, and other choices are lost."""
    text, reason = "", None
    for event in body.split("\n\n"):
        if event.startswith("data: ") and event != "data: [DONE]":
            choice = json.loads(event[len("data: "):])["choices"][0]
            text += choice["delta"].get("content") or ""
            reason = choice.get("finish_reason") or reason
    return [(text, reason)]


def parse_chat_stream_searching_for_done(body: str) -> list[tuple[str, str | None]]:
    """Stops at the first event that *contains* [DONE], a text's own included."""
    cut = body.find("[DONE]")
    return parse_chat_stream(body[: body.rfind("\n\n", 0, cut) + 2] if cut >= 0 else body)


def is_busy(num_waiting: int, num_new: int, max_waiting_requests: int) -> bool:
    return num_waiting + num_new > max_waiting_requests


def is_busy_when_full(num_waiting: int, num_new: int, max_waiting_requests: int) -> bool:
    """Refuses what would exactly fill the queue."""
    return num_waiting + num_new >= max_waiting_requests


def is_busy_ignoring_the_burst(num_waiting: int, num_new: int, max_waiting_requests: int) -> bool:
    return num_waiting >= max_waiting_requests


# ------------------------------------------------------------------------------------------ lesson 11


def merge_attention(out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    lse = torch.logaddexp(lse1, lse2)  # (H, L): log(e^lse1 + e^lse2), without overflow
    return torch.exp(lse1 - lse)[..., None] * out1 + torch.exp(lse2 - lse)[..., None] * out2


def merge_attention_equal_weights(out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor,
                                  lse2: torch.Tensor) -> torch.Tensor:
    """Averages the two outputs, as if both sets held the same softmax mass."""
    return (out1 + out2) / 2


def merge_attention_without_the_max(out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor,
                                    lse2: torch.Tensor) -> torch.Tensor:
    """Right algebra, but exp(lse) overflows to inf for large scores: inf / inf is NaN."""
    weight1, weight2 = torch.exp(lse1)[..., None], torch.exp(lse2)[..., None]
    return (weight1 * out1 + weight2 * out2) / (weight1 + weight2)


def _paged_decode(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, block_table: list[int],
                  seq_len: int, rescale: bool = True, whole_blocks: bool = False) -> torch.Tensor:
    num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_pool.shape[1], key_pool.shape[2]
    kv_head = torch.arange(num_heads) // (num_heads // num_kv_heads)  # (H,) the KV head each query head reads
    running_max = torch.full((num_heads,), -math.inf, dtype=query.dtype)
    running_sum = torch.zeros(num_heads, dtype=query.dtype)
    acc = torch.zeros(num_heads, head_dim, dtype=query.dtype)
    for first in range(0, seq_len, block_size):
        block = block_table[first // block_size]
        used = block_size if whole_blocks else min(block_size, seq_len - first)
        keys = key_pool[block, :used][:, kv_head]  # (used, H, d)
        values = value_pool[block, :used][:, kv_head]
        scores = torch.einsum("hd,thd->ht", query, keys) * head_dim**-0.5  # (H, used)
        new_max = torch.maximum(running_max, scores.max(dim=1).values)
        alpha = torch.exp(running_max - new_max) if rescale else torch.ones_like(new_max)
        p = torch.exp(scores - new_max[:, None])  # (H, used)
        running_sum = running_sum * alpha + p.sum(dim=1)
        acc = acc * alpha[:, None] + torch.einsum("ht,thd->hd", p, values)
        running_max = new_max
    return acc / running_sum[:, None]


def paged_decode(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, block_table: list[int],
                 seq_len: int) -> torch.Tensor:
    return _paged_decode(query, key_pool, value_pool, block_table, seq_len)


def paged_decode_without_rescaling(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                                   block_table: list[int], seq_len: int) -> torch.Tensor:
    """Forgets to rescale what was accumulated when the running max grows."""
    return _paged_decode(query, key_pool, value_pool, block_table, seq_len, rescale=False)


def paged_decode_whole_last_block(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                                  block_table: list[int], seq_len: int) -> torch.Tensor:
    """Attends over every slot of the last block, past seq_len too."""
    return _paged_decode(query, key_pool, value_pool, block_table, seq_len, whole_blocks=True)


def paged_decode_gathering_the_history(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                                      block_table: list[int], seq_len: int) -> torch.Tensor:
    """The right numbers, from the whole history gathered at once: what the task forbids."""
    from llm_runtime.lessons.exercises.lesson11 import package_paged_decode

    return package_paged_decode(query, key_pool, value_pool, block_table, seq_len)


def paged_decode_joining_block_copies(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                                      block_table: list[int], seq_len: int) -> torch.Tensor:
    """The whole history after all: each block cloned on its own (one block at a time), then joined into a pool of
    the sequence's own, read block by block."""
    blocks = [(key_pool[b].clone(), value_pool[b].clone()) for b in block_table]
    keys, values = torch.stack([k for k, _ in blocks]), torch.stack([v for _, v in blocks])
    return _paged_decode(query, keys, values, list(range(len(block_table))), seq_len)


# ------------------------------------------------------------------------------------------ the index
# ------------------------------------------------------------------------------------------ lesson 12
def slot_mappings(block_tables: list[list[int]], starts: list[int], num_new_tokens: list[int],
                  block_size: int) -> list[int]:
    counts = torch.tensor(num_new_tokens)
    seq = torch.repeat_interleave(torch.arange(len(starts)), counts)  # (N,) which sequence each token is
    first_row = torch.cumsum(counts, 0) - counts  # (B,)
    positions = torch.arange(int(counts.sum())) - first_row[seq] + torch.tensor(starts)[seq]
    width = max(len(t) for t in block_tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in block_tables])
    return (table[seq, positions // block_size] * block_size + positions % block_size).tolist()


def slot_mappings_ignoring_the_start(block_tables: list[list[int]], starts: list[int], num_new_tokens: list[int],
                                     block_size: int) -> list[int]:
    return slot_mappings(block_tables, [0] * len(starts), num_new_tokens, block_size)


def slot_mappings_offset_by_block_index(block_tables: list[list[int]], starts: list[int],
                                        num_new_tokens: list[int], block_size: int) -> list[int]:
    return [block_tables[b][p // block_size] + p % block_size  # forgets to scale the block by its size
            for b, (start, count) in enumerate(zip(starts, num_new_tokens)) for p in range(start, start + count)]


def slot_mappings_a_loop_per_token(block_tables: list[list[int]], starts: list[int], num_new_tokens: list[int],
                                   block_size: int) -> list[int]:
    return [block_tables[b][p // block_size] * block_size + p % block_size  # right, but one Python step a token
            for b, (start, count) in enumerate(zip(starts, num_new_tokens)) for p in range(start, start + count)]


def slot_mappings_one_tensor_at_the_end(block_tables: list[list[int]], starts: list[int], num_new_tokens: list[int],
                                        block_size: int) -> list[int]:
    slots = [block_tables[b][p // block_size] * block_size + p % block_size  # a Python loop per token, then
             for b, (start, count) in enumerate(zip(starts, num_new_tokens)) for p in range(start, start + count)]
    return torch.tensor(slots).tolist()  # one tensor operation, whatever the count


def slot_mappings_a_tensor_per_token(block_tables: list[list[int]], starts: list[int], num_new_tokens: list[int],
                                     block_size: int) -> list[int]:
    slots = []
    for b, (start, count) in enumerate(zip(starts, num_new_tokens)):
        table = torch.tensor(block_tables[b])
        for p in range(start, start + count):  # right, but tensor operations for every token
            slots.append(int(table[p // block_size] * block_size + p % block_size))
    return slots


def fused_qkv(x: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
              v_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out = x @ torch.cat([q_weight, k_weight, v_weight]).T  # (tokens, q + k + v)
    return tuple(out.split([q_weight.shape[0], k_weight.shape[0], v_weight.shape[0]], dim=-1))


def fused_qkv_split_in_thirds(x: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                              v_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple((x @ torch.cat([q_weight, k_weight, v_weight]).T).chunk(3, dim=-1))


def fused_qkv_three_multiplies(x: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                               v_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return x @ q_weight.T, x @ k_weight.T, x @ v_weight.T  # right, but three multiplies


def fused_qkv_one_multiply_and_sums(x: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                                    v_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One multiply for q only; k and v as products summed by hand, which no multiply count sees."""
    return x @ q_weight.T, (x[:, None] * k_weight).sum(-1), (x[:, None] * v_weight).sum(-1)


def quantize_groups(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    groups = weight.reshape(weight.shape[0], -1, group_size)  # (out, G, group)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = (high - low).clamp(min=1e-12) / 15
    return (((groups - low) / scale).round().clamp(0, 15) * scale + low).reshape(weight.shape)


def quantize_groups_per_row(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    low, high = weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)  # one group per row: too coarse
    scale = (high - low) / 15
    return ((weight - low) / scale).round() * scale + low


def quantize_groups_symmetric(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    groups = weight.reshape(weight.shape[0], -1, group_size)
    scale = groups.abs().amax(-1, keepdim=True) / 7  # [-7, 7]: zero exact, but the grid is half as fine
    return ((groups / scale).round().clamp(-8, 7) * scale).reshape(weight.shape)


def quantize_kv_int8(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(-1, keepdim=True) / 127  # (tokens, heads, 1)
    return (x / scale).round().clamp(-127, 127) * scale


def quantize_kv_int8_per_tensor(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().max() / 127  # one scale for every token: the small ones round to 0
    return (x / scale).round() * scale


def quantize_kv_int8_truncated(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(-1, keepdim=True) / 127
    return (x / scale).trunc() * scale  # toward zero: up to a whole step off


def read_q4_1_block(block: bytes) -> list[float]:
    d, m = np.frombuffer(block[:4], dtype=np.float16).astype(np.float32)
    packed = np.frombuffer(block[4:20], dtype=np.uint8)
    q = np.concatenate([packed & 0x0F, packed >> 4])
    return (d * q + m).tolist()


def read_q4_1_block_interleaved(block: bytes) -> list[float]:
    d, m = np.frombuffer(block[:4], dtype=np.float16).astype(np.float32)
    packed = np.frombuffer(block[4:20], dtype=np.uint8)
    q = np.stack([packed & 0x0F, packed >> 4], axis=1).reshape(-1)  # low, high of each byte in turn: wrong order
    return (d * q + m).tolist()


def propose(token_ids: list[int], num_tokens: int, max_n: int) -> list[int]:
    for n in range(min(max_n, len(token_ids) - 1), 0, -1):
        suffix = token_ids[-n:]
        for start in range(len(token_ids) - n):
            if token_ids[start : start + n] == suffix:
                return token_ids[start + n : start + n + num_tokens]
    return []


def propose_most_recent_occurrence(token_ids: list[int], num_tokens: int, max_n: int) -> list[int]:
    for n in range(min(max_n, len(token_ids) - 1), 0, -1):
        suffix = token_ids[-n:]
        for start in range(len(token_ids) - n - 1, -1, -1):  # the latest match: in periodic text it runs out
            if token_ids[start : start + n] == suffix:
                return token_ids[start + n : start + n + num_tokens]
    return []


def propose_shortest_match_first(token_ids: list[int], num_tokens: int, max_n: int) -> list[int]:
    for n in range(1, min(max_n, len(token_ids) - 1) + 1):  # weakest evidence first
        suffix = token_ids[-n:]
        for start in range(len(token_ids) - n):
            if token_ids[start : start + n] == suffix:
                return token_ids[start + n : start + n + num_tokens]
    return []


def verify_sampled(draft_token_ids: list[int], target_probs: torch.Tensor, draft_probs: torch.Tensor,
                   uniform: torch.Tensor, noise: torch.Tensor) -> list[int]:
    kept = []
    for i, d in enumerate(draft_token_ids):
        if uniform[i] * draft_probs[i, d] < target_probs[i, d]:
            kept.append(d)
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp_min(0)
        if residual.sum() <= 0:
            residual = target_probs[i]
        return kept + [int((residual / noise[i]).argmax())]
    k = len(draft_token_ids)
    return kept + [int((target_probs[k] / noise[k]).argmax())]


def verify_sampled_replacing_from_p(draft_token_ids: list[int], target_probs: torch.Tensor, draft_probs: torch.Tensor,
                                    uniform: torch.Tensor, noise: torch.Tensor) -> list[int]:
    kept = []  # draws a rejected draft's replacement from p itself: p's mass where q also had it comes out twice
    for i, d in enumerate(draft_token_ids):
        if uniform[i] * draft_probs[i, d] < target_probs[i, d]:
            kept.append(d)
            continue
        return kept + [int((target_probs[i] / noise[i]).argmax())]
    k = len(draft_token_ids)
    return kept + [int((target_probs[k] / noise[k]).argmax())]


def verify_sampled_keeping_likelier_drafts(draft_token_ids: list[int], target_probs: torch.Tensor,
                                           draft_probs: torch.Tensor, uniform: torch.Tensor,
                                           noise: torch.Tensor) -> list[int]:
    kept = []  # keeps a draft only when the target likes it at least as much as the drafter (no uniform test)
    for i, d in enumerate(draft_token_ids):
        if draft_probs[i, d] <= target_probs[i, d]:
            kept.append(d)
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp_min(0)
        return kept + [int((residual / noise[i]).argmax())]
    k = len(draft_token_ids)
    return kept + [int((target_probs[k] / noise[k]).argmax())]


def tokens_per_verification(acceptance_rate: float, k: int) -> float:
    return sum(acceptance_rate ** i for i in range(k + 1))


def tokens_per_verification_independent(acceptance_rate: float, k: int) -> float:
    return 1 + acceptance_rate * k  # as if a rejected draft did not end the verification


# ------------------------------------------------------------------------------------------ lesson 15


def unpack_mask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    bits = torch.arange(32, dtype=torch.int32)
    allowed = (bitmask[:, :, None] >> bits) & 1  # (rows, words, 32)
    return allowed.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def unpack_mask_most_significant_bit_first(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    bits = 31 - torch.arange(32, dtype=torch.int32)
    allowed = (bitmask[:, :, None] >> bits) & 1
    return allowed.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def unpack_mask_without_the_sign_bit(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Reads 31 bits a word, as if bit 31 (the sign) could not hold a token."""
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> bits) & 1) * (bits < 31)
    return allowed.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def choice_mask(choices: list[str], text: bytes, vocab: list[bytes]) -> list[bool]:
    encoded = [choice.encode() for choice in choices]
    return [bool(token) and any(choice.startswith(text + token) for choice in encoded) for token in vocab]


def choice_mask_from_the_start(choices: list[str], text: bytes, vocab: list[bytes]) -> list[bool]:
    """Forgets what the output holds so far: a token is allowed if some choice starts with it."""
    return [bool(token) and any(choice.encode().startswith(token) for choice in choices) for token in vocab]


def choice_mask_first_byte_only(choices: list[str], text: bytes, vocab: list[bytes]) -> list[bool]:
    """Checks the token's first byte, as if a token were one character."""
    return [bool(token) and any(choice.encode().startswith(text + token[:1]) for choice in choices)
            for token in vocab]


def choice_mask_through_the_automaton(choices: list[str], text: bytes, vocab: list[bytes]) -> list[bool]:
    """Right answers through the lesson's automaton, which the task says to do without."""
    from llm_runtime.lessons.token_mask import CharacterDFA, token_mask

    dfa = CharacterDFA("|".join("".join(c if c.isalnum() or c == " " else "\\" + c for c in choice)
                                for choice in choices))
    return token_mask(dfa, dfa.walk(dfa.start, text), vocab).tolist()


def choice_mask_through_an_alias(choices: list[str], text: bytes, vocab: list[bytes]) -> list[bool]:
    """The automaton again, reached by names its code does not hold: caught running, not by its name."""
    import importlib

    lesson = importlib.import_module("llm_runtime.lessons." + "token" + "_mask")
    machine = getattr(lesson, "Character" + "DFA")("|".join("".join(c if c.isalnum() or c == " " else "\\" + c
                                                                 for c in choice) for choice in choices))
    def walk(state, data: bytes):
        for byte in data:
            state = state and machine.step(state, byte)
        return state

    state = walk(machine.start, text)
    return [bool(token) and bool(walk(state, token)) for token in vocab]


def forced_text(dfa, prefix: bytes) -> bytes:
    state, forced = dfa.walk(dfa.start, prefix), b""
    while state and not dfa.accepts(state):
        live = [byte for byte in range(256) if dfa.step(state, byte)]
        if len(live) != 1:
            break
        forced += bytes(live)
        state = dfa.step(state, live[0])
    return forced


def forced_text_past_a_match(dfa, prefix: bytes) -> bytes:
    """Goes on while one byte is possible, even where the text could already end."""
    state, forced = dfa.walk(dfa.start, prefix), b""
    while state:
        live = [byte for byte in range(256) if dfa.step(state, byte)]
        if len(live) != 1:
            break
        forced += bytes(live)
        state = dfa.step(state, live[0])
    return forced


def forced_text_one_byte(dfa, prefix: bytes) -> bytes:
    """Looks one byte ahead only."""
    state = dfa.walk(dfa.start, prefix)
    live = [byte for byte in range(256) if state and not dfa.accepts(state) and dfa.step(state, byte)]
    return bytes(live) if len(live) == 1 else b""


# ------------------------------------------------------------------------------------------ lesson 16


def blocked_sum(values: list[float], block: int) -> float:
    partials = []
    for start in range(0, len(values), block):
        total = np.float32(0.0)
        for value in values[start : start + block]:
            total = np.float32(total + np.float32(value))
        partials.append(total)
    total = np.float32(0.0)
    for partial in partials:
        total = np.float32(total + partial)
    return float(total)


def blocked_sum_in_float64(values: list[float], block: int) -> float:
    """Adds in Python floats and rounds to float32 only at the end."""
    partials = [sum(values[start : start + block]) for start in range(0, len(values), block)]
    return float(np.float32(sum(partials)))


def blocked_sum_ignoring_the_blocks(values: list[float], block: int) -> float:
    """One left-to-right float32 sum, whatever the block."""
    total = np.float32(0.0)
    for value in values:
        total = np.float32(total + np.float32(value))
    return float(total)


def rows_invariant(fn, x: torch.Tensor, chunk_sizes: tuple[int, ...]) -> bool:
    whole = fn(x)
    return all(torch.equal(torch.cat([fn(x[i : i + size]) for i in range(0, len(x), size)]), whole)
               for size in chunk_sizes)


def rows_invariant_to_rounding(fn, x: torch.Tensor, chunk_sizes: tuple[int, ...]) -> bool:
    """Compares with allclose: a difference in the last bits passes."""
    whole = fn(x)
    return all(torch.allclose(torch.cat([fn(x[i : i + size]) for i in range(0, len(x), size)]), whole)
               for size in chunk_sizes)


def rows_invariant_one_row_at_a_time_only(fn, x: torch.Tensor, chunk_sizes: tuple[int, ...]) -> bool:
    """Tries chunks of one row only, whatever chunk_sizes says."""
    return torch.equal(torch.cat([fn(x[i : i + 1]) for i in range(len(x))]), fn(x))


# ------------------------------------------------------------------------------------------ lesson 17


def parallel_product(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, size: int) -> list[torch.Tensor]:
    width = a.shape[1] // size
    return [x @ a[:, r * width : (r + 1) * width] @ b[r * width : (r + 1) * width] for r in range(size)]


def parallel_product_rows_of_a(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Cuts a by rows (and x by columns) instead: partial sums of x @ a, each times the whole b. They also sum to
    x @ a @ b, but every rank holds all of b, and the partials are not the ranks' column-then-row ones."""
    width = a.shape[0] // size if a.shape[0] % size == 0 else a.shape[0]
    parts = [x[:, r * width : (r + 1) * width] @ a[r * width : (r + 1) * width] @ b for r in range(a.shape[0] // width)]
    return parts + [torch.zeros_like(parts[0])] * (size - len(parts))


def parallel_product_interleaved(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Gives rank r every size-th column (r, r + size, ...): a valid split, but not the contiguous blocks."""
    return [x @ a[:, r::size] @ b[r::size] for r in range(size)]


def kv_heads_for_rank(num_heads: int, num_kv_heads: int, size: int, rank: int) -> list[int]:
    per_rank = num_heads // size
    group = num_heads // num_kv_heads
    return sorted({q // group for q in range(rank * per_rank, (rank + 1) * per_rank)})


def kv_heads_for_rank_round_robin(num_heads: int, num_kv_heads: int, size: int, rank: int) -> list[int]:
    """Deals the KV heads out like cards when there are too few: rank r gets head r mod num_kv_heads, which
    its query heads do not read."""
    if num_kv_heads >= size:
        per_rank = num_kv_heads // size
        return list(range(rank * per_rank, (rank + 1) * per_rank))
    return [rank % num_kv_heads]


def kv_heads_for_rank_split_like_the_queries(num_heads: int, num_kv_heads: int, size: int, rank: int) -> list[int]:
    """Cuts the KV heads in blocks of num_kv_heads // size, which is 0 heads when there are fewer than ranks."""
    per_rank = num_kv_heads // size
    return list(range(rank * per_rank, (rank + 1) * per_rank))


def _reduce_scatter(parts: list[torch.Tensor]) -> tuple[list[list[torch.Tensor]], list[int]]:
    """Every rank's chunks after the ring's reduce-scatter, and the values each rank sent in it."""
    n = len(parts)
    chunks = [list(p.clone().chunk(n)) for p in parts]
    sent = [0] * n
    for step in range(n - 1):
        messages = [(r, (r - step) % n, chunks[r][(r - step) % n].clone()) for r in range(n)]
        for r, c, values in messages:
            chunks[(r + 1) % n][c] = chunks[(r + 1) % n][c] + values
            sent[r] += values.numel()
    return chunks, sent


def ring_all_reduce(parts: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    n = len(parts)
    chunks, sent = _reduce_scatter(parts)
    for step in range(n - 1):
        messages = [(r, (r + 1 - step) % n, chunks[r][(r + 1 - step) % n].clone()) for r in range(n)]
        for r, c, values in messages:
            chunks[(r + 1) % n][c] = values
            sent[r] += values.numel()
    return [torch.cat(c) for c in chunks], sent


def ring_all_reduce_reduce_scatter_only(parts: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """Stops after the reduce-scatter: each rank holds one finished chunk and partial sums elsewhere."""
    chunks, sent = _reduce_scatter(parts)
    return [torch.cat(c) for c in chunks], sent


def ring_all_reduce_summed_at_once(parts: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """Every rank gets sum(parts) and the ring's counts, with no ring simulated (right on integers)."""
    n = len(parts)
    return [sum(parts) for _ in range(n)], [2 * (n - 1) * parts[0].numel() // n] * n


def ring_all_reduce_whole_tensors(parts: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """Passes whole tensors round the ring (n - 1 hops each way): the right sums, at n / 2 times the traffic."""
    n = len(parts)
    total = sum(p.clone() for p in parts)
    return [total.clone() for _ in range(n)], [2 * (n - 1) * parts[0].numel()] * n


# ------------------------------------------------------------------------------------------ lesson 18


def shipped_kv_bytes(prompt_len: int, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                     bytes_per_value: float) -> int:
    whole_blocks = (prompt_len - 1) // block_size
    return int(whole_blocks * block_size * 2 * num_layers * num_kv_heads * head_dim * bytes_per_value)


def shipped_kv_bytes_every_token(prompt_len: int, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                                 bytes_per_value: float) -> int:
    """Ships the whole prompt, partial last block and last token included."""
    return int(prompt_len * 2 * num_layers * num_kv_heads * head_dim * bytes_per_value)


def shipped_kv_bytes_keys_only(prompt_len: int, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                               bytes_per_value: float) -> int:
    """Forgets the values: half the bytes."""
    return int((prompt_len - 1) // block_size * block_size * num_layers * num_kv_heads * head_dim * bytes_per_value)


def goodput_under_targets(timings: list, duration_s: float, ttft_s: float, tpot_s: float) -> float:
    met = sum(t.ttft <= ttft_s and (t.tpot is None or t.tpot <= tpot_s) for t in timings)
    return met / duration_s


def goodput_under_targets_dropping_single_tokens(timings: list, duration_s: float, ttft_s: float, tpot_s: float) -> float:
    """Counts a request of one token (no TPOT) as missing the TPOT target."""
    return sum(t.ttft <= ttft_s and t.tpot is not None and t.tpot <= tpot_s for t in timings) / duration_s


def goodput_under_targets_by_mean_itl_of_all(timings: list, duration_s: float, ttft_s: float, tpot_s: float) -> float:
    """Judges TPOT by the run's mean inter-token latency instead of each request's own."""
    gaps = [g for t in timings for g in t.itls]
    mean = sum(gaps) / len(gaps) if gaps else 0.0
    return sum(t.ttft <= ttft_s and mean <= tpot_s for t in timings) / duration_s


def _prefix_matches(hashes: list, remembered: list) -> list[int]:
    """Per replica, how many of the prompt's hashes it saw from the first, without a gap."""
    matches = []
    for seen in remembered:
        count = 0
        while count < len(hashes) and hashes[count] in seen:
            count += 1
        matches.append(count)
    return matches


def cache_aware_choice(hashes: list, remembered: list, in_flight: list, min_match: float) -> int:
    least = min(range(len(in_flight)), key=lambda i: in_flight[i])
    matches = _prefix_matches(hashes, remembered)
    best = max(range(len(matches)), key=lambda i: (matches[i], -i))
    return best if matches[best] > 0 and matches[best] >= min_match * len(hashes) else least


def cache_aware_choice_counting_any_hash(hashes: list, remembered: list, in_flight: list, min_match: float) -> int:
    """Counts every hash a replica saw, gaps or not: a chunk seen after a different one is not a cached prefix."""
    least = min(range(len(in_flight)), key=lambda i: in_flight[i])
    matches = [sum(h in seen for h in hashes) for seen in remembered]
    best = max(range(len(matches)), key=lambda i: (matches[i], -i))
    return best if matches[best] > 0 and matches[best] >= min_match * len(hashes) else least


def cache_aware_choice_always_the_best_match(hashes: list, remembered: list, in_flight: list,
                                             min_match: float) -> int:
    """Ignores min_match: a replica that saw one chunk of a long prompt wins over an idle one."""
    matches = _prefix_matches(hashes, remembered)
    if not hashes or max(matches) == 0:
        return min(range(len(in_flight)), key=lambda i: in_flight[i])
    return max(range(len(matches)), key=lambda i: (matches[i], -i))


# ---------------------------------------------------------------------------------------------------- lesson 19
def silu_and_mul_bf16(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g = gate.float()
    activated = (g / (1 + torch.exp(-g))).to(torch.bfloat16)  # silu's output is a bfloat16 tensor
    return (activated.float() * up.float()).to(torch.bfloat16)


def silu_and_mul_bf16_rounded_once(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g = gate.float()
    return (g / (1 + torch.exp(-g)) * up.float()).to(torch.bfloat16)  # a fused loop's rounding, not eager's


def silu_and_mul_bf16_float32(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g = gate.float()
    return g / (1 + torch.exp(-g)) * up.float()  # never rounded back


def silu_and_mul_bf16_the_eager_expression(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The very expression the exercise asks to replace: right bits, bfloat16 arithmetic."""
    return torch.nn.functional.silu(gate) * up


def half_block_rows(item: int) -> list[int]:
    block, half = divmod(item, 2)
    first = 64 * block + 16 * half
    return list(range(first, first + 16)) + list(range(first + 32, first + 48))


def half_block_rows_contiguous(item: int) -> list[int]:
    return list(range(32 * item, 32 * item + 32))


def half_block_rows_low_nibbles_only(item: int) -> list[int]:
    block, half = divmod(item, 2)
    return list(range(64 * block + 32 * half, 64 * block + 32 * half + 32))


def static_schedule(num_items: int, num_threads: int) -> list[range]:
    base, extra = divmod(num_items, num_threads)
    starts = [t * base + min(t, extra) for t in range(num_threads + 1)]
    return [range(starts[t], starts[t + 1]) for t in range(num_threads)]


def static_schedule_ceil_chunks(num_items: int, num_threads: int) -> list[range]:
    chunk = -(-num_items // num_threads)
    return [range(min(t * chunk, num_items), min((t + 1) * chunk, num_items)) for t in range(num_threads)]


def static_schedule_round_robin(num_items: int, num_threads: int) -> list[list[int]]:
    return [list(range(t, num_items, num_threads)) for t in range(num_threads)]


SOLUTIONS: dict[str, Callable] = {
    "lesson01.rms_norm": rms_norm,
    "lesson01.kv_bytes_per_token": kv_bytes_per_token,
    "lesson01.gqa_attention": gqa_attention,
    "lesson02.top_p_filter": top_p_filter,
    "lesson02.top_k_filter": top_k_filter,
    "lesson02.apply_penalties": apply_penalties,
    "lesson03.stop_text": stop_text,
    "lesson03.stream_deltas": stream_deltas,
    "lesson04.static_token_steps": static_token_steps,
    "lesson04.wasted_slots": wasted_slots,
    "lesson05.flatten_ragged": flatten_ragged,
    "lesson05.prefill_chunks": prefill_chunks,
    "lesson06.pool_blocks": pool_blocks,
    "lesson06.refusal": refusal,
    "lesson07.slot_mapping": slot_mapping,
    "lesson07.block_to_copy": block_to_copy,
    "lesson08.num_cached_tokens": num_cached_tokens,
    "lesson08.hit_rate": hit_rate,
    "lesson09.request_latencies": request_latencies,
    "lesson09.goodput": goodput,
    "lesson09.latency_percentile": latency_percentile,
    "lesson10.parse_chat_stream": parse_chat_stream,
    "lesson10.is_busy": is_busy,
    "lesson11.merge_attention": merge_attention,
    "lesson11.paged_decode": paged_decode,
    "lesson12.slot_mappings": slot_mappings,
    "lesson12.fused_qkv": fused_qkv,
    "lesson13.quantize_groups": quantize_groups,
    "lesson13.read_q4_1_block": read_q4_1_block,
    "lesson13.quantize_kv_int8": quantize_kv_int8,
    "lesson14.propose": propose,
    "lesson14.verify_sampled": verify_sampled,
    "lesson14.tokens_per_verification": tokens_per_verification,
    "lesson15.unpack_mask": unpack_mask,
    "lesson15.choice_mask": choice_mask,
    "lesson15.forced_text": forced_text,
    "lesson16.blocked_sum": blocked_sum,
    "lesson16.rows_invariant": rows_invariant,
    "lesson17.parallel_product": parallel_product,
    "lesson17.kv_heads_for_rank": kv_heads_for_rank,
    "lesson17.ring_all_reduce": ring_all_reduce,
    "lesson18.shipped_kv_bytes": shipped_kv_bytes,
    "lesson18.goodput": goodput_under_targets,
    "lesson18.cache_aware_choice": cache_aware_choice,
    "lesson19.silu_and_mul_bf16": silu_and_mul_bf16,
    "lesson19.half_block_rows": half_block_rows,
    "lesson19.static_schedule": static_schedule,
}

WRONG: dict[str, list[Callable]] = {
    "lesson01.rms_norm": [rms_norm_eps_outside_the_root, rms_norm_centred],
    "lesson01.kv_bytes_per_token": [kv_bytes_per_token_of_query_heads, kv_bytes_per_token_from_hidden_size],
    "lesson01.gqa_attention": [gqa_attention_tiled_heads, gqa_attention_mask_from_the_top_left],
    "lesson02.top_p_filter": [top_p_filter_one_token_too_few],
    "lesson02.top_k_filter": [top_k_filter_dropping_ties],
    "lesson02.apply_penalties": [apply_penalties_always_dividing, apply_penalties_counting_the_prompt],
    "lesson03.stop_text": [stop_text_searching_each_piece],
    "lesson03.stream_deltas": [stream_deltas_holding_one_too_many, stream_deltas_holding_nothing],
    "lesson04.static_token_steps": [static_token_steps_unpadded_budget],
    "lesson04.wasted_slots": [wasted_slots_against_the_longest_request_of_all],
    "lesson05.flatten_ragged": [flatten_ragged_every_segment_samples, flatten_ragged_positions_from_zero],
    "lesson05.prefill_chunks": [prefill_chunks_ignoring_the_decodes],
    "lesson06.pool_blocks": [pool_blocks_without_the_cap, pool_blocks_ignoring_what_is_held,
                             pool_blocks_in_tokens_not_blocks],
    "lesson06.refusal": [refusal_counting_prompt_blocks_only],
    "lesson07.slot_mapping": [slot_mapping_block_not_scaled],
    "lesson07.block_to_copy": [block_to_copy_last_block],
    "lesson08.num_cached_tokens": [num_cached_tokens_whole_prompt, num_cached_tokens_common_prefix],
    "lesson08.hit_rate": [hit_rate_by_common_prefix],
    "lesson09.request_latencies": [request_latencies_tpot_over_all_tokens],
    "lesson09.goodput": [goodput_strictly_below],
    "lesson09.latency_percentile": [latency_percentile_nearest_rank],
    "lesson10.parse_chat_stream": [parse_chat_stream_first_choice_only, parse_chat_stream_searching_for_done],
    "lesson10.is_busy": [is_busy_when_full, is_busy_ignoring_the_burst],
    "lesson11.merge_attention": [merge_attention_equal_weights, merge_attention_without_the_max],
    "lesson11.paged_decode": [paged_decode_without_rescaling, paged_decode_whole_last_block,
                              paged_decode_gathering_the_history, paged_decode_joining_block_copies],
    "lesson12.slot_mappings": [slot_mappings_ignoring_the_start, slot_mappings_offset_by_block_index,
                               slot_mappings_a_loop_per_token, slot_mappings_a_tensor_per_token,
                               slot_mappings_one_tensor_at_the_end],
    "lesson12.fused_qkv": [fused_qkv_split_in_thirds, fused_qkv_three_multiplies,
                           fused_qkv_one_multiply_and_sums],
    "lesson13.quantize_groups": [quantize_groups_per_row, quantize_groups_symmetric],
    "lesson13.read_q4_1_block": [read_q4_1_block_interleaved],
    "lesson13.quantize_kv_int8": [quantize_kv_int8_per_tensor, quantize_kv_int8_truncated],
    "lesson14.propose": [propose_most_recent_occurrence, propose_shortest_match_first],
    "lesson14.verify_sampled": [verify_sampled_replacing_from_p, verify_sampled_keeping_likelier_drafts],
    "lesson14.tokens_per_verification": [tokens_per_verification_independent],
    "lesson15.unpack_mask": [unpack_mask_most_significant_bit_first, unpack_mask_without_the_sign_bit],
    "lesson15.choice_mask": [choice_mask_from_the_start, choice_mask_first_byte_only,
                             choice_mask_through_the_automaton, choice_mask_through_an_alias],
    "lesson15.forced_text": [forced_text_past_a_match, forced_text_one_byte],
    "lesson16.blocked_sum": [blocked_sum_in_float64, blocked_sum_ignoring_the_blocks],
    "lesson16.rows_invariant": [rows_invariant_to_rounding, rows_invariant_one_row_at_a_time_only],
    "lesson17.parallel_product": [parallel_product_rows_of_a, parallel_product_interleaved],
    "lesson17.kv_heads_for_rank": [kv_heads_for_rank_round_robin, kv_heads_for_rank_split_like_the_queries],
    "lesson17.ring_all_reduce": [ring_all_reduce_reduce_scatter_only, ring_all_reduce_whole_tensors,
                                 ring_all_reduce_summed_at_once],
    "lesson18.shipped_kv_bytes": [shipped_kv_bytes_every_token, shipped_kv_bytes_keys_only],
    "lesson18.goodput": [goodput_under_targets_dropping_single_tokens, goodput_under_targets_by_mean_itl_of_all],
    "lesson18.cache_aware_choice": [cache_aware_choice_counting_any_hash, cache_aware_choice_always_the_best_match],
    "lesson19.silu_and_mul_bf16": [silu_and_mul_bf16_rounded_once, silu_and_mul_bf16_float32,
                                   silu_and_mul_bf16_the_eager_expression],
    "lesson19.half_block_rows": [half_block_rows_contiguous, half_block_rows_low_nibbles_only],
    "lesson19.static_schedule": [static_schedule_ceil_chunks, static_schedule_round_robin],
}
