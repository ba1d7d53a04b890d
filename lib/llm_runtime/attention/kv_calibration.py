"""The ranges of a model's keys and values, measured once, for an int8 KV pool's scales (kv_quant.py).

An int8 pool stores every key and value element in one byte, with a scale and a zero per layer, KV
head and channel that do not change once the engine runs. So they must cover what the model will
write, and no more than that (a wider range is a coarser step). `calibrate_kv_scales` runs the model
over a text shipped with the package (`data/kv_calibration.txt`: prose, a dialogue, code, a table, a
letter, three languages; not the text quality is measured on), watches every layer's keys and values
on their way into the cache (`KVRangeObserver`, a `KVCache` that only looks), and takes each channel's
lowest and highest value, widened by `headroom` about its middle; at generation, an element beyond it
is clamped.

Keys are stored after the rotary embedding, which turns each pair of channels by an angle that grows
with the position: a slow pair barely turns in the first hundred tokens and fully in the last
thousand. A text run at positions 0 .. 255 alone would leave those channels' ranges short for long
contexts. So the text is cut into windows placed across the positions the engine serves, the first at
0 and the last ending at `max_position`: the same tokens, seen turned by the angles of every part of
the context. A longer context costs some precision: lesson 13 measures it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .causal import causal_attention
from .kv_quant import ChannelScale, KVScales

if TYPE_CHECKING:  # the model package imports attention: only the type checker needs these here
    from ..model import CausalLM
    from ..model.tokenizer import Tokenizer

CALIBRATION_TEXT = Path(__file__).with_name("data") / "kv_calibration.txt"
WINDOW = 256  # tokens the model sees at once
HEADROOM = 1.25  # each channel's range widened by a quarter about its middle
NUM_RANDOM_TOKENS = 1024  # without a tokenizer: this many token ids drawn from a seeded generator


class KVRangeObserver:
    """A `KVCache` that keeps nothing: each layer's lowest and highest key and value per KV head and
    channel, over every token it is shown, then plain causal attention over this forward's tokens."""

    def __init__(self, num_layers: int) -> None:
        self.key_low: list[torch.Tensor | None] = [None] * num_layers  # (KV, d) float32 each
        self.key_high: list[torch.Tensor | None] = [None] * num_layers
        self.value_low: list[torch.Tensor | None] = [None] * num_layers
        self.value_high: list[torch.Tensor | None] = [None] * num_layers

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, H, T, d), k, v (B, KV, T, d) -> (B, H, T, d), after noting k's and v's ranges."""
        for lows, highs, x in ((self.key_low, self.key_high, k), (self.value_low, self.value_high, v)):
            low, high = x.float().amin(dim=(0, 2)), x.float().amax(dim=(0, 2))  # (KV, d)
            seen_low, seen_high = lows[layer_idx], highs[layer_idx]
            lows[layer_idx] = low if seen_low is None else torch.minimum(seen_low, low)
            highs[layer_idx] = high if seen_high is None else torch.maximum(seen_high, high)
        return causal_attention(q, k, v, num_cached=0)

    def advance(self, num_new_tokens: int) -> None:
        pass

    def scales(self, headroom: float = HEADROOM) -> KVScales:
        if any(x is None for x in self.key_low):
            raise ValueError("the observer has seen no tokens")
        keys = tuple(ChannelScale.spanning(low, high, headroom) for low, high in zip(self.key_low, self.key_high))
        values = tuple(ChannelScale.spanning(low, high, headroom)
                       for low, high in zip(self.value_low, self.value_high))
        return KVScales(keys, values)  # type: ignore[arg-type]


def calibration_token_ids(tokenizer: Tokenizer | None, vocab_size: int) -> list[int]:
    """The calibration text in the model's tokens; without a tokenizer, token ids from a seeded generator."""
    if tokenizer is not None:
        return list(tokenizer.encode(CALIBRATION_TEXT.read_text()))
    generator = torch.Generator().manual_seed(0)
    return torch.randint(vocab_size, (NUM_RANDOM_TOKENS,), generator=generator).tolist()


def window_starts(num_windows: int, max_position: int, window: int = WINDOW) -> list[int]:
    """Where each window's first token sits: spread evenly, the first at 0, the last ending at max_position."""
    room = max(max_position - window, 0)
    return [room * w // max(num_windows - 1, 1) for w in range(num_windows)]


@torch.inference_mode()
def calibrate_kv_scales(model: CausalLM, token_ids: list[int], *, max_position: int | None = None,
                        headroom: float = HEADROOM, window: int = WINDOW) -> KVScales:
    """The scales of an int8 pool for `model`: its keys' and values' ranges over `token_ids`, run in windows
    of `window` tokens placed across positions 0 .. `max_position` (default: the model's positions)."""
    if not token_ids:
        raise ValueError("calibration needs at least one token")
    max_position = max_position or model.config.max_position_embeddings
    window = min(window, max_position)
    observer = KVRangeObserver(model.config.num_layers)
    chunks = [token_ids[i : i + window] for i in range(0, len(token_ids), window)]
    for chunk, start in zip(chunks, window_starts(len(chunks), max_position, window)):
        input_ids = torch.tensor([chunk], device=model.device)  # (1, T)
        positions = torch.arange(start, start + len(chunk), device=model.device)[None]  # (1, T)
        model(input_ids, observer, positions)
    return observer.scales(headroom)
