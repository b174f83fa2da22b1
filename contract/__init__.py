"""The bottom layer: what every other layer of the gateway agrees on.

- `config`: the `InferenceGatewayConfig` model, its defaults and strict loading;
- `errors`: every client-visible error, as a typed exception with its OpenAI body;
- `headers`: the header, metadata and attribute names of the Envoy ↔ picker contract;
- `endpoints`: `host:port` addresses, parsed and resolved the one way both sides use.

It imports no other first-party package, so bbr, igw_envoy, picker and igw can
all build on it without importing each other (tests/test_layering.py checks).
"""
