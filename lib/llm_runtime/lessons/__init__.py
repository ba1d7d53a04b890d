"""Helpers only the lessons use: baselines and hand-built pieces the engine itself has outgrown.

`StaticBatchRunner` is the padded, run-to-completion baseline of lessons 04 and 05;
`RaggedKVBatch` is lesson 05's ragged batch over one contiguous cache per sequence.
"""

from .ragged_batch import RaggedKVBatch
from .static_batching import StaticBatchRunner

__all__ = ["RaggedKVBatch", "StaticBatchRunner"]
