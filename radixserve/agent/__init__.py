"""Ops agent: watches a fleet through its router and workers, and drains, restarts or isolates."""
