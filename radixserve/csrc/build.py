"""`python -m radixserve.csrc.build`: compile SOURCES into LIBRARY (g++ and ninja via torch); exit 1 if it cannot."""
from __future__ import annotations

import shutil
import sys
import tempfile

from radixserve.csrc import LIBRARY, SOURCES

FLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-fopenmp"]


def build() -> None:
    from torch.utils.cpp_extension import load

    with tempfile.TemporaryDirectory() as tmp:
        load(name=LIBRARY.stem, sources=[str(s) for s in SOURCES], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
             build_directory=tmp, is_python_module=False, verbose=False)
        shutil.copyfile(f"{tmp}/{LIBRARY.name}", f"{LIBRARY}.tmp")
    shutil.move(f"{LIBRARY}.tmp", LIBRARY)


if __name__ == "__main__":
    try:
        build()
    except (RuntimeError, OSError, ImportError, ValueError) as exc:
        print(f"radixserve.csrc.build: not built ({exc}); the int4-int8 and int4-fp32 layers run their torch references")
        sys.exit(1)
    print(f"radixserve.csrc.build: built {LIBRARY}")
