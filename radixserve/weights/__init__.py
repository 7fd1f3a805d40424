"""Checkpoint readers (safetensors, GGUF) and the name-mapping weight loader."""
