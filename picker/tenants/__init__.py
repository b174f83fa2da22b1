"""Tenants: who sends a request (API key or JWT claim), their limits and their usage.

`keys` is the API-key format and its salted-hash store, `identity` turns a
request's credentials into a configured tenant, `limits` (with its Redis sync)
enforces requests/tokens per minute and concurrency, `usage` counts what each
tenant sent for the metrics.
"""
