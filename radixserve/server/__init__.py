"""OpenAI-compatible HTTP server: FastAPI process in front of a ZMQ-connected engine process."""
