"""Diptych workers: the model runner, the prefill and decode engines, KV transfer and the gRPC server."""
