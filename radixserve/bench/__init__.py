"""Benchmark and trace replay against OpenAI-compatible servers (HTTP only; imports without torch)."""
