"""`diptych.v1`: the public Inference API (`inference_pb2`, `inference_pb2_grpc`)."""
