"""C++ kernels, built by install.sh (`python -m radixserve.csrc.build`), never at run time."""
from __future__ import annotations

import pathlib

LIBRARY = pathlib.Path(__file__).with_name("_radixserve_ops.so")
SOURCES = [pathlib.Path(__file__).with_name(name)
           for name in ("int4_int8.cpp", "int4_fp32.cpp", "decode_attention.cpp", "q8_fp32.cpp")]
