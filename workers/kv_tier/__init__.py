"""The shared KV tier: prefix blocks in host memory and on disk, shared by the workers of a model."""
