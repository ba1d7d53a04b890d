"""Tensor parallelism (lesson 17): one model's layers split over processes joined by torch.distributed.

`group.py` is the process group a rank computes in and the collectives the layers call; `sharding.py` turns a
model, or a checkpoint as it loads, into one rank's shard.
"""

from .group import TensorParallelGroup, init_tensor_parallel
from .sharding import shard_model_, tensor_parallel_unsupported_reason

__all__ = ["TensorParallelGroup", "init_tensor_parallel", "shard_model_", "tensor_parallel_unsupported_reason"]
