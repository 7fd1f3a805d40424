"""Cache-aware router: one OpenAI-compatible endpoint in front of many radixserve workers."""
