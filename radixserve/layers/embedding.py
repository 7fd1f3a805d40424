"""Token embedding lookup; the LM head is a Linear that may share this weight (tied embeddings)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class VocabEmbedding(torch.nn.Module):
    """weight: (vocab_size, hidden_size). forward: ids (T,) int64 -> (T, hidden_size)."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
