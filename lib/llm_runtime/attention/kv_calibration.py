"""The ranges of a model's keys and values, measured once, for an int8 KV pool's scales (kv_quant.py).

An int8 pool stores every key and value element in one byte, with a scale and a zero per layer, KV
head and channel that do not change once the engine runs. So they must cover what the model will
write, and no more than that (a wider range is a coarser step). `calibrate_kv_scales` runs the model
over a text shipped with the package (`data/kv_calibration.txt`: prose, a dialogue, code, a table, a
letter, three languages; not the text quality is measured on) in windows, watches every layer's keys
and values on their way into the cache (`KVRangeObserver`, a `KVCache` that only looks), and takes
each channel's lowest and highest value, widened by `headroom` about its middle; at generation, an
element beyond it is clamped.

Two things about what the model writes shape the scales:

- Keys are measured, and stored, turned back by the rotary embedding (`KeyTurns`): as the model
  computed them before it turned each pair of channels by an angle that grows with the position.
  Turned, a slow pair's range would depend on how far into the context the key sits, and a range
  for every position is as wide as a full turn; turned back, it is the same at every position, so
  the windows all start at position 0 and the scales hold for any context.
- The first token of a sequence is where the model parks the attention it does not need (an
  attention sink): in the bundled model's later layers 30-70 % of a query's weight (lesson 13), so its
  value comes through into every output. From the middle layers on its value vector is nearly the
  same whatever the token, and small beside the others'. So each channel's steps are moved (by less
  than half a step) to put the mean first-token value on one of them exactly (`ChannelScale.placing`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .causal import causal_attention
from .kv_quant import ChannelScale, KeyTurns, KVScales

if TYPE_CHECKING:  # the model package imports attention: only the type checker needs these here
    from ..model import CausalLM
    from ..model.tokenizer import Tokenizer

CALIBRATION_TEXT = Path(__file__).with_name("data") / "kv_calibration.txt"
WINDOW = 256  # tokens the model sees at once
HEADROOM = 1.25  # each channel's range widened by a quarter about its middle
NUM_RANDOM_TOKENS = 1024  # without a tokenizer: this many token ids drawn from a seeded generator


class KVRangeObserver:
    """A `KVCache` that keeps nothing: each layer's lowest and highest key (turned back by `turns`) and value
    per KV head and channel over every token it is shown, and the mean value of the windows' first tokens;
    then plain causal attention over this forward's tokens, each window at positions 0 .. T - 1."""

    def __init__(self, num_layers: int, turns: KeyTurns) -> None:
        self.turns = turns
        self.key_low: list[torch.Tensor | None] = [None] * num_layers  # (KV, d) float32 each
        self.key_high: list[torch.Tensor | None] = [None] * num_layers
        self.value_low: list[torch.Tensor | None] = [None] * num_layers
        self.value_high: list[torch.Tensor | None] = [None] * num_layers
        self.first_values: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]  # (B, KV, d) each

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, H, T, d), k, v (B, KV, T, d) at positions 0 .. T - 1 -> (B, H, T, d), after noting k's
        (turned back) and v's ranges."""
        positions = torch.arange(k.shape[2], device=k.device)  # (T,)
        turned_back = self.turns.turn(k.transpose(1, 2), positions, back=True).transpose(1, 2)  # (B, KV, T, d)
        self.first_values[layer_idx].append(v[:, :, 0].float())
        for lows, highs, x in ((self.key_low, self.key_high, turned_back), (self.value_low, self.value_high, v)):
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
        values = tuple(ChannelScale.spanning(low, high, headroom).placing(torch.cat(first).mean(0))
                       for low, high, first in zip(self.value_low, self.value_high, self.first_values))
        return KVScales(keys, values)  # type: ignore[arg-type]


def calibration_token_ids(tokenizer: Tokenizer | None, vocab_size: int) -> list[int]:
    """The calibration text in the model's tokens; without a tokenizer, token ids from a seeded generator."""
    if tokenizer is not None:
        return list(tokenizer.encode(CALIBRATION_TEXT.read_text()))
    generator = torch.Generator().manual_seed(0)
    return torch.randint(vocab_size, (NUM_RANDOM_TOKENS,), generator=generator).tolist()


@torch.inference_mode()
def observe_kv_ranges(model: CausalLM, token_ids: list[int], *, window: int = WINDOW) -> KVRangeObserver:
    """`model` run over `token_ids` in windows of `window` tokens, each at positions 0 .. window - 1, and what
    an observer saw of its keys (turned back) and values."""
    if not token_ids:
        raise ValueError("calibration needs at least one token")
    observer = KVRangeObserver(model.config.num_layers,
                               KeyTurns.of(model.config.rope, model.config.head_dim, model.device))
    for start in range(0, len(token_ids), window):
        chunk = token_ids[start : start + window]
        input_ids = torch.tensor([chunk], device=model.device)  # (1, T)
        model(input_ids, observer, torch.arange(len(chunk), device=model.device)[None])
    return observer


def calibrate_kv_scales(model: CausalLM, token_ids: list[int], *, headroom: float = HEADROOM,
                        window: int = WINDOW) -> KVScales:
    """The scales of an int8 pool for `model`: its keys' (turned back) and values' ranges over `token_ids`
    (`observe_kv_ranges`), widened by `headroom`, the values' steps placed on the first tokens' value."""
    return observe_kv_ranges(model, token_ids, window=window).scales(headroom)
