"""Write the API tests' tiny random-weight model to a folder, for soaks at CI's model size.

    PYTHONPATH=. python benchmarks/make_tiny_model.py DIR

The API tests' `tiny_model_dir` (tests/conftest.py build_tiny_api_model): a 2-layer Llama (hidden 64) with the
default model's tokenizer and vocabulary (49152), an untied LM head, seed 0. Its text means
nothing, but its greedy outputs are deterministic, so the soaks' exact comparison with a
reference run works on it at about 20 times the default model's request rate (the PD
soak: 10,000 requests in 484 s against 500 in 554 s, docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.conftest import build_tiny_api_model  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=pathlib.Path)
    folder = p.parse_args().folder
    folder.mkdir(parents=True, exist_ok=True)
    from radixserve.tokenizer.tokenizer import Tokenizer
    from radixserve.weights.paths import resolve_model_path

    build_tiny_api_model(folder, Tokenizer.load(str(resolve_model_path(None))).hf)
    print(folder)


if __name__ == "__main__":
    main()
