"""Prefill/decode disaggregation: wire protocol, KV transport, the two sides, and the engine that runs them (docs/disaggregation.md)."""
