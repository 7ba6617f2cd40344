"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) on the gateway's HTTP port,
beside the OpenAI-compatible API, mapped onto the same GenerationRequest and run through the same pipeline."""
