"""The OpenAI-compatible HTTP API: the app, request bodies, response shapes, errors, the server and the Batch API
proxy."""
