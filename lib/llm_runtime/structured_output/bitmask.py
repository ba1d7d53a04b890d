"""Token bitmasks and their application to logits (lesson 15).

A mask over a vocabulary of V tokens is ceil(V / 32) int32 words: bit t % 32 of word t // 32 is set when
token t may come next (xgrammar's layout, 6 KB a row for a 49,152-token vocabulary instead of 48 KB of
bools). Applying it sets every refused token's logit to -inf before penalties, temperature and the
filters, so the distribution a constrained row samples from is the model's, renormalised over the tokens
the grammar allows. Only the constrained rows are touched: an unconstrained batch never comes here.
"""

from __future__ import annotations

import math

import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(R, W) int32 words -> (R, vocab_size) bool, True where the token is allowed."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = (bitmask[:, :, None] >> bits) & 1  # (R, W, 32): bit b of word w is token 32 w + b
    return allowed.view(bitmask.shape[0], -1)[:, :vocab_size].bool()  # (R, 32 W) -> (R, V)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits (B, V) with rows[i] masked by bitmask[i] (refused tokens at -inf), in place; returns `logits`. Only
    the constrained rows are touched: a run of consecutive rows (one constrained request, or all of them) is masked
    where it lies, without a copy; scattered rows through one gathered copy of those rows alone, never of the whole
    (B, V). (The input may be a CUDA graph's output buffer: its next replay writes it anew.)"""
    if not rows:
        return logits
    # A caller on CUDA passes a mask in pinned host memory (`allocate_bitmask(..., pin_memory=True)`), and both
    # copies then come from pinned memory, queued behind the forward pass without waiting for it: a copy from
    # pageable memory would block the host until the stream is done, and the time the mask work hides behind
    # would be lost (the step profile would also charge it to the grammar). Any mask gives the same logits.
    pinned = bitmask.is_pinned()
    refused = ~unpack_bitmask(bitmask.to(logits.device, non_blocking=True), logits.shape[1])  # (R, V)
    first = rows[0]
    if rows == list(range(first, first + len(rows))):
        logits[first : first + len(rows)].masked_fill_(refused, -math.inf)
        return logits
    index = torch.tensor(rows, pin_memory=pinned).to(logits.device, non_blocking=True)
    return logits.index_put_((index,), logits.index_select(0, index).masked_fill_(refused, -math.inf))
