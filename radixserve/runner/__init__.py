"""Everything that touches tensors: KV cache, per-step batch tensors, attention, the model runner."""
