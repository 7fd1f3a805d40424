"""weights/gguf_header.read_scalars against gguf.GGUFReader on files written by gguf.GGUFWriter."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from radixserve.weights.gguf_header import read_scalars

SCALARS = {"a.u8": (7, GGUFValueType.UINT8), "a.i8": (-7, GGUFValueType.INT8),
           "a.u16": (700, GGUFValueType.UINT16), "a.i16": (-700, GGUFValueType.INT16),
           "a.u32": (70000, GGUFValueType.UINT32), "a.i32": (-70000, GGUFValueType.INT32),
           "a.f32": (0.5, GGUFValueType.FLOAT32), "a.bool": (True, GGUFValueType.BOOL),
           "a.u64": (2**40, GGUFValueType.UINT64), "a.i64": (-2**40, GGUFValueType.INT64),
           "a.f64": (0.25, GGUFValueType.FLOAT64), "a.str": ("{{ héllo }} ✓", GGUFValueType.STRING)}


@pytest.fixture
def gguf_file(tmp_path) -> str:
    path = str(tmp_path / "m.gguf")
    w = GGUFWriter(path, "llama")
    w.add_array("tokenizer.ggml.tokens", ["<s>", "a", "b", "héllo"])   # arrays come first: they
    w.add_array("tokenizer.ggml.scores", [0.0, 1.0, 2.0, 3.0])        # must be skipped exactly
    w.add_array("nested", [[1, 2], [3]])
    for key, (value, kind) in SCALARS.items():
        w.add_key_value(key, value, kind)
    w.add_tensor("t", np.zeros((2, 3), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_scalars_equal_gguf_reader_and_arrays_are_left_out(gguf_file):
    got = read_scalars(gguf_file, [*SCALARS, "tokenizer.ggml.tokens", "nested", "absent"])
    fields = GGUFReader(gguf_file).fields
    assert set(got) == set(SCALARS)
    for key, value in got.items():
        assert value == fields[key].contents() == pytest.approx(SCALARS[key][0]), key
    assert type(got["a.bool"]) is bool and isinstance(got["a.u64"], int)
    assert read_scalars(gguf_file, ["general.architecture"]) == {"general.architecture": "llama"}


def test_not_gguf_or_cut_short_is_value_error(gguf_file, tmp_path):
    text = tmp_path / "x.gguf"
    text.write_bytes(b"not a gguf file at all, just text" * 4)
    with pytest.raises(ValueError, match="not a little-endian GGUF"):
        read_scalars(str(text), ["a.u8"])
    data = open(gguf_file, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:60])   # inside the token array
    with pytest.raises(ValueError, match="ends early"):
        read_scalars(str(cut), ["a.str"])


def test_big_endian_file_is_refused_here_and_read_by_the_tokenizer_fallback(tmp_path):
    from gguf import GGUFEndian

    from radixserve.tokenizer.tokenizer import _gguf_tokenizer_meta

    path = str(tmp_path / "be.gguf")
    w = GGUFWriter(path, "llama", endianess=GGUFEndian.BIG)
    w.add_eos_token_id(7)
    w.add_chat_template("{{ messages }}")
    w.add_tensor("t", np.zeros((2, 3), dtype=np.float32).byteswap())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="not a little-endian GGUF"):
        read_scalars(path, ["tokenizer.ggml.eos_token_id"])
    assert _gguf_tokenizer_meta(path) == {"eos_token_ids": [7], "chat_template": "{{ messages }}"}
