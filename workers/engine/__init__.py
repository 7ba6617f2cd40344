"""The engine: its requests, scheduler, KV cache manager and sampling, and the step loop that runs them."""
