"""Scalar metadata of a GGUF file, read without building its vocabulary arrays.

Walks GGUF v2/v3's key-value section (the ggml GGUF spec), skipping the arrays `gguf.GGUFReader` would build."""
from __future__ import annotations

import mmap
import struct
from typing import Any, Iterable

from gguf import GGUF_MAGIC, GGUFValueType

_SCALAR = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
           GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
           GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
           GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}


def read_scalars(path: str, keys: Iterable[str]) -> dict[str, Any]:
    """Scalar/string values of `keys` (arrays, absent keys omitted); ValueError: not LE GGUF v2/v3, or cut short."""
    wanted = set(keys)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            return _walk(buf, wanted)
        except struct.error as exc:
            raise ValueError(f"{path}: GGUF metadata ends early ({exc})") from None


def _walk(buf: mmap.mmap, wanted: set[str]) -> dict[str, Any]:
    magic, version = struct.unpack_from("<II", buf, 0)
    if magic != GGUF_MAGIC or version not in (2, 3):
        raise ValueError(f"not a little-endian GGUF v2/v3 file (magic {magic:#x}, version {version})")
    _, num_keys = struct.unpack_from("<QQ", buf, 8)
    pos, found = 24, {}
    for _ in range(num_keys):
        key, pos = _string(buf, pos)
        (kind,), pos = struct.unpack_from("<I", buf, pos), pos + 4
        if key in wanted and kind != GGUFValueType.ARRAY:
            found[key], pos = _value(buf, pos, kind)
        else:
            pos = _skip(buf, pos, kind)
    return found


def _string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    end = pos + 8 + n
    if end > len(buf):
        raise struct.error("string past the end of the file")
    return buf[pos + 8:end].decode("utf-8", errors="replace"), end


def _value(buf: mmap.mmap, pos: int, kind: int) -> tuple[Any, int]:
    if kind == GGUFValueType.STRING:
        return _string(buf, pos)
    fmt = _SCALAR.get(kind)
    if fmt is None:
        raise ValueError(f"unknown GGUF value type {kind}")
    return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)


def _skip(buf: mmap.mmap, pos: int, kind: int) -> int:
    if kind != GGUFValueType.ARRAY:
        return _value(buf, pos, kind)[1]
    item_kind, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    fmt = _SCALAR.get(item_kind)
    if fmt is not None:
        return pos + count * struct.calcsize(fmt)
    for _ in range(count):
        pos = _skip(buf, pos, item_kind)
    return pos
