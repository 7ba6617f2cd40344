"""The model runner and what it stands on: model loading, the KV pool, CUDA graphs, tensor parallelism."""
