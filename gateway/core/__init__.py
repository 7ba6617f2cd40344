"""The request core, below both fronts: the pipeline, the run on workers, the choices of one request, delivery,
text and logprobs."""
