"""Tensor parallelism across processes: the communicator over torch.distributed (docs/parallel.md)."""
