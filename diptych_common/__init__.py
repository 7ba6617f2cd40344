"""Code shared by the gateway and the workers: generated internal stubs, the internal REST API's client and
messages (which the control plane and the command line use too), built-in model assets, tokenizer loading and
incremental detokenization. Depends on neither torch nor Django."""
