"""Helpers only the lessons use: baselines and hand-built pieces the engine itself has outgrown.

`StaticBatchRunner` is the padded, run-to-completion baseline of lessons 04 and 05;
`RaggedKVBatch` is lesson 05's ragged batch over one contiguous cache per sequence;
`comparable_model` and `assert_same_tokens` state once where token-equality asserts hold (`equality.py`);
`runs_here` is how a lesson skips a part its device cannot run, `workload_size` how it sizes a timed load
for a CPU playing a GPU, `timed_on_the_device` whether its timings are its device's (`device_rules.py`);
`invariance.py` holds lesson 16's sum in blocks and probe for batch invariance;
`tensor_parallel.py` and `disaggregation.py` hold lesson 17's and lesson 18's hands-on pieces;
`exercises/` holds a checker per exercise at the end of each lesson, run against the package's own code.
"""

from .device_rules import runs_here, timed_on_the_device, workload_size
from .equality import assert_same_tokens, comparable_model
from .ragged_batch import RaggedKVBatch
from .static_batching import StaticBatchRunner

__all__ = ["RaggedKVBatch", "StaticBatchRunner", "assert_same_tokens", "comparable_model", "runs_here",
           "timed_on_the_device", "workload_size"]
