"""The model side of the runner: the paged attention (`attention`), the decoder a step runs (`decoder`) and
the architectures it is built from (`families`)."""
