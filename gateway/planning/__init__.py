"""A request checked into a plan: validation, structured outputs and tools, bounded JSON, tokenization."""
