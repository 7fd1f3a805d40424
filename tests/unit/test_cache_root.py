"""Every on-disk cache (GGUF weights, the GGUF tokenizer, the row path, compiled graphs) lives under one root."""
from __future__ import annotations

import pathlib

from radixserve.config import cache_root
from radixserve.tokenizer import default_cache_dir
from radixserve.weights.gguf import cache_path


def test_radixserve_cache_dir_holds_every_cache(tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    assert pathlib.Path(default_cache_dir()).parent == tmp_path / "c"
    assert pathlib.Path(cache_path(str(model))).parent == tmp_path / "c" / "gguf"


def test_default_root_follows_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.delenv("RADIXSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root() == tmp_path / "radixserve"
    assert default_cache_dir() == str(tmp_path / "radixserve" / "tokenizers")
