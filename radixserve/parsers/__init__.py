"""Parsers of chat model output: tool calls (per model format) and reasoning text, incremental, one per choice."""
