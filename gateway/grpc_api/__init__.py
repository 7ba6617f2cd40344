"""The public Inference API over gRPC."""
