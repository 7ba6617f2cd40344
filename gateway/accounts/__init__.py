"""The caller's account: who asks (API keys), what they may (rate limits, their headers and refusals), their
idempotency keys and the usage journal."""
