"""The engine: requests in, one step at a time (schedule -> run -> postprocess), outputs out.

`llm.py` is the offline API over `engine.py`'s `LLMEngine`, which turns requests into sequences
(`input_processor.py`) and steps into outputs (`output_processor.py`, `outputs.py`) around the
`EngineCore` (`engine_core.py`): the scheduler and the KV blocks' books (`core/`) over an executor
(`executor/`) that runs each step on the workers that own the device (`worker/`).
`generate.py` is the single-request loop of the first lessons, the reference the engine is tested against.
"""

from ..core.block_manager import BlockAllocator, BlockManager
from ..core.scheduler import ScheduledBatch, Scheduler, StepRecord
from ..core.sequence import Sequence, SequenceStatus
from ..worker.model_runner import ModelRunner
from .detokenizer import IncrementalDetokenizer
from .engine import LLMEngine
from .engine_core import EngineCore
from .generate import generate
from .llm import LLM
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .stats import EngineStats

__all__ = [
    "LLM",
    "BlockAllocator",
    "BlockManager",
    "CompletionOutput",
    "EngineCore",
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
