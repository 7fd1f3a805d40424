"""create_backend: which attention backend each name and device gets, cascade on the CPU mirror, and the errors for triton where it cannot run (no triton needed)."""
from __future__ import annotations

import pytest
import torch

from radixserve.runner.attention import base
from radixserve.runner.kv_cache import KVCache


@pytest.fixture
def kv() -> KVCache:
    return KVCache(1, 4, 4, 2, 16, torch.float32)


def test_without_triton(monkeypatch, kv):
    monkeypatch.setattr(base, "BACKENDS", ("torch",))
    assert base.create_backend("auto", kv, torch.device("cpu")).name == "torch"
    assert base.create_backend("auto", kv, torch.device("cuda")).name == "torch"   # auto falls back
    with pytest.raises(ValueError, match="needs the triton package"):
        base.create_backend("triton", kv, torch.device("cuda"))
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        base.create_backend("flash", kv, torch.device("cpu"))


def test_triton_on_cpu_needs_the_interpreter(monkeypatch, kv):
    monkeypatch.setattr(base, "BACKENDS", ("torch", "triton"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert base.create_backend("auto", kv, torch.device("cpu")).name == "torch"
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        base.create_backend("triton", kv, torch.device("cpu"))


def test_cascade_attention_is_on_for_the_cpu_mirror_unless_disabled(kv):
    assert base.create_backend("torch", kv, torch.device("cpu")).mirror.cascade
    assert not base.create_backend("torch", kv, torch.device("cpu"), cascade=False).mirror.cascade
    assert base.create_backend("torch", kv, torch.device("cuda")).mirror is None    # no mirror, no cascade
