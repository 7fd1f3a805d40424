"""Fault injection (--enable-fault-injection) at the engine's hooks and the KV tier and PD seams; only compose.py imports it."""
