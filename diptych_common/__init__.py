"""Code shared by the gateway and the workers: generated internal stubs, built-in model assets,
tokenizer loading and incremental detokenization. Depends on neither torch nor Django."""
