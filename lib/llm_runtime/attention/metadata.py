"""What every attention layer needs to know about one step's ragged batch, built once per step.

The model runner concatenates the new tokens of every scheduled sequence into one flat batch of N
tokens. Each layer then has to (1) write the new keys and values into the paged pool and (2) let
each sequence's queries attend over that sequence's own history. Both only need the batch's
*shape*, which is the same in all layers: where each sequence's queries start, how many keys each
sequence has, where its blocks are and which flat slot each new token goes to. `AttentionMetadata`
holds exactly that, on the device (for kernels) and on the host (for code that loops in Python),
as vLLM's `CommonAttentionMetadata` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's ragged batch of B sequences and N = sum of query lengths new tokens.

    Sequence b owns rows query_start_loc[b] .. query_start_loc[b + 1] - 1 of the flat batch; they
    sit at positions seq_lens[b] - query_lens[b] .. seq_lens[b] - 1 of the sequence, so they see
    the sequence's first seq_lens[b] keys, causally. Token t of sequence b lives in pool block
    block_tables[b, t // block_size]; rows of `block_tables` past a sequence's own blocks hold 0
    (any valid block: readers stop at seq_lens). A slot of -1 in `slot_mapping` writes nowhere.
    """

    block_size: int
    query_start_loc: torch.Tensor  # (B + 1,) int32, 0 first, N last
    seq_lens: torch.Tensor  # (B,) int32: keys each sequence attends to, this step's tokens included
    block_tables: torch.Tensor  # (B, max_num_blocks) int32
    slot_mapping: torch.Tensor  # (N,) int64: flat pool slot (block * block_size + offset) of each new token
    query_lens_host: tuple[int, ...]  # the same shapes on the host, for Python-side planning
    seq_lens_host: tuple[int, ...]
    block_tables_host: tuple[tuple[int, ...], ...]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_host, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host, default=0)

    @property
    def decode_rows(self) -> list[int]:
        """Sequences with one new token (decodes); the others are prefill chunks."""
        return [b for b, count in enumerate(self.query_lens_host) if count == 1]

    @property
    def context_lens_host(self) -> tuple[int, ...]:
        """Keys each sequence had before this step (its cached prefix)."""
        return tuple(s - q for s, q in zip(self.seq_lens_host, self.query_lens_host))

    def token_positions(self) -> torch.Tensor:
        """(N,) int64 on the metadata's device: each new token's position in its sequence (rows past the
        sequences' tokens, padding, at 0)."""
        query_lens = torch.tensor(self.query_lens_host, dtype=torch.long)  # (B,)
        seq_of_row = torch.repeat_interleave(torch.arange(len(query_lens)), query_lens)  # (sum of query_lens,)
        starts = torch.tensor(self.context_lens_host, dtype=torch.long)  # (B,) each sequence's first new position
        first_rows = torch.cumsum(query_lens, 0) - query_lens  # (B,)
        positions = torch.arange(len(seq_of_row)) - first_rows[seq_of_row] + starts[seq_of_row]
        padding = self.num_tokens - len(seq_of_row)
        if padding > 0:
            positions = torch.cat((positions, torch.zeros(padding, dtype=torch.long)))
        return positions.to(self.slot_mapping.device)

    def block_starts(self) -> dict[int, int]:
        """Each block of the step's tables -> the position of its first token (column j holds positions
        j * block_size onwards; a block shared by several sequences sits in the same column of each)."""
        return {block: j * self.block_size for table in self.block_tables_host for j, block in enumerate(table)}

    @classmethod
    def build(
        cls,
        block_tables: Sequence[Sequence[int]],
        starts: Sequence[int],
        num_new_tokens: Sequence[int],
        *,
        block_size: int,
        device: torch.device | str,
    ) -> "AttentionMetadata":
        """From the scheduler's view (each sequence's blocks, first new position and new-token count)."""
        if not len(block_tables) == len(starts) == len(num_new_tokens):
            raise ValueError("block_tables, starts and num_new_tokens must have one entry per sequence")
        seq_lens = [start + count for start, count in zip(starts, num_new_tokens)]
        for table, length in zip(block_tables, seq_lens):
            if len(table) * block_size < length:
                raise ValueError(f"a block table of {len(table)} blocks cannot hold {length} tokens")
        width = max((len(t) for t in block_tables), default=0)
        padded = [list(t) + [0] * (width - len(t)) for t in block_tables]
        offsets = [0]
        for count in num_new_tokens:
            offsets.append(offsets[-1] + count)
        table = torch.tensor(padded, dtype=torch.int32).reshape(len(block_tables), width)  # (B, max_num_blocks)
        # Every new token's slot, vectorized: position p of sequence b -> table[b, p // bs] * bs + p % bs.
        sequence_of_token = torch.repeat_interleave(torch.arange(len(starts)), torch.tensor(num_new_tokens, dtype=torch.long))
        positions = torch.arange(offsets[-1]) - torch.tensor(offsets[:-1], dtype=torch.long)[sequence_of_token]
        positions += torch.tensor(starts, dtype=torch.long)[sequence_of_token]  # (N,) position in its sequence
        blocks = table[sequence_of_token, positions // block_size].long() if offsets[-1] else positions
        slot_mapping = blocks * block_size + positions % block_size  # (N,)
        return cls(
            block_size=block_size,
            query_start_loc=torch.tensor(offsets, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=table.to(device),
            slot_mapping=slot_mapping.to(device),
            query_lens_host=tuple(num_new_tokens),
            seq_lens_host=tuple(seq_lens),
            block_tables_host=tuple(tuple(t) for t in block_tables),
        )
