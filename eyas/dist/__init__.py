"""Tensor parallelism: `apply_tensor_parallel` (sharding transform), `TPEngine` (lockstep engines, rank 0 schedules),
and process-group helpers (`init_distributed`, `shutdown`, `spawn`). See docs/tensor-parallel.md."""
from eyas.dist.launch import free_port, init_distributed, shutdown, spawn
from eyas.dist.tp import TPEngine, VocabParallelEmbedding, VocabParallelHead, apply_tensor_parallel, load_sharded

__all__ = ["apply_tensor_parallel", "load_sharded", "TPEngine", "VocabParallelEmbedding", "VocabParallelHead", "init_distributed",
           "shutdown", "spawn", "free_port"]
