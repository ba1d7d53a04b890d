"""`EngineStats`: a snapshot of an engine's memory, queues, set-up and counters (`LLMEngine.stats()`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's memory and queues (lessons, tests, benchmarks and the server read it)."""

    num_total_blocks: int
    num_free_blocks: int  # never used or cached-but-unreferenced (evictable)
    num_cached_blocks: int  # blocks named in the prefix cache, held or not
    block_size: int
    num_running: int
    num_waiting: int  # sequences: waiting to start or to run again, and forks yet to be made
    num_preemptions: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_failed_requests: int = 0  # requests a failed step finished with an error
    num_waiting_requests: int = 0  # requests none of whose sequences runs (what a server's back-pressure counts)
    attention_backend: str = ""  # the attention backend's name (lesson 11)
    # How the engine set the model up when it was built (a later engine on the same model may set it up again):
    prepacked_weights: bool = False  # the model's linear layers run on oneDNN-packed weights (prepack_weights)
    pointwise_ops: str = "eager"  # "compiled" when the layers' pointwise parts run through torch.compile
    cuda_graph_sizes: tuple[int, ...] = ()  # the batch sizes captured as CUDA graphs (none: every step eager)
    compiled_model: bool = False  # steps whose attention allows it run as one compiled graph (compile_model)
    num_compiled_steps: int = 0  # steps that ran as the compiled graph
    native_step: bool = False  # steps of a few tokens run as one native call (native_step)
    num_native_steps: int = 0  # steps that ran as the native call
    num_graph_replays: int = 0  # decode steps that ran from a CUDA graph
    # Speculative decoding (lesson 14): drafts verified, drafts kept, and [a]: verifications that kept a drafts.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_length_counts: tuple[int, ...] = ()
    # Jump-forward (lesson 15): tokens a grammar forced, verified as drafts, and how many of them the model kept.
    num_forced_tokens: int = 0
    num_accepted_forced_tokens: int = 0
    plan: str = ""  # how the engine set the model up, choice by choice, and why (worker/plan.py's describe())

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        queried = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / queried if queried else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Kept drafts over verified drafts (0 without speculation)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a sequence gained per verification: the drafts it kept and the one drawn after them."""
        verifications = sum(self.accepted_length_counts)
        return 1 + self.num_accepted_tokens / verifications if verifications else 0.0
