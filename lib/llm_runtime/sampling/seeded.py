"""A seeded request's randomness as a function of (seed, draw, token): noise for all seeded rows at once.

A seeded request must draw the same noise whatever else is in its batch. One `torch.Generator` per
request does that, but then every seeded row is its own call (its own kernel launch on a GPU): a Python
loop over the seeded rows of every step. Counter-based generators (Philox in cuRAND, JAX's keys)
turn it around: a random number is a fixed scrambling of its coordinates. Here the coordinates are
the request's seed, which draw of the request this is (one per sampled token) and the token id; the
scrambling is a 32-bit integer hash applied elementwise to a (rows, vocab) grid, so one batch of tensor
operations draws for every seeded row together. On the 2-core CI CPU, 64 rows of 49,152 took 34 ms
hashed against 60 ms for one `exponential_` per row (with freed memory kept, as engines run:
`worker/host_memory.py`); on a GPU the loop is also a kernel launch per seeded row.

The hash is `lowbias32` (Chris Wellons' hash-prospector: two multiplies, three xor-shifts; every output
bit depends on every input bit). It runs in int64 tensors holding 32-bit values, and multiplies by
16-bit halves so that no product overflows int64 (overflow is undefined behaviour in C++). 24 bits of the
hash make a uniform u in (0, 1), and -log(u) an Exp(1) draw: the sampler's exponential race needs
nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_MASK = 0xFFFFFFFF


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """x * constant mod 2^32 for x in [0, 2^32), without an int64 overflow: by the constant's 16-bit halves."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _MASK


def hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32, elementwise, on int64 tensors holding values in [0, 2^32); a bijection of 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def exponential_noise(seeds: torch.Tensor, draws: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise (R, vocab_size) float32: row r from seed seeds[r] (R,) at draw draws[r] (R,), int64."""
    seeds, draws = seeds[:, None], draws[:, None]  # (R, 1)
    # Constants keep 0 from being special (the hash maps 0 to 0): seed 0's first draw is like any other.
    row = hash32(hash32((seeds & _MASK) ^ 0x9E3779B9) ^ ((seeds >> 32) & _MASK))  # the whole 64-bit seed
    row = hash32(row ^ (draws & _MASK) ^ 0x85EBCA6B)  # (R, 1): one key per (seed, draw)
    tokens = hash32(torch.arange(vocab_size, dtype=torch.int64, device=seeds.device) ^ 0xC2B2AE35)  # (V,)
    bits = hash32(row ^ tokens)  # (R, V): one round over the grid, of two keys that are hashes already
    uniform = ((bits >> 8).float() + 0.5) * 2.0**-24  # (R, V), strictly inside (0, 1)
    return -uniform.log()


class SeededGenerator:
    """A seeded request's generator: its seed and how many draws it has made (one per sampled token).

    `Sampler` draws for all the seeded rows of a batch at once (`exponential_noise`) and advances each
    row's generator by one. The same seed gives the same draws, alone or in any batch.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.draws = 0

    def __repr__(self) -> str:
        return f"SeededGenerator(seed={self.seed}, draws={self.draws})"


def seeded_noise(generators: Sequence[SeededGenerator], vocab_size: int, device: torch.device) -> torch.Tensor:
    """The next draw of each generator, (len(generators), vocab_size); advances each by one."""
    keys = torch.tensor([(g.seed, g.draws) for g in generators], dtype=torch.int64).to(device)  # (R, 2), one copy
    for generator in generators:
        generator.draws += 1
    return exponential_noise(keys[:, 0], keys[:, 1], vocab_size)
