"""Tensor building blocks shared by the models: norms, RoPE, linear, embedding, activation, sampler."""
