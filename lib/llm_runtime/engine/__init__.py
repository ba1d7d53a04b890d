"""The engine: requests in, one step at a time (schedule -> run -> postprocess), outputs out.

`llm.py` is the offline API over `engine.py`'s `LLMEngine`; a request is a `Sequence` per
completion; `scheduler.py` picks each step's work under the KV pool that `block_manager.py` and
`prefix_cache.py` keep the books of; `model_runner.py` runs it; `outputs.py` is what comes back.
`generate.py` is the single-request loop of the first lessons, the reference the engine is tested against.
"""

from .block_manager import BlockAllocator, BlockManager
from .detokenizer import IncrementalDetokenizer
from .engine import EngineStats, LLMEngine
from .generate import generate
from .llm import LLM
from .model_runner import ModelRunner
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .scheduler import ScheduledBatch, Scheduler, StepRecord
from .sequence import Sequence, SequenceStatus

__all__ = [
    "LLM",
    "BlockAllocator",
    "BlockManager",
    "CompletionOutput",
    "EngineStats",
    "IncrementalDetokenizer",
    "LLMEngine",
    "ModelRunner",
    "RequestMetrics",
    "RequestOutput",
    "ScheduledBatch",
    "Scheduler",
    "Sequence",
    "SequenceStatus",
    "StepRecord",
    "generate",
]
