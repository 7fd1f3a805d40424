"""Prefill/decode disaggregation: protocol, KV transport, the two sides, and the PD worker (docs/disaggregation.md)."""
