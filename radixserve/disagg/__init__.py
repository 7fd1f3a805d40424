"""Prefill/decode disaggregation: wire protocol, KV transport, the two sides, and the PD worker that drives an Engine with one of them (docs/disaggregation.md)."""
